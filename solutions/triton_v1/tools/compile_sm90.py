# SPDX-License-Identifier: Apache-2.0
"""Compile kernel.py's `_flush_kernel` for sm_90a without a GPU, in both modes (`run` and the pool mode), with the
GPU path's fixed config (tensor-core dots, prefetch, register cap), and print one JSON line per mode: registers,
stack bytes, spill stores / loads (ptxas's report) and the SASS instruction count.

    TRITON_INTERPRET=0 python solutions/triton_v1/tools/compile_sm90.py

The interpreter never compiles the GPU path, so a construct it accepts but the compiler refuses (a module global
that is not a `tl.constexpr`, a dtype the GPU path lacks) shows up here, not in an interpreted run. Needs triton's
NVIDIA backend (it ships ptxas and nvdisasm); no driver, no device."""
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia import compiler as nvidia
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernel  # noqa: E402  (the solution folder, as the harness loads it)

POINTERS = {"p_codes_in": "*i8", "p_sk_in": "*fp32", "p_sv_in": "*fp32", "p_u_in": "*fp16", "p_q_in": "*fp16",
            "p_kbuf_in": "*bf16", "p_ubuf_in": "*bf16", "p_gbuf_in": "*fp16", "p_w_in": "*fp32",
            "p_pcum_in": "*fp32", "p_q0": "*fp32", "p_codes_out": "*i8", "p_sk_out": "*fp32", "p_sv_out": "*fp32",
            "p_u_out": "*fp16", "p_q_out": "*fp16"}
CONFIG = dict(V=128, K=128, L=16, R=4, VC=kernel.VC, PC=kernel.PC, TC=True, PF=kernel.PF)
MODES = {
    "run": dict(constexprs=dict(p_idx=None, p_count=None, p_scratch=None, num_slots=None, POOL=False, H=1,
                                REGION=0), pointers={}),
    "pool": dict(constexprs=dict(POOL=True, H=32, REGION=65_536),
                 pointers={"p_idx": "*i32", "p_count": "*i32", "p_scratch": "*i8", "num_slots": "i32"}),
}


def _ptxas() -> str:
    """The ptxas triton itself runs for sm_90: from Triton 3.9 it ships two and picks the newer one there, whose
    PTX version the older cannot read."""
    try:
        return nvidia.get_ptxas(90).path
    except TypeError:                       # Triton before 3.9: one ptxas for every architecture
        return nvidia.get_ptxas().path


def _ptxas_report(ptx: str, arch: str) -> dict:
    """ptxas -v on the kernel's PTX, as triton runs it (the register cap included)."""
    ptxas = _ptxas()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        res = subprocess.run([str(ptxas), "-v", f"--gpu-name={arch}", f"--maxrregcount={kernel.MAXNREG}",
                              str(src), "-o", str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True)
    report = res.stdout + res.stderr
    if res.returncode != 0:
        raise RuntimeError(f"ptxas failed: {' '.join(report.split())[:400]}")
    number = {key: int(m.group(1)) if (m := re.search(pattern, report)) else None for key, pattern in (
        ("registers", r"Used (\d+) registers"), ("stack_bytes", r"(\d+) bytes stack frame"),
        ("spill_stores", r"(\d+) bytes spill stores"), ("spill_loads", r"(\d+) bytes spill loads"))}
    return number


def _sass_instructions(cubin: bytes) -> int:
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
    return sum(1 for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line))


def compile_mode(mode: str) -> dict:
    fn = kernel._flush_kernel
    spec = MODES[mode]
    constexprs = {**CONFIG, **spec["constexprs"]}
    signature = {**POINTERS, **spec["pointers"], **{name: "constexpr" for name in constexprs}}
    # every pointer 16-byte aligned, as the JIT specialises torch's allocations (without it no load is vectorised)
    aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items() if t.startswith("*")}
    src = ASTSource(fn, signature, constexprs={(fn.arg_names.index(n),): v for n, v in constexprs.items()},
                    attrs=aligned)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(
        num_warps=kernel.NUM_WARPS, num_stages=kernel.NUM_STAGES, maxnreg=kernel.MAXNREG))
    return {"mode": mode, "triton": triton.__version__, **_ptxas_report(compiled.asm["ptx"], "sm_90a"),
            "sass_instructions": _sass_instructions(compiled.asm["cubin"])}


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("compile_sm90.py: unset TRITON_INTERPRET (under the interpreter nothing is compiled)", file=sys.stderr)
        return 2
    for mode in MODES:
        print(json.dumps(compile_mode(mode)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
