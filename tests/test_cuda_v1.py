"""cuda_v1: the kernel file compiles for sm_90a with the machine's nvcc, with no error and no register spill.

The kernel file (flush.cu) is pure CUDA (no torch headers), so this takes seconds on a CPU-only machine; the torch
binding (binding.cpp) is built only by main.py on a GPU. Skipped only when nvcc is absent."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

FOLDER = Path(__file__).resolve().parents[1] / "solutions" / "cuda_v1"


def _nvcc():
    return shutil.which("nvcc") or (shutil.which("nvcc", path="/usr/local/cuda/bin"))


def _ptxas_report_without_spills(source: Path, obj: Path) -> str:
    """Compiles `source` for sm_90a with ptxas's report and asserts no error and no spill; returns the report."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found on PATH: the compile check needs the CUDA toolkit")
    cmd = [nvcc, "-c", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-Xptxas", "-v,-warn-spills",
           "-I", str(FOLDER), str(source), "-o", str(obj)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    report = res.stdout + res.stderr
    assert res.returncode == 0, report
    assert "error" not in report.lower(), report
    spills = [(int(a), int(b)) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)]
    assert spills, f"no ptxas spill report in:\n{report}"
    assert all(a == 0 and b == 0 for a, b in spills), report
    assert "Registers are spilled" not in report, report
    return report


def test_kernel_compiles_for_sm90a_without_spills(tmp_path):
    report = _ptxas_report_without_spills(FOLDER / "flush.cu", tmp_path / "flush.o")
    stack = [int(x) for x in re.findall(r"(\d+) bytes stack frame", report)]
    assert all(s == 0 for s in stack), report
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", report)]
    assert regs and max(regs) <= 128, report             # 2 CTAs of 256 threads per SM


def test_timeline_tool_builds_with_the_kernel(tmp_path):
    """tools/timeline.cu includes flush.cu with its STAMP hook defined: it must keep compiling, and the stamps must
    not push the kernel into spills (the cycles it reports would then not be the kernel's)."""
    _ptxas_report_without_spills(FOLDER / "tools" / "timeline.cu", tmp_path / "timeline.o")


def test_run_refuses_cpu_tensors_in_one_line():
    from harness.definition import find_definition
    from harness.solutions import load_entry, load_solution
    from conftest import DEFINITION, PROJECT
    from harness.ops import leapquant_kda_flush as op
    defn = find_definition(DEFINITION, PROJECT.definitions)
    call = load_entry(load_solution("cuda_v1", defn, PROJECT.solutions), defn)      # importing main.py builds nothing
    x = op.make_inputs("random", defn.resolve_axes({"batch_size": 1}), 1)
    with pytest.raises(RuntimeError) as err:
        call(x, defn.resolve_axes({"batch_size": 1}))
    assert "\n" not in str(err.value) and "CUDA" in str(err.value)
