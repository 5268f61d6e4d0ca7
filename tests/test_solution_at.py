"""scripts/solution_at.py: a solution as of a git revision, as a folder of its own that the harness loads and runs
like the original (the A/B recipe of the NOTES)."""
import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import DEFINITION
from harness.definition import find_definition
from harness.ops import leapquant_kda_flush as op
from harness.solutions import load_entry, load_solution

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("solution_at", ROOT / "scripts" / "solution_at.py")
solution_at = importlib.util.module_from_spec(spec)
spec.loader.exec_module(solution_at)


def _head():
    if shutil.which("git") is None:
        pytest.skip("needs git")
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        pytest.skip("not a git checkout")
    return done.stdout.strip()


def test_copy_at_head_is_the_committed_solution_renamed_and_runs_the_same(tmp_path):
    head = _head()
    dest = solution_at.solution_at("HEAD", "torch_v1", root=tmp_path)
    assert dest == tmp_path / f"torch_v1_{head}"
    committed = subprocess.run(["git", "ls-tree", "-r", "--name-only", "HEAD", "--", "solutions/torch_v1/"],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == \
        sorted(f[len("solutions/torch_v1/"):] for f in committed)
    spec_json = json.loads((dest / "solution.json").read_text())
    original = json.loads(subprocess.run(["git", "show", "HEAD:solutions/torch_v1/solution.json"], cwd=ROOT,
                                         capture_output=True, text=True, check=True).stdout)
    assert spec_json == {**original, "name": dest.name}

    defn = find_definition(DEFINITION, ROOT / "definitions")
    axes = defn.resolve_axes({"batch_size": 1})
    inputs = op.make_inputs("edge", axes, 3)
    copy = load_entry(load_solution(dest.name, defn, root=tmp_path), defn)
    ours = load_entry(load_solution("torch_v1", defn, root=ROOT / "solutions"), defn)
    for a, b in zip(copy(inputs, axes), ours(inputs, axes)):
        assert torch.equal(a, b)


def test_refuses_an_existing_folder_an_unknown_revision_and_a_missing_solution(tmp_path):
    _head()
    solution_at.solution_at("HEAD", "torch_v1", name="x", root=tmp_path)
    with pytest.raises(ValueError, match="exists already"):
        solution_at.solution_at("HEAD", "torch_v1", name="x", root=tmp_path)
    with pytest.raises(ValueError, match="git rev-parse"):
        solution_at.solution_at("no-such-revision", "torch_v1", root=tmp_path)
    with pytest.raises(ValueError, match="no solutions/no_such_solution/solution.json"):
        solution_at.solution_at("HEAD", "no_such_solution", root=tmp_path)


def test_cli_prints_one_error_line(capsys):
    _head()
    assert solution_at.main(["HEAD", "no_such_solution"]) == 2          # bad input, as every command exits
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("solution_at: ")
