"""Static SASS instructions of a kernel per stretch between CTA barriers (no GPU), for the per-stage instruction
estimate in NOTES.md. A stretch is counted from one BAR.SYNC to the next, to the kernel's last EXIT (what follows it
is out-of-line slow paths); `@P BRA` branches inside a stretch are listed so that code run by some warps only
(warp 0's Gram-Schmidt, the contractions on warps 0-1, the scale stages on threads < 128) can be weighed by hand.

    nvcc -cubin -gencode=arch=compute_90a,code=sm_90a -O3 -I solutions/cuda_v2 solutions/cuda_v2/flush.cu -o v2.cubin
    python solutions/cuda_v2/tools/sass_stretches.py v2.cubin [--kernel 0]     # 0: dense form, 1: deployment form

cuobjdump comes with the CUDA toolkit (also inside Triton's wheel: triton/backends/nvidia/bin).
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections import Counter

INSTR = re.compile(r"/\*[0-9a-f]{4,6}\*/\s+(?P<pred>@!?U?P\w+\s+)?(?P<op>[A-Z][A-Z0-9_]*)(?P<rest>[^;]*);")


def functions(cubin: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    tool = shutil.which("cuobjdump")
    if tool is None:
        sys.exit("cuobjdump not found on PATH")
    text = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    out = []
    for block in text.split("Function : ")[1:]:
        name = block.split()[0]
        rows = [(m["pred"] or "", m["op"], m["rest"]) for m in INSTR.finditer(block)]
        out.append((name, rows))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("cubin")
    p.add_argument("--kernel", type=int, default=0, help="index of the kernel in the cubin (default 0)")
    args = p.parse_args(argv)
    name, rows = functions(args.cubin)[args.kernel]
    last_exit = max(i for i, (_, op, _) in enumerate(rows) if op == "EXIT")
    rows = rows[:last_exit + 1]
    print(f"{name}: {len(rows)} instructions to the last EXIT")
    stretch, ops, branches = 0, Counter(), 0
    for pred, op, rest in rows + [("", "BAR", ".SYNC")]:
        if op == "BAR" and rest.strip().startswith(".SYNC"):
            n = sum(ops.values())
            top = ", ".join(f"{o} {c}" for o, c in ops.most_common(6))
            print(f"  stretch {stretch:2d}: {n:5d}  ({branches} predicated BRA)  {top}")
            stretch, ops, branches = stretch + 1, Counter(), 0
            continue
        ops[op] += 1
        branches += bool(pred) and op == "BRA"
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
