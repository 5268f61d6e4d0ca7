"""python -m harness.drift --solution NAME [--windows 64] [--batch-size 1] [--device auto|cuda|cpu] [--record]: feed
each flush's checkpoint back with a fresh window, for many windows, and compare the accuracy with the reference
pipeline run on the same windows. Prints one row per window; exits 1 when any window's error ratio exceeds the
limit, 2 on bad input. The operator supplies the stream (`drift`) and its limit; the solution runs in its own worker
process. --record writes the table to <traces>/<definition>/drift_<NAME>.json (the project's traces/ by default;
rendered in LEADERBOARD.md by `python -m harness.report`)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness import HarnessError, cli, traces
from harness.cli import resolve_device
from harness.competition import load_competition
from harness.definition import project_definition
from harness.project import Project, write_file
from harness.ops import load_op
from harness.records import DriftRecord
from harness.runner import PASSED, Worker, run_call
from harness.solutions import load_solution

DRIFT_SEED = 20261203


def _epilog() -> str:
    """The exit codes, with the default definition's limit (its operator is loaded only when the help is shown)."""
    try:
        limit = load_op(project_definition(Project.find()).op_type).DRIFT_LIMIT
    except HarnessError:
        limit = "its operator's limit"
    return cli.epilog(f"a window's error ratio over {limit}, or the solution failed a flush")()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = cli.description(__doc__)
    p.epilog = _epilog
    cli.add_solution(p)
    p.add_argument("--windows", type=cli.positive_int, default=64, metavar="N",
                   help="windows to flush one after another (default: %(default)s)")
    cli.add_batch_size(p, 1, help="sequences per flush")
    cli.add_device(p)
    cli.add_definition(p)
    p.add_argument("--seed", type=int, default=DRIFT_SEED, metavar="N",
                   help="seed of the stream of windows (default: %(default)s)")
    cli.add_timeout(p, help="seconds per flush before giving up")
    p.add_argument("--record", action="store_true", help="write the table to <traces>/<definition>/drift_<NAME>.json")
    cli.add_traces(p, help="root of --record's file (default: the project's traces/)")


def main(argv=None) -> int:
    return execute(cli.parse(add_arguments, "python -m harness.drift", argv))


def execute(args: argparse.Namespace) -> int:
    try:
        device = resolve_device(args.device)
        project = cli.project_of(args)
        defn = project_definition(project, args.definition)
        op = load_op(defn.op_type)
        sol = load_solution(args.solution, defn, project.solutions)
        axes = defn.resolve_axes({"batch_size": args.batch_size})
        settings = cli.settings_of(args, load_competition(project))
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    worker = Worker(sol, defn, device, settings.timeout_s, hide=[project.root])

    def flush(**inputs):
        status, log, outputs = run_call(defn, worker, inputs, axes)
        if status != PASSED:
            raise HarnessError(f"{sol.name}: {status}: {log}")
        return outputs

    print(f"{sol.name}: {args.windows} windows at batch_size={args.batch_size} on {device}", flush=True)
    rows, score, limit = [], op.WORDING.score_key, op.DRIFT_LIMIT
    try:
        for row in op.drift(flush, defn.reference_run(), axes, args.windows, args.seed, device):
            rows.append(row)
            w = row[score]
            print(f"  window {row['window']:3d}: error {row['error']:.4g} reference {row['reference_error']:.4g} "
                  f"ratio {row['ratio']:.4f}" + (f" {op.WORDING.score_of} {w:.4f}" if w is not None else ""),
                  flush=True)
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        worker.close()
    worst = max(rows, key=lambda r: r["ratio"])
    print()
    print(cli.table([[r["window"], f"{r['error']:.4g}", f"{r['reference_error']:.4g}", f"{r['ratio']:.4f}",
                     f"{r[score]:.4f}" if r[score] is not None else "-"] for r in rows],
                    ["window", "error", "reference error", "ratio", op.WORDING.score_label]))
    print(f"\nworst window {worst['window']}: ratio {worst['ratio']:.4f} (limit {limit})")
    if args.record:
        record = DriftRecord(definition=defn.name, solution=sol.name, solution_sha256=worker.sha256,
                             environment=traces.environment(device), windows=args.windows,
                             batch_size=args.batch_size, seed=args.seed, limit=limit, worst=worst, rows=rows)
        path = Path(args.traces or project.traces) / defn.name / f"drift_{sol.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, json.dumps(record.to_json(), indent=1) + "\n")
        print(f"wrote {path}")
    return 0 if worst["ratio"] <= limit else 1


if __name__ == "__main__":
    sys.exit(main())
