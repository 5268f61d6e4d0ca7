"""How much of the criterion's 1% margin the reference itself uses up: the definition's reference code, changed only
in the order of its fp32 operations (or made more precise), judged against the unchanged reference by the harness's
own judge, on the project's committed workloads (--project, else found as every command finds it). From the
repository root (so that this checkout's harness is the one imported):

    python -m scripts.reference_reorder --device cuda --batch-sizes 256,512 --families edge,second_window
    python -m scripts.reference_reorder --device cuda --batch-sizes 256,512 --seed 1     # fresh inputs, base seed 1

Every variant computes the same math as the reference. A variant that fails means the criterion cannot tell a
reordering of the reference from a wrong kernel on that workload: a kernel's margin there is a draw, not a design
property (docs/operator.md, section 5). The judge itself measures a head over the ratio against these orderings
before it fails it; this script shows the plain criterion's margin.
"""
import argparse
import sys
import tempfile

from harness import HarnessError, cli
from harness.definition import project_definition
from harness.ops import load_op
from harness.ops.leapquant_kda_flush.criterion import ORDERINGS, ordering_run
from harness.workloads import load_inputs, load_workloads, make_workload, select

# name -> edits of the reference's code string (old, new): the reference itself, and the equivalent orderings the
# judge also measures a head against before it fails it on the ratio
VARIANTS = {"reference, run again": [], **ORDERINGS}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = cli.description(__doc__)
    p.epilog = cli.epilog(None, families=True)
    cli.add_device(p, "cpu")
    cli.add_batch_sizes(p, default=(256, 512), help="comma-separated batch sizes (default: 256,512)")
    cli.add_families(p)
    p.add_argument("--seed", type=int, metavar="N", help="the chosen workloads drawn anew from base seed N")
    cli.add_definition(p)


def main(argv=None) -> int:
    """Exits 0 once every judgement is made, failed ones included (they are what is measured)."""
    args = cli.parse(add_arguments, "python -m scripts.reference_reorder", argv)
    try:
        device = cli.resolve_device(args.device)
        project = cli.project_of(args)
        defn = project_definition(project, args.definition)
        op = load_op(defn.op_type)
        reference = defn.reference_run()
        runs = {name: ordering_run(defn.reference, edits, name) for name, edits in VARIANTS.items()}
        chosen = select(load_workloads(defn, project.workload_file(defn)), args.batch_sizes, args.families)
        fresh = tempfile.TemporaryDirectory(prefix="reference_reorder_") if args.seed is not None else None
        root = fresh.name if fresh else project.root
        if fresh:
            chosen = [make_workload(defn, w.family, w.axes, args.seed, root=root, device=device) for w in chosen]
    except (HarnessError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dtypes = [spec.torch_dtype for spec in defn.outputs.values()]
    print(f"{'family':14s} {'B':>4s}  {'variant':28s} {op.WORDING.score_label:>16s}  verdict")
    failed = 0
    for w in chosen:
        inputs = load_inputs(defn, w, device, root=root)
        ref_out = reference(**inputs)
        for name, run in runs.items():
            outputs = [t.to(dt) for t, dt in zip(run(**inputs), dtypes)]
            v = op.judge(inputs, outputs, ref_out)
            failed += not v.passed
            ratio = "-" if v.score is None else f"{v.score:.4f}"
            print(f"{w.family:14s} {w.axes['batch_size']:4d}  {name:28s} {ratio:>16s}  "
                  f"{'PASSED' if v.passed else 'FAILED: ' + v.reason}", flush=True)
    print(f"{failed} of {len(chosen) * len(runs)} judgements failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
