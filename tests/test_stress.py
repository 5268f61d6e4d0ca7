"""harness.stress: the search finds planted kernels' failures on CPU, shrinks them to one degenerate program and
writes reproducers that harness.run replays; a correct solution searches clean."""
import contextlib
import hashlib
import json

import pytest

from conftest import DEFINITION, PROJECT, make_solution
from harness import run, stress
from harness.workloads import load_inputs, load_workloads

UNCLAMPED = "v.norm(dim=-1, keepdim=True).clamp_min(1e-30)"


def _planted_reference(defn, old: str, new: str) -> str:
    assert old in defn.reference
    return defn.reference.replace(old, new)


def _search(tmp_path, name, *extra):
    return stress.main(["--solution", name, "--solutions", str(tmp_path / "solutions"), "--device", "cpu",
                        "--out", str(tmp_path / "failures"), "--no-database", *extra])


def _reproducers(tmp_path, name):
    return sorted((tmp_path / "failures" / name).glob("*.jsonl"))


def test_unclamped_norm_found_shrunk_and_replayed(defn, tmp_path, tmp_project, capsys):
    """The reference with its Gram-Schmidt dividing by an unclamped norm: NaN on any head whose projection is
    exactly zero. The default example count finds it; the failure names one program off plain."""
    make_solution(tmp_path / "solutions", "unclamped", _planted_reference(defn, UNCLAMPED, "v.norm(dim=-1, "
                                                                                            "keepdim=True)"),
                  copy_flush=False)
    assert _search(tmp_path, "unclamped", "--seed", "7", "--project", str(tmp_project.root), "--record") == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAILED")]
    assert len(lines) == 1 and "non-finite values in" in lines[0]
    described = lines[0].split(" | ")[1]
    assert described.count("program ") == 1, described          # one degenerate program, every other plain
    [path] = _reproducers(tmp_path, "unclamped")
    assert f"--workloads {path}" in lines[0]
    line = json.loads(path.read_text())
    assert line["workload"]["family"] == "stress" and sum(bool(p) for p in line["workload"]["params"]["programs"]) == 1
    assert line["workload"]["inputs"]["codes"]["path"].startswith("failures/unclamped/")   # within the project
    failures = json.loads((tmp_project.traces / DEFINITION / "stress_unclamped.json").read_text())["failures"]
    found, *committed = failures                      # the drawn example first, then committed workloads it fails
    assert found["reproducer"] == path.relative_to(tmp_project.root).as_posix()          # committed records move
    assert found["axes"] == {"batch_size": line["workload"]["axes"]["batch_size"]}
    assert {f["reproducer"] for f in committed} <= {"workloads/leapquant_kda_flush/" + DEFINITION + ".jsonl"}
    # replayed by harness.run: the planted kernel fails it, the reference's own code passes it
    make_solution(tmp_project.solutions, "exact", defn.reference, copy_flush=False)
    for name, code in (("unclamped", 1), ("exact", 0)):
        assert run.main(["--solution", name, "--workloads", str(path), "--device", "cpu",
                         "--project", str(tmp_project.root)]) == code


def test_crash_on_a_kind_of_head_is_a_failure_of_its_own(defn, tmp_path, capsys):
    """A solution that raises on an empty checkpoint (scales at the clamp): RUNTIME_ERROR, shrunk to the choice
    that makes one."""
    code = ("from flush import run as flush\n\n"
            "def run(codes, s_k, *rest):\n"
            "    if (s_k.amax(-1) < 1e-6).any():\n"
            "        raise ValueError('empty checkpoint')\n"
            "    return flush(codes, s_k, *rest)\n")
    make_solution(tmp_path / "solutions", "crashes", code)
    assert _search(tmp_path, "crashes", "--seed", "3", "--examples", "30") == 1
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("FAILED")]
    assert line.startswith("FAILED RUNTIME_ERROR: ValueError: empty checkpoint") and "checkpoint=zero" in line


def test_correct_solution_searches_clean_and_records(defn, tmp_path, capsys):
    make_solution(tmp_path / "solutions", "exact", defn.reference, copy_flush=False)
    assert _search(tmp_path, "exact", "--seed", "5", "--examples", "15", "--record",
                   "--traces", str(tmp_path / "traces")) == 0
    assert "0 distinct failure(s)" in capsys.readouterr().out
    record = json.loads((tmp_path / "traces" / DEFINITION / "stress_exact.json").read_text())
    assert record["failures"] == [] and record["examples"] == 15 and record["calls"] >= 15
    assert not _reproducers(tmp_path, "exact")


def test_a_kernel_careful_at_one_batch_size_alone_is_searched_at_the_others(defn, tmp_path, capsys):
    """A crash on an empty checkpoint at batch sizes above 1 only: a search at B = 1 alone misses it; drawing the
    batch size up to --batch-size finds it, shrunk to the smallest batch size that fails."""
    code = ("from flush import run as flush\n\n"
            "def run(codes, s_k, *rest):\n"
            "    if codes.shape[0] > 1 and (s_k.amax(-1) < 1e-6).any():\n"
            "        raise ValueError('empty checkpoint')\n"
            "    return flush(codes, s_k, *rest)\n")
    make_solution(tmp_path / "solutions", "dodger", code)
    assert _search(tmp_path, "dodger", "--seed", "3", "--examples", "30") == 0
    assert _search(tmp_path, "dodger", "--seed", "3", "--examples", "30", "--batch-size", "4") == 1
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("FAILED")]
    assert "ValueError: empty checkpoint" in line and "| batch_size 2 |" in line, line


