"""Profiling helpers for a solution's kernels (Nsight Compute), for people tuning them.

  python scripts/ncu_profile.py run --solution NAME [--batch-size 64] [--family random] [--calls 3]
      calls the solution's entry point on one workload's inputs a few times, for ncu to capture, e.g.
      ncu --clock-control none -k regex:KERNEL -s 1 -c 1 --set full --import-source yes -o prof \\
          python scripts/ncu_profile.py run --solution triton_v1
      (--clock-control none: the card's clocks stay as they are)
  python scripts/ncu_profile.py stalls SOURCE_CSV CUBIN [--source FILE] [--top 30]
      SOURCE_CSV: `ncu -i prof.ncu-rep --page source --csv --print-source sass`; CUBIN: the profiled kernel's own
      cubin (Triton: `~/.triton/cache/*/KERNEL.cubin`; CUDA: `cuobjdump -xelf all` of the extension, built with
      -lineinfo). Prints the warp-stall samples by reason and by source line (the line table of the cubin, read
      with nvdisasm -g, maps each SASS instruction to its line; FILE names the source to quote, and code inlined
      from other files counts to the line of FILE that called it), with the instructions each line executed and its
      three main stall reasons.
"""
from __future__ import annotations

import argparse
import csv
import re
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import HarnessError  # noqa: E402

INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]{4,6}\*/\s+\S")
LINE = re.compile(r'//## File "(?P<file>[^"]+)", line (?P<line>\d+)')


def run_solution(name: str, batch_size: int, family: str, calls: int) -> None:
    import torch

    from harness.definition import find_definition
    from harness.run import DEFAULT_DEFINITION
    from harness.solutions import load_entry, load_solution
    from harness.workloads import load_inputs, load_workloads, select

    defn = find_definition(DEFAULT_DEFINITION)
    [workload] = select(load_workloads(defn), [batch_size], [family])
    entry = load_entry(load_solution(name, defn), defn)
    axes = defn.resolve_axes(workload.axes)
    x = load_inputs(defn, workload, "cuda")
    for _ in range(calls):
        entry(x, axes)
    torch.cuda.synchronize()


def nvdisasm() -> str:
    """nvdisasm from the CUDA toolkit, else the one Triton ships."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    import triton
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm")


def source_lines(cubin: str, source: str | None) -> list[tuple[str, int] | None]:
    """(file, line) of every SASS instruction of the cubin, in address order (None: no line information)."""
    text = subprocess.run([nvdisasm(), "-g", "-c", cubin], capture_output=True, text=True, check=True).stdout
    where, lines = None, []
    for row in text.splitlines():
        m = LINE.search(row)
        if m:
            # with a source file given, code inlined from elsewhere (a library's reduction) counts to the line of
            # that file it was called from
            if source is None or Path(m["file"]).name == Path(source).name:
                where = (m["file"], int(m["line"]))
        elif INSTRUCTION.match(row):
            lines.append(where)
    return lines


def stalls(source_csv: str, cubin: str, source: str | None, top: int) -> None:
    rows = list(csv.reader(open(source_csv)))
    header = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if header is None:
        raise ValueError(f"{source_csv}: no 'Address' header row: not `ncu --page source --csv --print-source sass`")
    col = {h: i for i, h in enumerate(rows[header])}
    data = rows[header + 1:]
    reasons = [h for h in col if h.startswith("stall_") and "Not Issued" not in h]
    lines = source_lines(cubin, source)
    if len(lines) != len(data):
        raise ValueError(f"the cubin has {len(lines)} instructions, the profile {len(data)}: not the profiled kernel")
    samples, executed, by_reason = Counter(), Counter(), defaultdict(Counter)
    for where, r in zip(lines, data):
        samples[where] += int(r[col["Warp Stall Sampling (All Samples)"]] or 0)
        executed[where] += int(r[col["Instructions Executed"]] or 0)
        for h in reasons:
            by_reason[where][h] += int(r[col[h]] or 0)
    total = sum(samples.values()) or 1
    overall = Counter()
    for c in by_reason.values():
        overall.update(c)
    print(f"{total} stall samples, {sum(executed.values())} warp-instructions executed")
    print("by reason: " + ", ".join(f"{h[6:]} {100 * v / total:.1f}%" for h, v in overall.most_common(8)))
    text = Path(source).read_text().splitlines() if source else []
    for where, s in samples.most_common(top):
        quote = text[where[1] - 1].strip()[:70] if where and text else (f"{where[0]}:{where[1]}" if where else "?")
        main = ", ".join(f"{h[6:]} {100 * v / max(s, 1):.0f}%" for h, v in by_reason[where].most_common(3))
        print(f"{100 * s / total:5.1f}%  {executed[where]:>10}  {where[1] if where else '-':>5}  {quote:70}  {main}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/ncu_profile.py", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="call a solution on one workload's inputs (for ncu)")
    r.add_argument("--solution", required=True)
    r.add_argument("--batch-size", type=int, default=64)
    r.add_argument("--family", default="random")
    r.add_argument("--calls", type=int, default=3)
    s = sub.add_parser("stalls", help="stall samples by source line")
    s.add_argument("source_csv")
    s.add_argument("cubin")
    s.add_argument("--source", help="the kernel's source file (quoted, and only its lines counted)")
    s.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)
    try:
        if args.command == "run":
            run_solution(args.solution, args.batch_size, args.family, args.calls)
        else:
            stalls(args.source_csv, args.cubin, args.source, args.top)
    except (HarnessError, OSError, ValueError, KeyError, subprocess.CalledProcessError) as e:
        print(f"error: {' '.join(str(e).split())[:300]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
