"""Write the definition's workload file and blobs: one FlashInfer-bench workload line per (batch size, family).

    python scripts/gen_workloads.py                       # every family at batch sizes 1, 2, 16, ..., 512 (or the
                                                          # family's own, op.FAMILY_BATCH_SIZES)
    python scripts/gen_workloads.py --families trajectory # redo some lines; the others stay as they are
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import HarnessError  # noqa: E402
from harness.definition import find_definition  # noqa: E402
from harness.ops import load_op  # noqa: E402
from harness.workloads import BASE_SEED, DEFAULT_BATCH_SIZES, load_workloads, make_workload, save_workloads, \
    workloads_path  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--definition", default="leapquant_kda_flush_r4_int8_h32_v128_k128")
    p.add_argument("--batch-sizes", default=",".join(map(str, DEFAULT_BATCH_SIZES)))
    p.add_argument("--families", default=None, help="comma-separated (default: all of the operator's)")
    p.add_argument("--seed", type=int, default=BASE_SEED, help="base seed (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="device to generate on; the bits do not depend on it")
    args = p.parse_args(argv)
    try:
        defn = find_definition(args.definition)
        op = load_op(defn.op_type)
        families = args.families.split(",") if args.families else op.FAMILIES
        workloads = []
        for b in (int(x) for x in args.batch_sizes.split(",")):
            for family in families:
                if b not in op.FAMILY_BATCH_SIZES.get(family, (b,)):
                    continue
                t = time.time()
                workloads.append(make_workload(defn, family, {"batch_size": b}, args.seed, device=args.device))
                print(f"{family:>13} batch_size={b:<4} {time.time() - t:6.1f} s  {workloads[-1].blob}", flush=True)
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = workloads_path(defn)
    redone = {(w.family, tuple(w.axes.items())) for w in workloads}
    kept = load_workloads(defn) if path.exists() else []
    merged = [w for w in kept if (w.family, tuple(w.axes.items())) not in redone] + workloads
    order = {f: i for i, f in enumerate(load_op(defn.op_type).FAMILIES)}
    merged.sort(key=lambda w: (tuple(w.axes.values()), order[w.family]))
    save_workloads(path, merged)
    print(f"wrote {path} ({len(merged)} workloads, {len(workloads)} new)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
