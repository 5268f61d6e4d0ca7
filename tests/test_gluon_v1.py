"""gluon_v1: the Gluon kernel compiles for sm_90a offline within the register and spill figures its NOTES.md records,
the arithmetic it relies on holds in plain torch (tools/check_math.py), and CPU tensors are refused in one line
(Gluon has no CPU interpreter, so nothing else of it runs here).

The kernel is written for the Triton the GPU machine runs (3.6.0); Gluon's API moves between releases, so the compile
runs in a subprocess with a Triton 3.6.0 first on sys.path: the folder named by GLUON_V1_TRITON, else build/triton36
(CI: `python3 -m pip install -q --target build/triton36 triton==3.6.0`). Skipped, saying so, where neither holds
one."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PROJECT, assert_cpu_tensors_refused

FOLDER = Path(__file__).resolve().parents[1] / "solutions" / "gluon_v1"
TOOL = FOLDER / "tools" / "compile_sm90.py"
CHECK_MATH = FOLDER / "tools" / "check_math.py"
TRITON_VERSION = "3.6.0"
# NOTES.md, "Compile report": registers (the cap), spill bytes (stores, loads) per mode; above them a change (or a
# Triton release) has pushed the kernel off its register budget
REGISTERS = 128
SPILL_BYTES = {"run": (16, 16), "pool": (132, 132)}
SASS_TO_EXIT_MAX = 6_000            # a warp's main path (5,480 / 5,833 recorded): a far larger one is a regression


def _triton36() -> Path:
    folder = Path(os.environ.get("GLUON_V1_TRITON", PROJECT.root / "build" / "triton36"))
    version = None
    for meta in folder.glob("triton-*.dist-info"):
        version = meta.name[len("triton-"):-len(".dist-info")]
    if version != TRITON_VERSION:
        pytest.skip(f"no Triton {TRITON_VERSION} in {folder} (found {version}): install it there with "
                    f"`python3 -m pip install --target {folder} triton=={TRITON_VERSION}` or set GLUON_V1_TRITON")
    return folder


@pytest.fixture(scope="module")
def reports():
    folder = _triton36()
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join([str(folder), *filter(None, [os.environ.get("PYTHONPATH")])])}
    res = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    out = {r["mode"]: r for r in map(json.loads, res.stdout.splitlines())}
    assert set(out) == {"run", "pool"}, res.stdout
    return out


@pytest.mark.parametrize("mode", ["run", "pool"])
def test_kernel_compiles_for_sm90a_within_its_register_budget(reports, mode):
    r = reports[mode]
    assert r["triton"] == TRITON_VERSION, r
    assert r["registers"] <= REGISTERS, r                   # 2 CTAs of 8 warps an SM
    stores, loads = SPILL_BYTES[mode]
    assert r["spill_stores"] <= stores and r["spill_loads"] <= loads, r
    assert r["classes"]["HMMA"] > 0, r                      # the rebuild and the residual on tensor cores
    assert 1_000 < r["sass_to_exit"] <= SASS_TO_EXIT_MAX, r


def test_cpu_tensors_are_refused_in_one_line():
    assert_cpu_tensors_refused("gluon_v1")


def test_the_arithmetic_the_kernel_relies_on_holds_in_plain_torch():
    """The bf16 splits, the decay product's order, CGS2 as the kernel computes it (with rsqrt.approx.ftz's reading of
    a subnormal as 0) on random, tiny, huge, zero, rank-deficient, hot-row inputs and a column whose squares are
    subnormal, and the 1.5 * 2^23 rounding: each check prints one line, and a failure fails the tool."""
    res = subprocess.run([sys.executable, str(CHECK_MATH)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "FAIL" not in res.stdout and res.stdout.count("ok ") >= 10, res.stdout
