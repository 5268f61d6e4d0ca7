"""python -m harness.export DIR: write this repository as a FlashInfer-bench dataset under DIR.

DIR/definitions/<op_type>/<definition>.json, DIR/workloads/<op_type>/<definition>.jsonl (the workload lines as
they are; their safetensors paths stay relative to this repository, where the blobs are generated on demand),
DIR/solutions/<op_type>/<definition>/<solution>.json (sources inlined) and DIR/traces/<op_type>/<definition>.jsonl
(every solution's traces)."""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from harness import HarnessError
from harness.definition import load_definition
from harness.solutions import discover, load_solution
from harness.traces import TRACES, load_traces
from harness.workloads import workloads_path


def export(out: Path, root: Path = Path(".")) -> dict[str, int]:
    counts = {"definitions": 0, "workloads": 0, "solutions": 0, "traces": 0}
    for def_path in sorted((root / "definitions").rglob("*.json")):
        defn = load_definition(def_path)
        sub = Path(defn.op_type)
        (out / "definitions" / sub).mkdir(parents=True, exist_ok=True)
        shutil.copy(def_path, out / "definitions" / sub / f"{defn.name}.json")
        counts["definitions"] += 1
        wl = workloads_path(defn, root)
        if wl.exists():
            (out / "workloads" / sub).mkdir(parents=True, exist_ok=True)
            shutil.copy(wl, out / "workloads" / sub / wl.name)
            counts["workloads"] += sum(1 for line in wl.read_text().splitlines() if line.strip())
        lines = []
        for name in discover(defn, root / "solutions"):
            sol = load_solution(name, defn, root / "solutions")
            lines += load_traces(defn.name, name, root / TRACES)
            if sol.is_reference:
                continue
            raw = dict(sol.raw, sources=[{"path": p, "content": (sol.folder / p).read_text()} for p in sol.sources])
            raw["spec"] = dict(raw["spec"], destination_passing_style=sol.destination_passing_style)
            dest = out / "solutions" / sub / defn.name / f"{name}.json"
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(json.dumps(raw, indent=2))
            counts["solutions"] += 1
        if lines:
            (out / "traces" / sub).mkdir(parents=True, exist_ok=True)
            (out / "traces" / sub / f"{defn.name}.jsonl").write_text("".join(json.dumps(t) + "\n" for t in lines))
            counts["traces"] += len(lines)
    return counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.export", description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path)
    args = p.parse_args(argv)
    try:
        counts = export(args.dir)
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.dir}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
