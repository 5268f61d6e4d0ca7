"""Profiling helpers for a solution's kernels (Nsight Compute), for people tuning them (`python -m harness profile`,
or `python -m harness.profile`).

  python -m harness profile run --solution NAME [--batch-size 64] [--family random] [--calls 3]
      calls the solution's entry point on one workload's inputs a few times, for ncu to capture (in this process,
      not sandboxed: for one's own solution, never for code one does not trust), e.g.
      ncu --clock-control none -k regex:KERNEL -s 1 -c 1 --set full --import-source yes -o prof \\
          python -m harness profile run --solution triton_v1
      (--clock-control none: the card's clocks stay as they are)
  python -m harness profile stalls SOURCE_CSV CUBIN [--source FILE] [--top 30]
      SOURCE_CSV: `ncu -i prof.ncu-rep --page source --csv --print-source sass`; CUBIN: the profiled kernel's own
      cubin (Triton: `~/.triton/cache/*/KERNEL.cubin`; CUDA: `cuobjdump -xelf all` of the extension, built with
      -lineinfo, as the solution's NOTES.md says; of several kernels in a cubin, the one as long as the profile is
      taken). Prints the warp-stall samples by reason, by stretch between CTA barriers and by
      source line (the line table of the cubin, read with nvdisasm -g, maps each SASS instruction to its line; FILE
      names the source to quote, and code inlined from other files counts to the line of FILE that called it), with
      the instructions each line executed and its three main stall reasons.
  python -m harness profile sass CUBIN [--top 12]
      no GPU needed: per kernel of a cubin (e.g. `nvcc -cubin -gencode=arch=compute_90a,code=sm_90a -O3 -I DIR
      FILE.cu`), its static SASS instructions, CTA barriers and most frequent opcodes, to predict a change's effect
      before timing it.

Exits 2 on bad input (a file that does not read, a profile of another kernel, an unknown solution)."""
from __future__ import annotations

import argparse
import csv
import re
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

from harness import HarnessError, cli

BARRIER = re.compile(r"\s*(@!?U?P\w+\s+)?BAR\.(SYNC|RED|ARV)")
SECTION = re.compile(r"\s*\.section\s+\.text\.(?P<name>[^,\s]+)")
OPCODE = re.compile(r"\s+/\*[0-9a-f]{4,6}\*/\s+(@!?U?P\w+\s+)?(?P<op>[A-Z][A-Z0-9_]*)")
LINE = re.compile(r'//## File "(?P<file>[^"]+)", line (?P<line>\d+)')


def run_solution(project, name: str, batch_size: int, family: str, calls: int, definition: str | None) -> None:
    import torch

    from harness.definition import project_definition
    from harness.solutions import load_entry, load_solution
    from harness.workloads import load_inputs, load_workloads, select

    defn = project_definition(project, definition)
    [workload] = select(load_workloads(defn, project.workload_file(defn)), [batch_size], [family])
    entry = load_entry(load_solution(name, defn, project.solutions), defn)
    axes = defn.resolve_axes(workload.axes)
    x = load_inputs(defn, workload, "cuda", root=project.root)
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


def disassembly(cubin: str) -> list[tuple[str, str]]:
    """(kernel, row) for each row of the cubin's disassembly with line information, by the code section it is in
    ("" before the first)."""
    done = subprocess.run([nvdisasm(), "-g", "-c", cubin], capture_output=True, text=True)
    if done.returncode:
        why = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise ValueError(f"{cubin}: nvdisasm cannot read it ({why})")
    rows, kernel = [], ""
    for row in done.stdout.splitlines():
        section = SECTION.match(row)
        if section:
            kernel = section["name"]
        rows.append((kernel, row))
    return rows


def source_lines(cubin: str, source: str | None) -> dict[str, list[tuple[str, int] | None]]:
    """Per kernel of the cubin: (file, line) of each of its SASS instructions, in address order (None: no line
    information)."""
    kernels: dict[str, list[tuple[str, int] | None]] = {}
    where, current = None, None
    for kernel, row in disassembly(cubin):
        if kernel != current:
            where, current = None, kernel
        lines = kernels.setdefault(kernel, [])
        m = LINE.search(row)
        if m:
            # with a source file given, code inlined from elsewhere (a library's reduction) counts to the line of
            # that file it was called from
            if source is None or Path(m["file"]).name == Path(source).name:
                where = (m["file"], int(m["line"]))
        elif OPCODE.match(row):
            lines.append(where)
    return {k: v for k, v in kernels.items() if v}


def sass(cubin: str, top: int) -> None:
    """Static instruction counts per kernel of the cubin. What follows the last EXIT is out-of-line code (the slow
    paths of IEEE division and square root, the fallback of shuffles in a warp the compiler cannot prove converged),
    counted apart: it runs only when those cases arise."""
    kernels: dict[str, list[str]] = defaultdict(list)
    for kernel, row in disassembly(cubin):
        m = OPCODE.match(row)
        if m:
            kernels[kernel].append(m["op"])
    if not kernels:
        raise ValueError(f"{cubin}: no SASS instructions in it")
    for kernel, ops in kernels.items():
        main = max((i + 1 for i, op in enumerate(ops) if op == "EXIT"), default=len(ops))
        counts = Counter(ops[:main])
        print(f"{kernel}: {main} instructions to the last EXIT ({len(ops) - main} out of line after it), "
              f"{counts['BAR']} CTA barriers")
        print("  " + ", ".join(f"{op} {n}" for op, n in counts.most_common(top)))


