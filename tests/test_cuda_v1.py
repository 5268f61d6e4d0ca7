"""cuda_v1: the kernel file compiles for sm_90a with the machine's nvcc, with no error and no register spill.

The kernel file (flush.cu) is pure CUDA (no torch headers), so this takes seconds on a CPU-only machine; the torch
binding (binding.cpp) is built only by main.py on a GPU. Skipped only when nvcc is absent."""
import re
from pathlib import Path

from conftest import assert_cpu_tensors_refused, ptxas_report

FOLDER = Path(__file__).resolve().parents[1] / "solutions" / "cuda_v1"
KERNELS = 2         # the dense kernel and the deployment form's


def test_kernel_compiles_for_sm90a_without_spills(tmp_path):
    report = ptxas_report(FOLDER, FOLDER / "flush.cu", tmp_path / "flush.o", KERNELS)
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", report)]
    assert regs and max(regs) <= 128, report             # 2 CTAs of 256 threads per SM


def test_timeline_tool_builds_with_the_kernel(tmp_path):
    """tools/timeline.cu includes flush.cu with its STAMP hook defined: it must keep compiling, and the stamps must
    not push the kernel into spills (the cycles it reports would then not be the kernel's)."""
    ptxas_report(FOLDER, FOLDER / "tools" / "timeline.cu", tmp_path / "timeline.o", KERNELS)


def test_run_refuses_cpu_tensors_in_one_line():
    assert_cpu_tensors_refused("cuda_v1")
