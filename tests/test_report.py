"""The leaderboard: built from traces, the committed one current."""
import json
import shutil

import pytest

from conftest import PROJECT
from harness import HarnessError, report
from harness.ops import leapquant_kda_flush as op
from harness.records import DeployRecord, DriftRecord, StressRecord, Trace


def _trace(solution, batch, family, latency, ref, status="PASSED", ratio=1.002, hardware="NVIDIA_H200", sha="abc"):
    ev = {"status": status, "environment": {"hardware": hardware, "libs": {"torch": "2.11"}},
          "timestamp": "2026-12-02T00:00:00+00:00", "log": ""}
    if status == "PASSED":
        ev["correctness"] = {"max_relative_error": 0.01, "max_absolute_error": 0.1,
                             "extra": {"family": family, "worst_head_ratio": ratio}}
        ev["performance"] = {"latency_ms": latency, "reference_latency_ms": ref,
                             "speedup_factor": ref / latency if latency else 0.0, "floor_ms": 0.025}
    return Trace.model_validate({"definition": "d", "solution": solution, "solution_sha256": sha, "evaluation": ev,
                                 "workload": {"uuid": f"{batch}-{family}", "axes": {"batch_size": batch},
                                              "inputs": {}}})


def test_summary_and_rows():
    traces = [_trace("reference", 64, f, 3.0, 3.0) for f in ("a", "b")]
    traces += [_trace("fast", 64, "a", 0.05, 3.0, ratio=1.004), _trace("fast", 64, "b", 0.1, 3.0)]
    traces += [_trace("fast", 128, "a", None, None, status="TIMEOUT")]
    text, series = report.build(traces, op, current={("d", "fast"): "abc", ("d", "reference"): "abc"})
    summary = next(line for line in text.splitlines() if line.startswith("| fast "))
    cells = [c.strip() for c in summary.strip("|").split("|")]
    # 3 workloads, 2 passed; speedups 60 and 30: geomean 42.43; fast_1 = fast_10 = fast_30 share 2/3 (30 is not > 30)
    assert cells == ["fast", "current", "UNSANDBOXED (RECORDED WITHOUT ISOLATION)", "3", "2", "42.43", "0.67", "0.67",
                     "0.33", "0.00"]
    row64 = next(line for line in text.splitlines() if line.startswith("| fast ") and "| 64 " in line)
    assert "| PASSED " in row64 and "| 75.0 " in row64 and "| 3.00 " in row64 and "1.0040" in row64
    assert "TIMEOUT (1/1)" in text
    assert sorted(series) == ["fast", "memory floor", "reference"]


def test_isolation_is_shown_and_a_downgrade_is_loud():
    sandboxed, bare = _trace("fast", 64, "a", 0.1, 3.0), _trace("fast", 128, "a", 0.1, 3.0)
    sandboxed.evaluation.environment.sandbox = "bwrap"
    assert report.isolation_state([sandboxed]) == "bwrap"
    bare.evaluation.environment.sandbox = "unsandboxed (no bwrap)"
    assert report.isolation_state([sandboxed, bare]) == "UNSANDBOXED (NO BWRAP); bwrap"


def test_every_solution_against_the_fastest_measured_copy_rate():
    slow_copy = _trace("fast", 64, "a", 0.1, 3.0)
    slow_copy.evaluation.performance.floor_ms = 0.05          # a run whose copy came out at half the rate
    other_hw = _trace("other", 64, "a", 0.1, 3.0, hardware="NVIDIA_B200")
    other_hw.evaluation.performance.floor_ms = 0.01
    traces = [slow_copy, _trace("reference", 64, "a", 3.0, 3.0), other_hw]
    assert report.best_floors(traces) == {("NVIDIA_H200", 64): 0.025, ("NVIDIA_B200", 64): 0.01}
    text, series = report.build(traces, op, current={})
    row = next(line for line in text.splitlines() if line.startswith("| fast ") and "| PASSED " in line)
    assert "| 4.00 " in row                                            # 0.1 ms over 0.025 ms, not over 0.05 ms


def test_each_hardware_has_tables_of_its_own():
    """A latency, floor or speedup is compared only with others measured on the same card: two hardwares give two
    sections, neither mixing the other's figures in, and the plot shows the one with more solutions."""
    traces = [_trace("reference", 64, "a", 3.0, 3.0), _trace("fast", 64, "a", 0.1, 3.0),
              _trace("reference", 64, "a", 5.0, 5.0, hardware="NVIDIA_H100"),
              _trace("reference", 64, "b", 7.0, 7.0, hardware="NVIDIA_H100")]
    text, series = report.build(traces, op, current={})
    lines = text.splitlines()
    h200, h100 = lines.index("### NVIDIA_H200"), lines.index("### NVIDIA_H100")
    assert h200 < h100 and "on NVIDIA_H200" in text
    rows_h200 = [line for line in lines[h200:h100] if line.startswith("| reference ") and "| 64 " in line]
    rows_h100 = [line for line in lines[h100:] if line.startswith("| reference ") and "| 64 " in line]
    assert len(rows_h200) == len(rows_h100) == 1
    assert "| 3000.0 " in rows_h200[0] and "| 6000.0 " in rows_h100[0]        # medians of 3 ms and of 5 and 7 ms
    assert series["reference"] == [(64, 3.0)]


