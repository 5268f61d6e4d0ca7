import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # a Triton kernel that a test imports into this process (not through a worker) runs through the interpreter,
    # which has to be chosen before triton is first imported (its own library functions are defined then)
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.project import Project  # noqa: E402 - after the interpreter's choice above

PROJECT = Project.at(ROOT)      # every path the tests read comes from it, whatever the working directory
DEFINITION = "leapquant_kda_flush_r4_int8_h32_v128_k128"


@pytest.fixture(scope="session")
def defn():
    from harness.definition import find_definition
    return find_definition(DEFINITION, PROJECT.definitions)


@pytest.fixture
def tmp_project(tmp_path) -> Project:
    """A project of its own under tmp_path: the repository's definitions and workloads (linked, read-only in
    spirit: a test writes no workload), an empty solutions/ for the test's fixtures and its own traces/."""
    (tmp_path / "definitions").symlink_to(PROJECT.definitions)
    (tmp_path / "workloads").symlink_to(PROJECT.workloads)
    (tmp_path / "solutions").mkdir()
    return Project.at(tmp_path)


def axes_for(defn, batch_size):
    return defn.resolve_axes({"batch_size": batch_size})


def make_solution(root, name, code, dps=False, language="python", copy_flush=True, dependencies=()):
    """A solution folder under root: `main.py` holding `code` (entry `run`), beside a copy of torch_v1's flush.py
    so a fixture can wrap a correct flush. Returns the folder."""
    import json
    import shutil
    folder = Path(root) / name
    folder.mkdir(parents=True)
    (folder / "main.py").write_text(code)
    sources = [{"path": "main.py"}]
    if copy_flush:
        shutil.copy(ROOT / "solutions/torch_v1/flush.py", folder / "flush.py")
        sources.append({"path": "flush.py"})
    (folder / "solution.json").write_text(json.dumps({
        "name": name, "definition": DEFINITION, "author": "tests", "description": "fixture",
        "spec": {"language": language, "target_hardware": ["CPU"], "entry_point": "main.py::run",
                 "destination_passing_style": dps, "dependencies": list(dependencies)},
        "sources": sources}))
    return folder
