"""The CLI as users call it: every solution folder passes every family on CPU, and bad input exits cleanly."""
import json
import re
from pathlib import Path

import pytest
import torch

from conftest import DEFINITION, PROJECT, make_solution
from harness import run
from harness.ops import leapquant_kda_flush as op
from harness.definition import find_definition
from harness.solutions import discover, load_entry, load_solution, source_sha256, unmet_needs
from harness.workloads import load_workloads, select

SOLUTIONS = discover(find_definition(DEFINITION, PROJECT.definitions), PROJECT.solutions)


@pytest.mark.parametrize("name", SOLUTIONS)
def test_solution_passes_every_family_on_cpu(name, defn, capsys):
    sol = load_solution(name, defn, PROJECT.solutions)
    if unmet_needs(sol, "cpu"):
        pytest.skip(f"{name} does not run here ({unmet_needs(sol, 'cpu')}): its compile test checks its sources")
    code = run.main(["--solution", name, "--device", "cpu", "--batch-sizes", "1,2", "--no-traces"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count(" PASSED ") >= 8, out
    counts = re.findall(rf"^  \[{name} (\d+)/(\d+)\] ", out, re.M)      # each result line counts the run on
    assert [int(done) for done, _ in counts] == list(range(1, len(counts) + 1)), out
    assert {int(total) for _, total in counts} == {len(counts)}, out


def test_failing_solution_exits_nonzero_and_others_still_run(tmp_project, capsys):
    root = tmp_project.solutions
    make_solution(root, "broken", "def run(*x):\n    raise RuntimeError('kaput')\n")
    make_solution(root, "fine", "from flush import run as flush\n\ndef run(*x):\n    return flush(*x)\n")
    code = run.main(["--solution", "broken", "--solution", "fine", "--device", "cpu", "--batch-sizes", "1",
                     "--families", "edge", "--no-traces", "--project", str(tmp_project.root)])
    out = capsys.readouterr().out
    assert code == 1
    assert "RUNTIME_ERROR" in out and "RuntimeError: kaput" in out and "Traceback" not in out
    assert [line.split()[3] for line in out.splitlines() if line.startswith(("broken ", "fine "))] == \
        ["RUNTIME_ERROR", "PASSED"]


@pytest.mark.parametrize("argv, message", [
    (["--solution", "nope"], "no such solution"),
    (["--batch-sizes", "3"], "no workload with batch_size=3"),
    (["--families", "gaussian"], "no workload of family 'gaussian'"),
    (["--definition", "other"], "no definition named 'other'"),
])
def test_bad_arguments_one_line(argv, message, capsys):
    assert run.main(argv + ["--device", "cpu", "--no-traces"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cpu_run_writes_traces_when_asked(tmp_path, defn, capsys):
    assert run.main(["--solution", "torch_v1", "--device", "cpu", "--batch-sizes", "1", "--families", "random",
                     "--traces", str(tmp_path)]) == 0
    [line] = (tmp_path / DEFINITION / "torch_v1.jsonl").read_text().splitlines()
    trace = json.loads(line)
    assert trace["evaluation"]["status"] == "PASSED" and trace["solution"] == "torch_v1"
    assert trace["evaluation"]["performance"]["latency_ms"] == 0.0          # judged, not timed
    assert trace["evaluation"]["correctness"]["extra"]["family"] == "random"
    assert trace["solution_sha256"] == source_sha256(load_solution("torch_v1", defn, PROJECT.solutions), defn)
    (tmp_path / DEFINITION / "torch_v1.jsonl").write_text(line.replace('"PASSED"', '"FINE"') + "\n")
    assert run.main(["--solution", "torch_v1", "--device", "cpu", "--batch-sizes", "1", "--families", "random",
                     "--traces", str(tmp_path)]) == 2                        # refused before anything runs
    assert "torch_v1.jsonl:1: field 'evaluation.status'" in capsys.readouterr().err


def test_save_outputs_writes_what_the_solution_returned_on_each_workload(tmp_path, defn, capsys):
    from safetensors.torch import load_file

    from harness.workloads import load_inputs
    assert run.main(["--solution", "torch_v1", "--device", "cpu", "--batch-sizes", "1", "--families", "random,edge",
                     "--no-traces", "--save-outputs", str(tmp_path)]) == 0
    saved = sorted(p.name for p in (tmp_path / "torch_v1").iterdir())
    assert saved == ["edge_batch_size1.safetensors", "random_batch_size1.safetensors"], saved
    [w] = select(load_workloads(defn, PROJECT.workload_file(defn)), [1], ["edge"])
    inputs = load_inputs(defn, w, root=PROJECT.root)
    outputs = load_file(tmp_path / "torch_v1" / "edge_batch_size1.safetensors")
    assert set(outputs) == set(defn.outputs)
    direct = load_entry(load_solution("torch_v1", defn, PROJECT.solutions), defn)(inputs, defn.resolve_axes(w.axes))
    assert all(torch.equal(outputs[name], t) for name, t in zip(defn.outputs, direct))
    assert run.main(["--solution", "torch_v1", "--ray", "auto", "--save-outputs", str(tmp_path)]) == 2
    assert "--ray with --save-outputs" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("")
    assert run.main(["--solution", "torch_v1", "--device", "cpu", "--save-outputs", str(tmp_path / "a_file")]) == 2
    assert capsys.readouterr().err.startswith(f"error: --save-outputs {tmp_path / 'a_file'}: ")


def test_a_run_writes_each_trace_as_its_workload_finishes(tmp_path, monkeypatch):
    """A run cut short (a time limit, a lost machine) keeps the traces of the workloads it finished."""
    from harness import traces
    written, write = [], traces.write_traces
    monkeypatch.setattr(traces, "write_traces", lambda records, root: written.append(len(records)) or
                        write(records, root))
    assert run.main(["--solution", "torch_v1", "--device", "cpu", "--batch-sizes", "1", "--families", "random,edge",
                     "--traces", str(tmp_path)]) == 0
    assert written == [1, 1]
    assert len((tmp_path / DEFINITION / "torch_v1.jsonl").read_text().splitlines()) == 2


def test_table_shows_the_floor_and_the_ratio_when_timed():
    from harness.runner import Result
    from harness.workloads import Workload
    w = Workload("d", "u", {"batch_size": 64}, {}, "random", 1, "")
    timed = Result("fast", w, "PASSED", latency_ms=0.1, floor_ms=0.025)
    untimed = Result("cpu", w, "PASSED")
    rows = {line.split()[0]: line.split() for line in run.table([timed, untimed], op).splitlines()[2:]}
    assert rows["fast"][5:8] == ["100.0", "25.0", "4.00"]
    assert rows["cpu"][5:8] == ["-", "-", "-"]


def test_seed_judges_fresh_inputs_and_leaves_the_workloads_alone(tmp_path, defn, monkeypatch, capsys):
    committed = PROJECT.workload_file(defn).read_bytes()
    seen = []
    evaluate = run.evaluate

    def spy(defn, sol, workloads, device, *, root, **kwargs):
        seen.extend((w, Path(root) != PROJECT.root and (Path(root) / w.blob).exists()) for w in workloads)
        return evaluate(defn, sol, workloads, device, root=root, **kwargs)
    monkeypatch.setattr(run, "evaluate", spy)
    code = run.main(["--solution", "torch_v1", "--device", "cpu", "--batch-sizes", "1", "--families", "edge",
                     "--seed", "7", "--traces", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and " PASSED " in out and "fresh inputs from base seed 7" in out, out
    [(fresh, blob_written)] = seen
    [original] = select(load_workloads(defn, PROJECT.workload_file(defn)), (1,), ("edge",))
    assert blob_written and fresh.family == "edge" and fresh.axes == original.axes
    assert fresh.seed != original.seed and fresh.sha256 != original.sha256
    assert PROJECT.workload_file(defn).read_bytes() == committed
    assert not any(tmp_path.iterdir())                                       # fresh inputs write no traces


def test_a_broken_folder_is_one_status_line_and_the_others_run(tmp_project, capsys):
    """A solution.json that does not parse and an entry point that does not import: one COMPILE_ERROR line each,
    the other solutions judged, exit 1; named alone on the command line, the folder is bad input (exit 2)."""
    root = tmp_project.solutions
    project = ["--project", str(tmp_project.root)]
    make_solution(root, "fine", "from flush import run as flush\n\ndef run(*x):\n    return flush(*x)\n")
    make_solution(root, "no_import", "import no_such_module\n")
    (root / "half_written").mkdir()
    (root / "half_written" / "solution.json").write_text('{"name": "half_written", "definition": ')
    code = run.main(["--device", "cpu", "--batch-sizes", "1", "--families", "edge,random", "--no-traces", *project])
    out = capsys.readouterr().out
    assert code == 1
    rows = [line.split() for line in out.splitlines() if line.startswith(("fine ", "no_import ", "half_written "))]
    statuses = {(r[0], r[3]) for r in rows}
    assert statuses == {("fine", "PASSED"), ("no_import", "COMPILE_ERROR"), ("half_written", "COMPILE_ERROR")}
    assert sum(r[0] == "no_import" for r in rows) == 1 and sum(r[0] == "fine" for r in rows) == 2
    assert out.count("No module named 'no_such_module'") == 2      # its progress line and its table row
    assert "not valid JSON" in out and "Traceback" not in out
    assert run.main(["--solution", "half_written", "--device", "cpu", "--no-traces", *project]) == 2


def test_a_folder_name_cannot_forge_table_rows(tmp_project, capsys):
    """A solution folder whose name holds a newline and a table row: refused by name in one line, and no line of
    the output starts a row it wrote."""
    forged = "slow\n| cuda_v1 | cuda | PASSED (36 of 36) |"
    make_solution(tmp_project.solutions, "fine",
                  "from flush import run as flush\n\ndef run(*x):\n    return flush(*x)\n")
    folder = make_solution(tmp_project.solutions, "forger", "from flush import run\n")
    folder.rename(folder.with_name(forged))
    raw = (tmp_project.solutions / forged / "solution.json").read_text().replace('"forger"', json.dumps(forged))
    (tmp_project.solutions / forged / "solution.json").write_text(raw)
    code = run.main(["--device", "cpu", "--batch-sizes", "1", "--families", "random", "--no-traces",
                     "--project", str(tmp_project.root)])
    out = capsys.readouterr().out
    assert code == 1
    assert "not a solution name" in out
    assert not [line for line in out.splitlines() if line.lstrip().startswith("| cuda_v1")]


@pytest.mark.parametrize("dps", [True, False])
def test_wrong_calling_style_says_which_to_set(tmp_project, capsys, dps):
    root = tmp_project.solutions
    code = ("from flush import run as flush\n\ndef run(*x):\n    return flush(*x)\n" if dps else
            "def run(codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, q0, codes_new, s_k_new, s_v_new, u_new, "
            "q_new):\n    pass\n")
    if dps:     # a function returning its outputs, declared destination-passing
        code = code.replace("def run(*x):", "def run(codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, q0):")
        code = code.replace("flush(*x)", "flush(codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, q0)")
    make_solution(root, "style", code, dps=dps)
    assert run.main(["--solution", "style", "--device", "cpu", "--batch-sizes", "1", "--families", "edge",
                     "--no-traces", "--project", str(tmp_project.root)]) == 1
    expected = f'set "destination_passing_style": {"false" if dps else "true"}'
    assert expected in capsys.readouterr().out


# each call notes (pid, start, end) in the solution's home, the one place a worker may write
NOTES_ITS_CALLS = """import os, time
from flush import run as flush

WORKER = os.urandom(8).hex()            # each sandbox has its own pid namespace: every worker is pid 2


def run(*x):
    start = time.time()
    out = flush(*x)
    time.sleep(1.0)
    with open(os.path.expanduser(f"~/calls_{WORKER}"), "a") as f:
        f.write(f"{start} {time.time()}\\n")
    return out
"""


def test_devices_run_workers_concurrently_with_the_verdicts_of_one(tmp_project, tmp_path, monkeypatch, capsys):
    """--devices cpu,cpu deals a solution's workloads to two workers at once: their calls overlap in time, and the
    table is the one a single worker gives."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    make_solution(tmp_project.solutions, "noted", NOTES_ITS_CALLS)
    flags = ["--solution", "noted", "--batch-sizes", "1", "--families", "edge,random,second_window,trajectory",
             "--no-traces", "--run-seed", "5", "--project", str(tmp_project.root)]
    tables = []
    for devices in (["--device", "cpu"], ["--devices", "cpu,cpu"]):
        assert run.main(flags + devices) == 0
        out = capsys.readouterr().out
        tables.append([line.split()[:5] for line in out.splitlines() if line.startswith("noted ")][-4:])
    assert tables[0] == tables[1] and all(row[3] == "PASSED" for row in tables[0]), tables
    logs = sorted((tmp_path / "cache").rglob("calls_*"), key=lambda p: p.stat().st_mtime)[-2:]
    spans = [[tuple(map(float, line.split())) for line in p.read_text().splitlines()] for p in logs]
    assert len(logs) == 2 and all(len(s) == 4 for s in spans), spans        # 2 workloads x 2 calls a worker
    (a0, a1), (b0, b1) = (spans[0][0][0], spans[0][-1][1]), (spans[1][0][0], spans[1][-1][1])
    assert a0 < b1 and b0 < a1                                               # the two workers ran at once


def test_devices_refuses_what_it_cannot_use(capsys):
    for devices, message in (("cuda:0,cuda:0", "distinct"), ("gpu", "give 'all'")):
        assert run.main(["--solution", "torch_v1", "--devices", devices, "--no-traces"]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_a_run_skips_a_solution_whose_dependencies_are_unmet_and_judges_the_rest(tmp_project, capsys):
    make_solution(tmp_project.solutions, "pinned", "from flush import run\n", dependencies=("triton == 0.0.1",))
    make_solution(tmp_project.solutions, "plain", "from flush import run\n")
    code = run.main(["--solution", "pinned", "--solution", "plain", "--device", "cpu", "--batch-sizes", "1",
                     "--families", "random", "--no-traces", "--project", str(tmp_project.root)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "skipping pinned: it needs triton == 0.0.1; this machine has triton" in out
    assert "plain" in out and "1 solution x 1 workload: 1 PASSED" in out, out