def test_sources_state():
    traces = [_trace("x", 1, "a", 0.5, 1.0, sha="old"), _trace("x", 2, "a", 0.5, 1.0, sha="new")]
    assert report.sources_state(traces, "new") == "older: re-run"
    assert report.sources_state(traces[1:], "new") == "current"
    assert report.sources_state([_trace("x", 1, "a", 0.5, 1.0, sha=None)], "new") == "unrecorded"
    assert report.sources_state(traces, None) == "removed"


def test_cpu_traces_left_out(tmp_path):
    (tmp_path / "d").mkdir()
    lines = [_trace("x", 1, "a", 0.0, 0.0, hardware="CPU_x86_64"), _trace("x", 1, "b", 0.5, 1.0)]
    (tmp_path / "d" / "x.jsonl").write_text("".join(json.dumps(t.to_json()) + "\n" for t in lines))
    assert [t.hardware for t in report.load_all(tmp_path)] == ["NVIDIA_H200"]


@pytest.mark.parametrize("mutate, field", [
    (lambda t: t["evaluation"].update(status="FINE"), "evaluation.status"),
    (lambda t: t["evaluation"]["performance"].update(latency_ms=-1.0), "evaluation.performance.latency_ms"),
    (lambda t: t["workload"].pop("uuid"), "workload.uuid"),
])
def test_a_malformed_trace_is_one_line_naming_the_field(tmp_path, mutate, field):
    (tmp_path / "d").mkdir()
    good, bad = _trace("x", 1, "a", 0.5, 1.0).to_json(), _trace("x", 2, "a", 0.5, 1.0).to_json()
    mutate(bad)
    (tmp_path / "d" / "x.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(HarnessError) as err:
        report.load_all(tmp_path)
    assert f"x.jsonl:2: field '{field}'" in str(err.value) and "\n" not in str(err.value)


def test_committed_leaderboard_is_current():
    text, _ = report.leaderboard(op, PROJECT)
    assert PROJECT.leaderboard.read_text() == text, "stale: run `python -m harness.report` and commit"


def _deploy(sha="abc"):
    rows = [{"case": "all due", "batch_size": 64, "due_programs": 2048, "median_us": 300.0, "floor_us": 27.0,
             "x_floor": 11.11, "checked": True},
            {"case": "none due", "batch_size": 512, "due_programs": 0, "median_us": 3.2, "floor_us": None,
             "x_floor": None, "checked": False, "target_us": 5.0}]
    return DeployRecord.model_validate({
        "definition": "d", "solution": "fast", "solution_sha256": sha, "environment": {"hardware": "NVIDIA_H200"},
        "sandbox": "bwrap", "family": "random", "copy_bandwidth": 4.1e12, "bytes_per_program": 56448,
        "timed_calls": 50, "empty_graph_us": 2.9, "rows": rows})


def _drift(ratio):
    worst = {"window": 7, "error": 0.5, "reference_error": 0.49, "ratio": ratio, "worst_head_ratio": None}
    return DriftRecord.model_validate({
        "definition": "d", "solution": "fast", "solution_sha256": "abc", "environment": {"hardware": "NVIDIA_H200"},
        "windows": 64, "batch_size": 16, "seed": 0, "limit": 1.01, "worst": worst, "rows": [worst]})


def _stress(failures):
    return StressRecord.model_validate({
        "definition": "d", "solution": "fast", "solution_sha256": "abc", "environment": {"hardware": "NVIDIA_H200"},
        "examples": 300, "calls": 340, "batch_size": 1, "seed": None, "hypothesis": "6.100", "seconds": 400.0,
        "timestamp": "2026-12-02T00:00:00+00:00", "failures": failures})


def test_deployment_drift_and_stress_sections():
    current = {("d", "fast"): "abc"}
    text, _ = report.build([], op, current=current)
    assert "## Deployment form" in text and "## Drift over many windows" in text
    assert "## Search for breaking inputs" in text
    assert text.count("Nothing recorded yet") == 3
    text, _ = report.build([], op, current=current, deploy=[_deploy(sha="old")], drift=[_drift(1.02)])
    lines = text.splitlines()
    all_due = next(line for line in lines if "| all due " in line)
    assert all(f"| {c} " in all_due for c in ("fast", "older: re-run", "64", "2048", "300.0", "27.0", "11.11", "yes"))
    none_due = next(line for line in lines if "| none due " in line)
    assert "| 3.2 " in none_due and "| 5.0 " in none_due and "| FAILED " in none_due
    empty = next(line for line in lines if "| empty kernel (timer floor) " in line)
    assert "| 2.9 " in empty and "| fast " in empty
    worst = next(line for line in lines if line.startswith("| fast ") and "| 64 " in line and "| 7 " in line)
    assert "| current " in worst and "| 1.0200 " in worst and "1.01 EXCEEDED" in worst
    assert text.count("Nothing recorded yet") == 1
    failure = {"status": "INCORRECT_NUMERICAL", "log": "non-finite values in u_new at (batch 0, head 3)",
               "params": {}, "seed": 1, "reproducer": "stress/x.jsonl"}
    text, _ = report.build([], op, current=current, stress=[_stress([failure, failure])])
    searched = next(line for line in text.splitlines() if line.startswith("| fast ") and "| 340 " in line)
    assert all(f"| {c} " in searched for c in ("current", "NVIDIA_H200", "300", "2 FAILED"))
    assert "non-finite values in u_new" in searched
    text, _ = report.build([], op, current=current, stress=[_stress([])])
    assert "| clean " in next(line for line in text.splitlines() if "| 340 " in line)


def test_records_loaded_by_kind(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "deploy_fast.json").write_text(json.dumps(_deploy().to_json()))
    (tmp_path / "d" / "drift_fast.json").write_text(json.dumps(_drift(1.0).to_json()))
    assert [r.rows[0].case for r in report.load_records("deploy", tmp_path)] == ["all due"]
    assert [r.worst.ratio for r in report.load_records("drift", tmp_path)] == [1.0]
    (tmp_path / "d" / "stress_fast.json").write_text(json.dumps(_stress([]).to_json()))
    assert [r.examples for r in report.load_records("stress", tmp_path)] == [300]
    (tmp_path / "d" / "stress_fast.json").write_text(json.dumps({**_stress([]).to_json(), "calls": "many"}))
    with pytest.raises(HarnessError, match=r"stress_fast.json: field 'calls': "):
        report.load_records("stress", tmp_path)
    assert report.load_all(tmp_path) == []


def test_other_traces_never_overwrite_the_committed_leaderboard(tmp_path, capsys):
    """--traces DIR writes beside those traces (or to --out); a board with GPU rows is not replaced by one without
    them unless --force."""
    committed = PROJECT.leaderboard.read_text()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert report.main(["--traces", str(empty)]) == 0
    assert PROJECT.leaderboard.read_text() == committed
    assert "No timed traces yet" in (empty / "LEADERBOARD.md").read_text()
    out = tmp_path / "out"
    out.mkdir()
    (out / "LEADERBOARD.md").write_text(committed)
    assert report.main(["--traces", str(empty), "--out", str(out)]) == 2
    assert "has GPU results" in capsys.readouterr().err and (out / "LEADERBOARD.md").read_text() == committed
    assert report.main(["--traces", str(empty), "--out", str(out), "--force"]) == 0
    assert "No timed traces yet" in (out / "LEADERBOARD.md").read_text()


def test_ci_report_gives_cpu_verdicts_standings_and_pending_gpu(tmp_path, tmp_project, defn):
    """Each solution folder gets a CPU verdict (a CUDA one skipped, a broken one COMPILE_ERROR) and, without GPU
    traces of its current sources, a line under "Pending GPU"."""
    solutions = tmp_project.solutions
    for name in ("torch_v1", "cuda_v1"):
        shutil.copytree(PROJECT.solutions / name, solutions / name)
    (solutions / "half_done").mkdir()
    (solutions / "half_done" / "solution.json").write_text('{"name": "half_done", "definition": "%s"}' % defn.name)
    cpu = tmp_path / "cpu" / defn.name
    cpu.mkdir(parents=True)
    passed = _trace("torch_v1", 1, "random", 0.0, 0.0, hardware="CPU_x86_64").to_json()
    failed = _trace("torch_v1", 2, "edge", None, None, status="INCORRECT_NUMERICAL", hardware="CPU_x86_64").to_json()
    for t in (passed, failed):
        t["definition"] = defn.name
    (cpu / "torch_v1.jsonl").write_text("".join(json.dumps(Trace.model_validate(t).to_json()) + "\n"
                                                for t in (passed, failed)))
    text = report.ci_report(defn, tmp_path / "cpu", tmp_project)     # the project has no traces/
    lines = text.splitlines()
    cpu_rows = lines[lines.index("## CPU verdicts"):lines.index("## Committed GPU standings")]
    assert any("| torch_v1 " in r and "INCORRECT_NUMERICAL (1/2)" in r for r in cpu_rows)
    assert any("| cuda_v1 " in r and "skipped: a CUDA solution needs a GPU" in r for r in cpu_rows)
    assert any("| half_done " in r and "COMPILE_ERROR: " in r and "field 'author'" in r for r in cpu_rows)
    pending = lines[lines.index("## Pending GPU"):]
    assert [r.split("|")[1].strip() for r in pending if r.startswith("| ") and "solution" not in r] == \
        ["cuda_v1", "half_done", "torch_v1"]
