"""python -m harness gen-workloads [--families F,F] [--batch-sizes B,B] [--seed N]: write the definition's workload
file and blobs, one FlashInfer-bench workload line per (batch size, family).

    python -m harness gen-workloads                          # every family at batch sizes 1, 2, 16, ..., 512 (or
                                                             # the family's own, op.FAMILY_BATCH_SIZES)
    python -m harness gen-workloads --families trajectory    # redo some lines; the others stay as they are

The lines of the families and batch sizes asked for are replaced (or added); the others are kept as they are. Exits 2
on bad input (an unknown definition or family)."""
from __future__ import annotations

import argparse
import sys
import time

from harness import HarnessError, cli
from harness.definition import project_definition
from harness.ops import load_op
from harness.workloads import BASE_SEED, DEFAULT_BATCH_SIZES, load_workloads, make_workload, save_workloads


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = cli.description(__doc__)
    p.epilog = cli.epilog(None, families=True)
    cli.add_definition(p)
    cli.add_batch_sizes(p, default=DEFAULT_BATCH_SIZES,
                        help="comma-separated batch sizes; a family with its own list (op.FAMILY_BATCH_SIZES) is "
                             f"written at those of them only (default: {','.join(map(str, DEFAULT_BATCH_SIZES))})")
    cli.add_families(p, help="comma-separated input families (default: all of the operator's)")
    p.add_argument("--seed", type=int, default=BASE_SEED, metavar="N", help="base seed (default: %(default)s)")
    cli.add_device(p, "cpu", help="device to generate on; the bits do not depend on it")


def main(argv=None) -> int:
    return execute(cli.parse(add_arguments, "python -m harness.gen_workloads", argv))


def execute(args: argparse.Namespace) -> int:
    try:
        device = cli.resolve_device(args.device, "the bits do not depend on it")
        project = cli.project_of(args)
        defn = project_definition(project, args.definition)
        op = load_op(defn.op_type)
        families = args.families or op.FAMILIES
        unknown = [f for f in families if f not in op.FAMILIES]
        if unknown:
            raise HarnessError(f"unknown input family {unknown[0]!r} (known: {', '.join(op.FAMILIES)})")
        workloads = []
        for b in args.batch_sizes:
            for family in families:
                if b not in op.FAMILY_BATCH_SIZES.get(family, (b,)):
                    continue
                t = time.time()
                workloads.append(make_workload(defn, family, {"batch_size": b}, args.seed, root=project.root,
                                               device=device))
                print(f"{family:>13} batch_size={b:<4} {time.time() - t:6.1f} s  {workloads[-1].blob}", flush=True)
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = project.workload_file(defn)
    redone = {(w.family, tuple(w.axes.items())) for w in workloads}
    kept = load_workloads(defn, path) if path.exists() else []
    merged = [w for w in kept if (w.family, tuple(w.axes.items())) not in redone] + workloads
    order = {f: i for i, f in enumerate(op.FAMILIES)}
    merged.sort(key=lambda w: (tuple(w.axes.values()), order[w.family]))
    save_workloads(path, merged)
    print(f"wrote {path} ({len(merged)} workloads, {len(workloads)} new)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
