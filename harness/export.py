"""python -m harness.export DIR [--no-blobs] [--batch-sizes 1,64]: write the project as a self-contained
FlashInfer-bench dataset under DIR.

DIR/definitions/<op_type>/<definition>.json, DIR/workloads/<op_type>/<definition>.jsonl (the workload lines) with
their safetensors blobs at the same relative paths, DIR/workloads/blob/... (generated from their seeds where this
checkout has not made them yet, and checked against their recorded hashes; --no-blobs leaves them out),
DIR/solutions/<op_type>/<definition>/<solution>.json (sources inlined; the definition's reference among them, so
that every trace names a solution of the dataset) and DIR/traces/<op_type>/<definition>.jsonl (every solution's
traces of the exported workloads). --batch-sizes exports only those workloads and their traces."""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from safetensors.torch import save_file

from harness import HarnessError, cli
from harness.definition import PINS, load_definition
from harness.project import Project
from harness.records import BuildSpec, SolutionRecord, SourceFile
from harness.solutions import REFERENCE, discover, load_solution
from harness.traces import load_traces
from harness.workloads import load_inputs, load_workloads, save_workloads, select


def export(out: Path, project: Project, blobs: bool = True, batch_sizes=None) -> dict[str, int]:
    counts = {"definitions": 0, "workloads": 0, "blobs": 0, "solutions": 0, "traces": 0}
    for def_path in sorted(project.definitions.rglob("*.json")):
        defn = load_definition(def_path, project.definitions / PINS)
        sub = Path(defn.op_type)
        (out / "definitions" / sub).mkdir(parents=True, exist_ok=True)
        shutil.copy(def_path, out / "definitions" / sub / f"{defn.name}.json")
        counts["definitions"] += 1
        uuids = None
        if project.workload_file(defn).exists():
            workloads = select(load_workloads(defn, project.workload_file(defn)), batch_sizes)
            uuids = {w.uuid for w in workloads}
            save_workloads(out / "workloads" / sub / project.workload_file(defn).name, workloads)
            counts["workloads"] += len(workloads)
            for w in workloads if blobs else ():
                tensors = load_inputs(defn, w, root=project.root)  # made and checked against its hash if need be
                (out / w.blob).parent.mkdir(parents=True, exist_ok=True)
                save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / w.blob))
                counts["blobs"] += 1
        lines = []
        for name in discover(defn, project.solutions):
            sol = load_solution(name, defn, project.solutions)
            lines += [t for t in load_traces(defn.name, name, project.traces)
                      if uuids is None or t.workload.uuid in uuids]
            if sol.is_reference:
                record = SolutionRecord(
                    name=REFERENCE, definition=defn.name, author="definition",
                    description="the definition's reference code",
                    spec=BuildSpec(language="python", target_hardware=["CPU", "NVIDIA_H200"],
                                   entry_point="reference.py::run", destination_passing_style=False,
                                   dependencies=["torch"]),
                    sources=[SourceFile(path="reference.py", content=defn.reference)])
            else:       # the sources inline, as FlashInfer-bench carries them
                record = sol.record.model_copy(update={
                    "sources": [SourceFile(path=p, content=(sol.folder / p).read_text()) for p in sol.sources]})
            raw = record.to_json()
            dest = out / "solutions" / sub / defn.name / f"{name}.json"
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(json.dumps(raw, indent=2))
            counts["solutions"] += 1
        if lines:
            (out / "traces" / sub).mkdir(parents=True, exist_ok=True)
            (out / "traces" / sub / f"{defn.name}.jsonl").write_text(
                "".join(json.dumps(t.to_json()) + "\n" for t in lines))
            counts["traces"] += len(lines)
    return counts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = cli.description(__doc__)
    p.epilog = cli.epilog(None, families=True)
    p.add_argument("dir", type=Path, help="the dataset's folder (made if need be)")
    p.add_argument("--no-blobs", action="store_true", help="leave the workloads' tensors out (several GB in all)")
    cli.add_batch_sizes(p, help="comma-separated: export only these batch sizes' workloads and traces (default: all)")
    cli.add_project(p)


def main(argv=None) -> int:
    return execute(cli.parse(add_arguments, "python -m harness.export", argv))


def execute(args: argparse.Namespace) -> int:
    try:
        counts = export(args.dir, cli.project_of(args), blobs=not args.no_blobs, batch_sizes=args.batch_sizes)
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.dir}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