def stalls(source_csv: str, cubin: str, source: str | None, top: int) -> None:
    rows = list(csv.reader(open(source_csv)))
    header = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if header is None:
        raise ValueError(f"{source_csv}: no 'Address' header row: not `ncu --page source --csv --print-source sass`")
    col = {h: i for i, h in enumerate(rows[header])}
    data = rows[header + 1:]
    reasons = [h for h in col if h.startswith("stall_") and "Not Issued" not in h]
    kernels = source_lines(cubin, source)
    # the profiled kernel is the one of the same length (a cubin may hold several, e.g. two instantiations)
    matching = [lines for lines in kernels.values() if len(lines) == len(data)]
    if not matching:
        sizes = ", ".join(str(len(v)) for v in kernels.values()) or "no"
        raise ValueError(f"the cubin's kernels have {sizes} instructions, the profile {len(data)}: "
                         "not the profiled kernel")
    if len(matching) > 1:
        raise ValueError(f"{len(matching)} kernels of the cubin have the profile's {len(data)} instructions")
    lines = matching[0]
    samples, executed, by_reason = Counter(), Counter(), defaultdict(Counter)
    # stretches between CTA barriers: a barrier's wait lands on the instruction after it, so each stretch's share
    # includes the wait for the slowest warp of the stretch before (e.g. one warp's serial section)
    segment, seg_samples, seg_executed, seg_first = 0, Counter(), Counter(), {}
    for where, r in zip(lines, data):
        n_samples = int(r[col["Warp Stall Sampling (All Samples)"]] or 0)
        n_executed = int(r[col["Instructions Executed"]] or 0)
        samples[where] += n_samples
        executed[where] += n_executed
        for h in reasons:
            by_reason[where][h] += int(r[col[h]] or 0)
        seg_samples[segment] += n_samples
        seg_executed[segment] += n_executed
        seg_first.setdefault(segment, where)
        if BARRIER.match(r[col["Source"]]):
            segment += 1
    total = sum(samples.values()) or 1
    overall = Counter()
    for c in by_reason.values():
        overall.update(c)
    print(f"{total} stall samples, {sum(executed.values())} warp-instructions executed")
    print("by reason: " + ", ".join(f"{h[6:]} {100 * v / total:.1f}%" for h, v in overall.most_common(8)))
    text = Path(source).read_text().splitlines() if source else []
    if segment:
        all_executed = sum(seg_executed.values()) or 1
        print("by stretch between CTA barriers (samples, instructions, first line):")
        for k in sorted(seg_samples):
            first = seg_first[k][1] if seg_first[k] else "-"
            print(f"  {k:3d}  {100 * seg_samples[k] / total:5.1f}%  {100 * seg_executed[k] / all_executed:5.1f}%  "
                  f"{first}")
    for where, s in samples.most_common(top):
        quote = text[where[1] - 1].strip()[:70] if where and text else (f"{where[0]}:{where[1]}" if where else "?")
        main = ", ".join(f"{h[6:]} {100 * v / max(s, 1):.0f}%" for h, v in by_reason[where].most_common(3))
        print(f"{100 * s / total:5.1f}%  {executed[where]:>10}  {where[1] if where else '-':>5}  {quote:70}  {main}")


def _tool_doc(tool: str) -> str:
    """The module docstring's paragraph on one tool (the lines under its `python -m harness profile TOOL`)."""
    lines = __doc__.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  python -m harness profile {tool} "))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("      ")), len(lines))
    return "\n".join(line[6:] for line in lines[start + 1:end])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = cli.description(__doc__)
    p.epilog = cli.epilog(None)
    sub = p.add_subparsers(dest="tool", metavar="TOOL", required=True, title="tools")
    r = sub.add_parser("run", help="call a solution on one workload's inputs (for ncu)", description=_tool_doc("run"))
    r.epilog = cli.epilog(None, families=True)
    cli.add_solution(r)
    cli.add_batch_size(r, 64, help="the workload's batch size")
    cli.add_family(r, "random")
    r.add_argument("--calls", type=cli.positive_int, default=3, metavar="N",
                   help="calls to the entry point (default: %(default)s)")
    cli.add_definition(r)
    s = sub.add_parser("stalls", help="stall samples by source line and by stretch between CTA barriers",
                       description=_tool_doc("stalls"))
    s.epilog = cli.epilog(None)
    s.add_argument("source_csv", help="`ncu -i prof.ncu-rep --page source --csv --print-source sass` of the profile")
    s.add_argument("cubin", help="the profiled kernel's own cubin, with line information")
    s.add_argument("--source", metavar="FILE", help="the kernel's source file (quoted, and only its lines counted)")
    s.add_argument("--top", type=cli.positive_int, default=30, metavar="N",
                   help="source lines to list (default: %(default)s)")
    c = sub.add_parser("sass", help="static instruction counts per kernel of a cubin (no GPU)",
                       description=_tool_doc("sass"))
    c.epilog = cli.epilog(None)
    c.add_argument("cubin", help="a cubin, e.g. from nvcc -cubin")
    c.add_argument("--top", type=cli.positive_int, default=12, metavar="N",
                   help="most frequent opcodes to list per kernel (default: %(default)s)")


def main(argv=None) -> int:
    return execute(cli.parse(add_arguments, "python -m harness.profile", argv))


def execute(args: argparse.Namespace) -> int:
    try:
        if args.tool == "run":
            run_solution(cli.project_of(args), args.solution, args.batch_size, args.family, args.calls,
                         args.definition)
        elif args.tool == "sass":
            sass(args.cubin, args.top)
        else:
            stalls(args.source_csv, args.cubin, args.source, args.top)
    except (HarnessError, OSError, ValueError, KeyError) as e:
        print(f"error: {' '.join(str(e).split())[:300]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
