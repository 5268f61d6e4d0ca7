"""competition.yaml (harness/competition.py): the committed file loads; a missing one means the defaults; a malformed
one is one line naming the key, from every command that reads it; its run selection and settings reach the run, and
flags override them; its ranking orders the leaderboard."""
import pytest

from conftest import PROJECT, make_solution
from harness import report, run
from harness.competition import Competition, CompetitionError, load_competition
from harness.ops import leapquant_kda_flush as op
from harness.project import Settings
from harness.records import StressRecord, Trace

FINE = "from flush import run as flush\n\ndef run(*x):\n    return flush(*x)\n"


def test_the_committed_file_loads_and_no_file_means_the_defaults(tmp_project):
    committed = load_competition(PROJECT)
    assert committed.ranking.batch_sizes == [64, 256, 512] and committed.settings == Settings()
    assert load_competition(tmp_project) == Competition()


@pytest.mark.parametrize("text, message", [
    ("settings:\n  timeout: 3\n", "field 'settings.timeout': unknown field (a typo?)"),
    ("settings:\n  timeout_s: 0\n", "field 'settings': setting timeout_s: 0.0 is not a positive number"),
    ("run:\n  batch_sizes: []\n", "field 'run.batch_sizes': an empty list"),
    ("ranking:\n  gates: [speed]\n", "field 'ranking.gates[0]'"),
    ("run: [1\n", "not valid YAML (line 2"),
])
def test_a_malformed_file_is_one_line_naming_the_key(tmp_project, capsys, text, message):
    tmp_project.competition_file.write_text(text)
    with pytest.raises(CompetitionError, match="competition.yaml: "):
        load_competition(tmp_project)
    assert run.main(["--solution", "reference", "--device", "cpu", "--no-traces",
                     "--project", str(tmp_project.root)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert report.main(["--project", str(tmp_project.root), "--check"]) == 2


def test_its_run_selection_and_settings_reach_the_run_and_flags_override_them(tmp_project, capsys):
    tmp_project.competition_file.write_text("run:\n  batch_sizes: [2]\n  families: [edge]\n"
                                            "settings:\n  timeout_s: 6\n")
    make_solution(tmp_project.solutions, "hangs", "import time\n\ndef run(*x):\n    time.sleep(60)\n")
    make_solution(tmp_project.solutions, "fine", FINE)
    project = ["--project", str(tmp_project.root), "--device", "cpu", "--no-traces"]
    assert run.main(["--solution", "fine", *project]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("fine ")]
    assert [(r[1], r[2]) for r in rows] == [("2", "edge")]
    assert run.main(["--solution", "fine", "--batch-sizes", "1", "--families", "random", *project]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("fine ")]
    assert [(r[1], r[2]) for r in rows] == [("1", "random")]
    assert run.main(["--solution", "hangs", *project]) == 1
    assert "no answer within 6 s" in capsys.readouterr().out


def _trace(solution, uuid, status="PASSED", speedup=4.0, sha="abc"):
    ev = {"status": status, "environment": {"hardware": "GPU", "libs": {}}, "timestamp": "2026-12-06T00:00:00+00:00",
          "log": ""}
    if status == "PASSED":
        ev["correctness"] = {"max_relative_error": 0.0, "max_absolute_error": 0.0, "extra": {"family": "random"}}
        ev["performance"] = {"latency_ms": 1.0, "reference_latency_ms": speedup, "speedup_factor": speedup,
                             "floor_ms": 0.5}
    return Trace.model_validate({"definition": "d", "solution": solution, "solution_sha256": sha, "evaluation": ev,
                                 "workload": {"uuid": uuid, "axes": {"batch_size": 64}, "inputs": {}}})


def _stress(solution, failures=(), examples=300, hardware="GPU", batch_size=512):
    return StressRecord.model_validate({
        "definition": "d", "solution": solution, "solution_sha256": "abc", "sandbox": "bwrap",
        "environment": {"hardware": hardware, "libs": {}}, "examples": examples, "calls": 300, "batch_size": batch_size,
        "seed": None,
        "hypothesis": "6", "seconds": 1.0, "timestamp": "2026-12-06T00:00:00+00:00", "failures": list(failures)})


def test_the_ranking_ranks_only_solutions_through_every_gate():
    ranking = Competition().ranking
    chosen = {"d": {"w1": None, "w2": None}}
    traces = [_trace(s, w, speedup=sp) for s, sp in (("fast", 9.0), ("slow", 4.0), ("broken", 20.0),
                                                       ("unsearched", 30.0), ("stale", 40.0), ("few", 50.0),
                                                       ("on_cpu", 60.0), ("small", 70.0)) for w in ("w1", "w2")]
    traces = [t for t in traces if not (t.solution == "broken" and t.workload.uuid == "w2")]
    traces += [_trace("broken", "w2", status="INCORRECT_NUMERICAL")]
    current = {("d", s): "abc" for s in ("fast", "slow", "broken", "unsearched", "few", "on_cpu", "small")} \
        | {("d", "stale"): "new"}
    stress = [_stress(s) for s in ("fast", "slow", "broken", "stale")]
    stress += [_stress("few", examples=ranking.stress_examples - 1), _stress("on_cpu", hardware="CPU"),
               _stress("small", batch_size=ranking.stress_batch_size // 2)]
    text, _ = report.build(traces, op, current, stress=stress, ranking=ranking, ranked=chosen)
    section = text.split("## Ranking")[1].split("\n## ")[0]
    rows = {cells[1]: cells for cells in ([c.strip() for c in r.strip("|").split("|")]
                                          for r in section.splitlines() if r.startswith("| "))
            if cells[0] != "rank"}
    assert rows["fast"][:3] == ["1", "fast", "9.00"] and rows["slow"][:3] == ["2", "slow", "4.00"]
    assert rows["broken"][4] == "1 workload(s) not PASSED" and rows["stale"][4] == "sources older: re-run"
    # none, too short a search, one anyone can make on a CPU, or one at batch sizes the ranking does not reach
    for vacuous in ("unsearched", "few", "on_cpu", "small"):
        assert rows[vacuous][4] == ("no clean stress record of its current sources (on a GPU, >= 300 examples, "
                                    "batch sizes up to 512)")
    assert all(rows[s][0] == "-" for s in ("broken", "stale", "unsearched", "few", "on_cpu", "small"))
