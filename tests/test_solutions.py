"""Solution folders: loading, the built-in reference, value-returning and destination-passing entry points."""
import dataclasses
import json

import pytest
import torch

from conftest import PROJECT, make_solution
from harness import sandbox
from harness.ops import leapquant_kda_flush as op
from harness.solutions import (REFERENCE, SolutionError, discover, is_reference, load_entry, load_solution,
                               source_sha256, unmet_needs)


def test_discover_lists_reference_first(defn):
    names = discover(defn, PROJECT.solutions)
    assert names[0] == REFERENCE and "torch_v1" in names


def test_only_the_definitions_own_reference_is_the_yardstick(defn):
    """The judge spares the reference's own breakdowns (criterion `yardstick`) for the definition's code alone, not
    for a solution folder that calls itself reference."""
    assert is_reference(load_solution(REFERENCE, defn, PROJECT.solutions))
    folder = load_solution("torch_v1", defn, PROJECT.solutions)
    assert not is_reference(folder) and not is_reference(dataclasses.replace(folder, name=REFERENCE))


def test_value_returning_and_destination_passing_agree(defn, tmp_path):
    make_solution(tmp_path, "dps", "from flush import run as flush\n\n"
                  "def run(*args):\n    inputs, outputs = args[:11], args[11:]\n"
                  "    for o, r in zip(outputs, flush(*inputs)):\n        o.copy_(r)\n", dps=True)
    axes = defn.resolve_axes({"batch_size": 1})
    x = op.make_inputs("edge", axes, 3)
    by_value = load_entry(load_solution("torch_v1", defn, PROJECT.solutions), defn)(x, axes)
    by_dest = load_entry(load_solution("dps", defn, tmp_path), defn)(x, axes)
    assert all(torch.equal(a, b) for a, b in zip(by_value, by_dest))
    ref = load_entry(load_solution(REFERENCE, defn, PROJECT.solutions), defn)(x, axes)
    assert [t.shape for t in ref] == [t.shape for t in by_value]


def _broken(tmp_path, mutate):
    folder = make_solution(tmp_path, "broken", "def run(*a):\n    pass\n")
    raw = json.loads((folder / "solution.json").read_text())
    mutate(raw, folder)
    (folder / "solution.json").write_text(json.dumps(raw))
    return folder