def test_a_failure_that_needs_degenerate_programs_past_the_first_sequence_is_found(defn, tmp_path, capsys):
    """A crash on an empty checkpoint past the first sequence: an example's named programs are one sequence's and
    the rest plain, so the named examples never reach it; the drawn ones that follow a clean search (every program
    drawn from the seed, as the family's are) do, and the failure says so and replays."""
    code = ("from flush import run as flush\n\n"
            "def run(codes, s_k, *rest):\n"
            "    if (s_k[1:].amax(-1) < 1e-6).any():\n"
            "        raise ValueError('empty checkpoint past the first sequence')\n"
            "    return flush(codes, s_k, *rest)\n")
    make_solution(tmp_path / "solutions", "later_sequences", code)
    assert _search(tmp_path, "later_sequences", "--seed", "5", "--examples", "40", "--batch-size", "2") == 1
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("FAILED")]
    assert "empty checkpoint past the first sequence" in line and "every program drawn from the seed" in line, line
    [path] = _reproducers(tmp_path, "later_sequences")
    assert "programs" not in json.loads(path.read_text())["workload"]["params"]


SEARCH_SPOTTER = """
import torch

from flush import run as flush
from harness.ops.leapquant_kda_flush import make_inputs

searched = None


def run(codes, s_k, s_v, u, q, *rest):
    # Hypothesis tries the plainest example with seed 0 first: a search's first call would be exactly this one
    global searched
    if searched is None:
        B, H, V, K = codes.shape
        axes = {"batch_size": B, "num_heads": H, "value_dim": V, "key_dim": K, "window": rest[0].shape[2],
                "rank": u.shape[2]}
        plain = make_inputs("stress", axes, 0, params={"programs": [{}], "call": {}})
        searched = torch.equal(plain["codes"], codes) and torch.equal(plain["s_k"], s_k)
    out = flush(codes, s_k, s_v, u, q, *rest)
    if searched:
        return out
    return (out[0], out[1] * 1.5) + tuple(out[2:])      # wrong whenever it does not know it is searched
"""


def test_a_solution_cannot_tell_the_search_from_its_first_call(defn, tmp_path, capsys):
    """The search's salt makes its first call's inputs unknown in advance: a solution that is careful only once it
    has recognised that call is searched like any other and fails."""
    make_solution(tmp_path / "solutions", "spotter", SEARCH_SPOTTER)
    assert _search(tmp_path, "spotter", "--examples", "3") == 1
    assert "FAILED INCORRECT_NUMERICAL" in capsys.readouterr().out


RUN_SPOTTER = """
import hashlib

from flush import run as flush

COMMITTED = {committed}
shown = [False]


def run(codes, s_k, *rest):
    # a run judges a committed workload first; the search never showed one
    shown[0] = shown[0] or hashlib.sha256(codes.contiguous().numpy().tobytes()).hexdigest() in COMMITTED
    out = flush(codes, s_k, *rest)
    if shown[0] and hashlib.sha256(codes.contiguous().numpy().tobytes()).hexdigest() not in COMMITTED:
        return (out[0], out[1] * 1.5) + tuple(out[2:])      # wrong on everything else, once a run is recognised
    return out
"""


def test_a_solution_cannot_tell_the_search_from_a_run_by_committed_inputs(defn, tmp_path, capsys):
    """The committed workloads are public, and a run judges one first: a solution that is careless only once it has
    been shown one is shown one by the search too (before its first example and at random between others)."""
    committed = {hashlib.sha256(load_inputs(defn, w, root=PROJECT.root)["codes"].numpy().tobytes()).hexdigest()
                 for w in load_workloads(defn, PROJECT.workload_file(defn))
                 if w.axes["batch_size"] <= stress.COMMITTED_BATCH}
    make_solution(tmp_path / "solutions", "run_spotter", RUN_SPOTTER.format(committed=sorted(committed)))
    assert _search(tmp_path, "run_spotter", "--examples", "3") == 1
    assert "FAILED INCORRECT_NUMERICAL" in capsys.readouterr().out


@pytest.mark.parametrize("case", ["unknown solution", "import error", "bad count"])
def test_bad_input_is_one_line(defn, tmp_path, capsys, case):
    if case == "import error":
        make_solution(tmp_path / "solutions", "broken", "import no_such_module\n", copy_flush=False)
    args = {"unknown solution": ["--solution", "nope"], "import error": ["--solution", "broken"],
            "bad count": ["--solution", "broken", "--examples", "0"]}[case]
    with pytest.raises(SystemExit) if case == "bad count" else contextlib.nullcontext():
        code = stress.main([*args, "--solutions", str(tmp_path / "solutions"), "--device", "cpu", "--no-database"])
        assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 or case == "bad count", err
    if case == "import error":
        assert "COMPILE_ERROR" in err[0] and "no_such_module" in err[0]
