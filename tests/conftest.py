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


def ptxas_report(folder: Path, source: Path, obj: Path, kernels: int) -> str:
    """Compiles a CUDA solution's `source` (pure CUDA, its folder on the include path) for sm_90a with the machine's
    nvcc and ptxas's report; asserts no error, and for each of the `kernels` it reports no spill and no stack frame.
    Returns the report (registers are the caller's to bound). Skipped only where nvcc is absent."""
    import re
    import shutil
    import subprocess
    nvcc = shutil.which("nvcc") or shutil.which("nvcc", path="/usr/local/cuda/bin")
    if nvcc is None:
        pytest.skip("nvcc not found on PATH: the compile check needs the CUDA toolkit")
    cmd = [nvcc, "-c", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-Xptxas", "-v,-warn-spills",
           "-I", str(folder), str(source), "-o", str(obj)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    report = res.stdout + res.stderr
    assert res.returncode == 0, report
    assert "error" not in report.lower(), report
    spills = [(int(a), int(b)) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)]
    assert len(spills) == kernels, f"expected {kernels} kernels in:\n{report}"
    assert all(a == 0 and b == 0 for a, b in spills), report
    assert "Registers are spilled" not in report, report
    stack = [int(x) for x in re.findall(r"(\d+) bytes stack frame", report)]
    assert len(stack) == kernels and all(x == 0 for x in stack), report
    return report


def assert_cpu_tensors_refused(name: str) -> None:
    """A GPU-only solution called with CPU tensors raises one RuntimeError line naming CUDA (importing it builds
    nothing), and leaves the inputs on the CPU."""
    from harness.definition import find_definition
    from harness.ops import leapquant_kda_flush as op
    from harness.solutions import load_entry, load_solution
    defn = find_definition(DEFINITION, PROJECT.definitions)
    call = load_entry(load_solution(name, defn, PROJECT.solutions), defn)
    axes = defn.resolve_axes({"batch_size": 1})
    x = op.make_inputs("random", axes, 1)
    with pytest.raises(RuntimeError) as err:
        call(x, axes)
    message = str(err.value)
    assert "\n" not in message.strip() and "CUDA" in message, message
    assert not any(t.is_cuda for t in x.values())