MALFORMED = {
    "entry point form": (lambda r, f: r["spec"].update(entry_point="main.run"), "'spec.entry_point'"),
    "entry not a source": (lambda r, f: r["spec"].update(entry_point="other.py::run"), "'spec.entry_point'"),
    "language": (lambda r, f: r["spec"].update(language="rust"), "'spec.language'"),
    "missing source": (lambda r, f: r["sources"].append({"path": "gone.py"}), "'sources[2].path'"),
    "escaping source": (lambda r, f: r["sources"].append({"path": "../x.py"}), "'sources[2].path'"),
    "no author": (lambda r, f: r.pop("author"), "'author'"),
    "name mismatch": (lambda r, f: r.update(name="other"), "'name'"),
    "other definition": (lambda r, f: r.update(definition="gemm"), "'definition'"),
    "dps not bool": (lambda r, f: r["spec"].update(destination_passing_style="yes"),
                     "'spec.destination_passing_style'"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_solution_json(defn, tmp_path, case):
    mutate, field = MALFORMED[case]
    folder = _broken(tmp_path, mutate)
    with pytest.raises(SolutionError) as err:
        load_solution("broken", defn, tmp_path)
    assert str(folder / "solution.json") in str(err.value) and field in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_and_invalid_json(defn, tmp_path):
    with pytest.raises(SolutionError, match="no such solution"):
        load_solution("nothing", defn, tmp_path)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "solution.json").write_text("{")
    with pytest.raises(SolutionError, match="not valid JSON"):
        load_solution("bad", defn, tmp_path)


def test_source_hash_follows_the_sources(defn, tmp_path):
    folder = make_solution(tmp_path, "h", "def run(*x):\n    pass\n")
    sol = load_solution("h", defn, tmp_path)
    before = source_sha256(sol, defn)
    assert source_sha256(sol, defn) == before
    (folder / "flush.py").write_text((folder / "flush.py").read_text() + "\n# changed\n")
    assert source_sha256(sol, defn) != before
    assert source_sha256(load_solution(REFERENCE, defn, PROJECT.solutions), defn) != before


def test_source_hash_covers_solution_json(defn, tmp_path):
    """The entry point and calling style decide what runs, so they are hashed with the sources."""
    folder = make_solution(tmp_path, "h", "def run(*x):\n    pass\n")
    before = source_sha256(load_solution("h", defn, tmp_path), defn)
    raw = json.loads((folder / "solution.json").read_text())
    raw["spec"]["destination_passing_style"] = True
    (folder / "solution.json").write_text(json.dumps(raw))
    assert source_sha256(load_solution("h", defn, tmp_path), defn) != before


@pytest.mark.parametrize("link", ["source", "folder of a source", "solution.json", "solution folder"])
def test_a_symbolic_link_in_a_solution_is_refused(defn, tmp_path, link):
    """Staged, a link would bring whatever it points at (any file of the host, /proc/self/environ) into the
    sandbox: every path of a solution is a regular file in its folder."""
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET")
    folder = make_solution(tmp_path / "solutions", "linked", "def run(*x):\n    pass\n")
    raw = json.loads((folder / "solution.json").read_text())
    if link == "source":
        (folder / "notes.py").symlink_to(secret)
        raw["sources"].append({"path": "notes.py"})
    elif link == "folder of a source":
        (folder / "data").symlink_to(tmp_path, target_is_directory=True)
        raw["sources"].append({"path": "data/secret.txt"})
    (folder / "solution.json").write_text(json.dumps(raw))
    root = tmp_path / "solutions"
    if link == "solution.json":
        (tmp_path / "real.json").write_text(json.dumps(raw))
        (folder / "solution.json").unlink()
        (folder / "solution.json").symlink_to(tmp_path / "real.json")
    elif link == "solution folder":
        root = tmp_path / "elsewhere"
        root.mkdir()
        (root / "linked").symlink_to(folder, target_is_directory=True)
    with pytest.raises(SolutionError, match="symbolic link") as e:
        load_solution("linked", defn, root)
    assert "\n" not in str(e.value) and "TOP-SECRET" not in str(e.value)


def test_a_source_larger_than_the_limit_is_refused(defn, tmp_path):
    folder = make_solution(tmp_path, "large", "def run(*x):\n    pass\n")
    with open(folder / "table.bin", "wb") as f:
        f.truncate(sandbox.SOURCE_BYTES + 1)
    raw = json.loads((folder / "solution.json").read_text())
    raw["sources"].append({"path": "table.bin"})
    (folder / "solution.json").write_text(json.dumps(raw))
    with pytest.raises(SolutionError, match="larger than 64 MiB"):
        load_solution("large", defn, tmp_path)


@pytest.mark.parametrize("dependencies, language, device, says", [
    ((), "python", "cpu", None),
    (("torch >= 2.0", "packaging"), "python", "cpu", None),
    (("sh",), "python", "cpu", None),                                  # a program on PATH, not a package
    (("torch >= 2.0; python_version < '3'",), "python", "cpu", None),  # a marker this Python does not meet
    (("triton == 0.0.1",), "triton", "cpu", "it needs triton == 0.0.1; this machine has triton"),
    (("no-such-package-here",), "python", "cuda", "it needs no-such-package-here, not installed here"),
    ((), "cuda", "cpu", "a CUDA solution needs a GPU"),
    ((), "cuda", "cuda", None),
])
def test_unmet_needs_names_what_is_missing(defn, tmp_path, dependencies, language, device, says):
    make_solution(tmp_path, "needy", "def run(*x):\n    return x\n", language=language, dependencies=dependencies)
    why = unmet_needs(load_solution("needy", defn, tmp_path), device)
    assert why == says if says is None else why.startswith(says), why

