# SPDX-License-Identifier: Apache-2.0
"""Compile kernel.py's `_flush_kernel` (Gluon) for sm_90a without a GPU, in both modes (`run` and the pool mode),
and print one JSON line per mode: triton's version, registers, stack bytes, spill stores / loads (ptxas's report),
shared memory and the SASS instruction count (static: all, and to the last EXIT, after which only the shuffles'
divergent-warp fallbacks follow), with the counts of a few instruction classes.

    python solutions/gluon_v1/tools/compile_sm90.py

Gluon has no CPU interpreter, so this is the only check of the kernel a CPU-only machine can make. The kernel is
written for the Triton the GPU machine runs (3.6.0): run this with that Triton on sys.path. Needs triton's NVIDIA
backend (it ships ptxas and nvdisasm); no driver, no device."""
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia import compiler as nvidia
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernel  # noqa: E402  (the solution folder, as the harness loads it)

POINTERS = {"p_codes_in": "*i8", "p_sk_in": "*fp32", "p_sv_in": "*fp32", "p_u_in": "*fp16", "p_q_in": "*fp16",
            "p_kbuf_in": "*bf16", "p_ubuf_in": "*bf16", "p_gbuf_in": "*fp16", "p_w_in": "*fp32",
            "p_pcum_in": "*fp32", "p_q0": "*fp32", "p_codes_out": "*i8", "p_sk_out": "*fp32", "p_sv_out": "*fp32",
            "p_u_out": "*fp16", "p_q_out": "*fp16"}
CONFIG = dict(V=128, K=128, L=16, R=4)
MODES = {
    "run": dict(constexprs=dict(p_idx=None, p_count=None, num_slots=None, POOL=False, H=1, REGION=0), pointers={}),
    "pool": dict(constexprs=dict(POOL=True, H=32, REGION=65_536),
                 pointers={"p_idx": "*i32", "p_count": "*i32", "num_slots": "i32"}),
}
CLASSES = ("FFMA", "FADD", "FMUL", "SHFL", "BAR", "HMMA", "LDS", "STS", "LDG", "STG", "F2F", "I2F", "PRMT")


def _ptxas():
    try:
        return nvidia.get_ptxas(90).path
    except TypeError:                       # Triton before 3.9: one ptxas for every architecture
        return nvidia.get_ptxas().path


def _ptxas_report(ptx: str) -> dict:
    """ptxas -v on the kernel's PTX, as triton runs it (the register cap included)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        res = subprocess.run([str(_ptxas()), "-v", "--gpu-name=sm_90a", f"--maxrregcount={kernel.MAXNREG}",
                              str(src), "-o", str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True)
    report = res.stdout + res.stderr
    if res.returncode != 0:
        raise RuntimeError(f"ptxas failed: {' '.join(report.split())[:400]}")
    return {key: int(m.group(1)) if (m := re.search(pattern, report)) else None for key, pattern in (
        ("registers", r"Used (\d+) registers"), ("stack_bytes", r"(\d+) bytes stack frame"),
        ("spill_stores", r"(\d+) bytes spill stores"), ("spill_loads", r"(\d+) bytes spill loads"))}


def _sass(cubin: bytes) -> list[str]:
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
    return [line for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line)]


def compile_mode(mode: str, keep: Path | None = None) -> dict:
    fn = kernel._flush_kernel
    spec = MODES[mode]
    constexprs = {**CONFIG, **spec["constexprs"]}
    signature = {**POINTERS, **spec["pointers"], **{name: "constexpr" for name in constexprs}}
    # every pointer 16-byte aligned, as the JIT specialises torch's allocations (without it no access is vectorised)
    aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items() if t.startswith("*")}
    src = GluonASTSource(fn, signature, constexprs={(fn.arg_names.index(n),): v for n, v in constexprs.items()},
                         attrs=aligned)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=kernel.NUM_WARPS, maxnreg=kernel.MAXNREG))
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        for ext in ("ttgir", "llir", "ptx"):
            (keep / f"{mode}.{ext}").write_text(compiled.asm[ext])
        (keep / f"{mode}.cubin").write_bytes(compiled.asm["cubin"])
    sass = _sass(compiled.asm["cubin"])
    ops = Counter(m.group(1).split(".")[0] for line in sass
                  if (m := re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)))
    # the divergent-warp fallbacks of the shuffles (BRA.DIV targets) sit out of line after the last EXIT, not taken
    exit_at = max(i for i, line in enumerate(sass) if re.search(r"\bEXIT\b", line))
    return {"mode": mode, "triton": triton.__version__, **_ptxas_report(compiled.asm["ptx"]),
            "shared_bytes": compiled.metadata.shared, "sass_instructions": len(sass),
            "sass_to_exit": exit_at + 1,
            "classes": {c: ops.get(c, 0) for c in CLASSES}}


def main() -> int:
    keep = Path(sys.argv[sys.argv.index("--keep") + 1]) if "--keep" in sys.argv else None
    for mode in MODES:
        print(json.dumps(compile_mode(mode, keep)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
