"""python -m harness.run --solution NAME [--solution NAME2 ...] [--batch-sizes 1,64] [--families edge,random]
[--device auto|cuda|cpu] [--devices all|cuda:0,cuda:1,...] [--seed N] [--keep-going]: judge (and on a GPU time)
solutions on the definition's workloads and print one table, then one line that sums it up ("3 solutions x 36
workloads: 107 PASSED, 1 INCORRECT_NUMERICAL"). Every workload is judged on its committed inputs and on fresh ones
drawn from a seed made for this run (recorded in the traces); on a GPU it is timed on fresh inputs too. With --seed,
the chosen workloads are drawn anew from base seed N and only judged.
Exits 1 when any workload is not PASSED, 2 on bad input (definition, solution, workload file or arguments)."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from harness import HarnessError, cli, one_line, sandbox, timing, traces
from harness.competition import load_competition
from harness.definition import project_definition
from harness.ops import Operator, load_op
from harness.runner import (COMPILE_ERROR, INCORRECT_DTYPE, INCORRECT_NUMERICAL, INCORRECT_SHAPE, PASSED,
                            RUNTIME_ERROR, TIMEOUT, Calibration, Result, deal, evaluate)
from harness.solutions import REFERENCE, SolutionError, discover, load_solution, unmet_needs
from harness.workloads import load_workloads, make_workload, select

CPU_BATCH_SIZES = (1, 2)
# FlashInfer-bench's statuses, in the order a summary lists them
STATUSES = (PASSED, INCORRECT_SHAPE, INCORRECT_DTYPE, INCORRECT_NUMERICAL, RUNTIME_ERROR, COMPILE_ERROR, TIMEOUT)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = cli.description(__doc__)
    p.epilog = cli.epilog("a workload not PASSED, or a solution folder that does not load", families=True)
    cli.add_solution(p, many=True)
    cli.add_definition(p)
    cli.add_batch_sizes(p, help="comma-separated batch sizes (default: the competition file's run.batch_sizes, else "
                                "all; 1,2 on CPU)")
    cli.add_families(p, help="comma-separated input families (default: the competition file's run.families, else all)")
    p.add_argument("--workloads", metavar="FILE",
                   help="a workload file (JSONL) instead of the definition's, e.g. a reproducer written by "
                        "harness.stress; its workloads at every batch size; no traces unless --traces is given")
    cli.add_device(p)
    p.add_argument("--devices", metavar="LIST|all",
                   help="run over several devices at once, one worker each, a solution's workloads dealt among them "
                        "(timing stays one job per GPU): 'all' (every GPU torch sees), 'cuda:0,cuda:1,...', or "
                        "'cpu,cpu' (several CPU workers); overrides --device")
    p.add_argument("--ray", metavar="auto|ADDRESS",
                   help="run the jobs on a Ray cluster (pip install -e \".[cluster]\"): each a task holding one whole "
                        "GPU (one CPU where the cluster has none), on the nodes' copy of the project at the same path; "
                        "overrides --device and --devices")
    cli.add_timeout(p, help="seconds per call before TIMEOUT; a solution's first timeout or dead worker ends its run: "
                            "its remaining workloads are reported without running")
    p.add_argument("--keep-going", action="store_true",
                   help="after a timeout or dead worker, restart the worker and run the solution's remaining workloads")
    p.add_argument("--run-seed", type=int, metavar="N",
                   help="draw this run's fresh inputs and timing programs from seed N (default: a random seed, "
                        "recorded in the traces), to reproduce a run")
    cli.add_traces(p, help="write FlashInfer-bench traces under DIR (default: the project's traces/ when timed on a "
                           "GPU; CPU runs write none unless given)")
    p.add_argument("--no-traces", action="store_true", help="write no traces")
    p.add_argument("--save-outputs", metavar="DIR",
                   help="write each solution's outputs on each workload's committed inputs to DIR/<solution>/<the "
                        "workload blob's name> (safetensors, keyed by output name), to study a verdict beside the "
                        "reference; not with --ray")
    p.add_argument("--seed", type=int, metavar="N",
                   help="judge on fresh inputs: the chosen workloads drawn anew from base seed N (blobs in a "
                        "temporary folder; the committed workloads are untouched); judged, not timed, no traces")


def parse_args(argv=None) -> argparse.Namespace:
    return cli.parse(add_arguments, "python -m harness.run", argv)


def resolve_device(choice: str) -> str:
    return cli.resolve_device(choice, "Triton through the interpreter, batch sizes 1,2 by default, not timed")


def resolve_devices(text: str) -> tuple[str, list[int | None]]:
    """(device kind, one slot per worker: a GPU index, or None for a CPU worker) from --devices."""
    import torch

    if text.strip() == "all":
        if not torch.cuda.is_available():
            raise HarnessError("--devices all: torch sees no GPU")
        return "cuda", list(range(torch.cuda.device_count()))
    items = [x.strip() for x in text.split(",")]
    if all(x == "cpu" for x in items):
        return "cpu", [None] * len(items)
    if not all(x.startswith("cuda:") and x[5:].isdigit() for x in items) or len(set(items)) < len(items):
        raise HarnessError(f"--devices {text!r}: give 'all', distinct cuda:N entries, or cpu entries")
    gpus = [int(x[5:]) for x in items]
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if max(gpus) >= count:
        raise HarnessError(f"--devices {text!r}: torch sees {count} GPU(s)")
    models = {torch.cuda.get_device_name(g) for g in gpus}
    if len(models) > 1:         # a trace names one hardware, and speedups compare times of one model
        raise HarnessError(f"--devices {text!r}: GPUs of different models ({', '.join(sorted(models))})")
    return "cuda", gpus


def evaluate_over(slots: list[int | None], calibrations: list, defn, sol, todo, device: str, **kwargs) -> list[Result]:
    """evaluate() with the workloads dealt among the slots, one thread and one worker each, the results in the order
    of `todo`; one slot runs in this thread."""
    if len(slots) == 1:
        return evaluate(defn, sol, todo, device, calibration=calibrations[0], gpu=slots[0], **kwargs)
    with ThreadPoolExecutor(len(slots), thread_name_prefix="device") as pool:
        futures = [pool.submit(evaluate, defn, sol, share, device, calibration=calibration, gpu=gpu, **kwargs)
                   for share, gpu, calibration in zip(deal(todo, len(slots)), slots, calibrations)]
        done = {r.workload.uuid: r for f in futures for r in f.result()}
    return [done[w.uuid] for w in todo]


def table(results: list[Result], op: Operator, unloadable: list[tuple[str, str]] = ()) -> str:
    """One row per result, the verdict's score under the operator's name for it; a solution that did not load (a
    folder that does not parse, or an entry point that does not import) is one row, not one per workload."""
    rows = [[name, "-", "all", COMPILE_ERROR, "-", "-", "-", "-", log[:90]] for name, log in unloadable]
    for r in results:
        if r.status == COMPILE_ERROR and _failed_to_load(r.solution, results):
            if not any(row[0] == r.solution for row in rows):
                rows.append([r.solution, "-", "all", COMPILE_ERROR, "-", "-", "-", "-", r.log[:90]])
            continue
        v = r.verdict
        rows.append([r.solution, r.workload.axes.get("batch_size"), r.workload.family, r.status,
                     f"{v.score:.4f}" if v and v.score is not None else "-",
                     f"{r.latency_ms * 1e3:.1f}" if r.latency_ms is not None else "-",
                     f"{r.floor_ms * 1e3:.1f}" if r.floor_ms else "-",
                     f"{r.latency_ms / r.floor_ms:.2f}" if r.latency_ms is not None and r.floor_ms else "-",
                     r.log[:90]])
    return cli.table(rows, ["solution", "B", "family", "status", op.WORDING.score_label, "latency us",
                            "floor us", "x floor", "log"])


def _failed_to_load(solution: str, results: list[Result]) -> bool:
    mine = [r for r in results if r.solution == solution]
    return bool(mine) and all(r.status == COMPILE_ERROR for r in mine)


class _Recorder:
    """on_result of one solution's run: reports each result (`progress`) and merges its trace into trace_root (None:
    no traces) as it arrives, so that a run cut short keeps the workloads it finished. Results may arrive from
    several threads (a run over several GPUs)."""

    def __init__(self, trace_root: Path | None, env: dict, reference_ms: dict, is_reference: bool, progress):
        self.trace_root, self.env, self.reference_ms, self.is_reference = trace_root, env, reference_ms, is_reference
        self.progress, self.lock = progress, threading.Lock()
        self.written: set[Path] = set()
        self.error: str | None = None

    def __call__(self, r: Result) -> None:
        with self.lock:
            self.progress(r)
            if self.trace_root is None or self.error:
                return
            reference = r.latency_ms if self.is_reference else self.reference_ms.get(r.workload.uuid)
            try:
                self.written.update(traces.write_traces([traces.trace_record(r, self.env, reference, r.sha256)],
                                                        self.trace_root))
            except HarnessError as e:
                self.error = str(e)


def _progress(solution: str, total: int, score_label: str):
    """One line per result, and on a terminal a progress bar (done / total, elapsed, estimated time left) beneath."""
    bar = tqdm(total=total, desc=solution, unit="workload", leave=False, disable=not sys.stdout.isatty())
    said, done = set(), 0

    def report(r: Result) -> None:
        nonlocal done
        done += 1                           # counted here: a disabled bar (not a terminal) counts nothing
        bar.update(1)
        if done >= total:
            bar.close()
        if r.status == COMPILE_ERROR:       # the same load error for every workload: said once
            if r.solution in said:
                return
            said.add(r.solution)
        score = r.verdict.score if r.verdict else None
        tqdm.write(f"  [{r.solution} {done}/{total}] {r.workload.label}: {r.status}"
                   + (f" {score_label} {score:.4f}" if score is not None else "")
                   + (f" {r.latency_ms * 1e3:.1f} us" if r.latency_ms is not None else "")
                   + (f" ({one_line(r.log)})" if r.log else ""), file=sys.stdout)
        sys.stdout.flush()
    return report


def summary(results: list[Result], unloadable: list[tuple[str, str]], n_workloads: int) -> str:
    """The run in one line, e.g. "3 solutions x 36 workloads: 107 PASSED, 1 INCORRECT_NUMERICAL": every judged
    workload's status, PASSED first; a solution folder that did not load counts as a COMPILE_ERROR on every
    workload."""
    counts = Counter(r.status for r in results)
    if unloadable:
        counts[COMPILE_ERROR] += len(unloadable) * n_workloads
    n_solutions = len({r.solution for r in results} | {name for name, _ in unloadable})
    statuses = sorted(counts, key=lambda s: (s != PASSED, STATUSES.index(s) if s in STATUSES else len(STATUSES), s))
    return (f"{n_solutions} solution{'s' if n_solutions != 1 else ''} x {n_workloads} "
            f"workload{'s' if n_workloads != 1 else ''}: "
            + (", ".join(f"{counts[s]} {s}" for s in statuses) if counts else "nothing run"))


def main(argv=None) -> int:
    return execute(parse_args(argv))


def execute(args: argparse.Namespace) -> int:
    try:
        cluster_env = None
        if args.ray is not None:
            if args.seed is not None:
                raise HarnessError("--ray with --seed: fresh workloads are drawn into a local folder; run --seed here")
            if args.save_outputs is not None:
                raise HarnessError("--ray with --save-outputs: outputs are written on the machine that judges them; "
                                   "run --save-outputs here")
            from harness import cluster
            device, cluster_slots, cluster_env = cluster.connect(args.ray)
            slots = [None]
        elif args.devices is not None:
            device, slots = resolve_devices(args.devices)
        else:
            device, slots = resolve_device(args.device), [None]
        if args.save_outputs is not None:
            try:
                Path(args.save_outputs).mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise HarnessError(f"--save-outputs {args.save_outputs}: {e.strerror}") from None
        project = cli.project_of(args)
        competition = load_competition(project)
        settings = cli.settings_of(args, competition)
        defn = project_definition(project, args.definition)
        op = load_op(defn.op_type)
        solutions, unloadable = [], []
        for name in args.solutions or discover(defn, project.solutions):
            try:
                solutions.append(load_solution(name, defn, project.solutions))
            except SolutionError as e:
                if args.solutions:          # named on the command line: bad input
                    raise
                unloadable.append((name, str(e)))   # found in solutions/: one status line, the others still run
        # a flag, else the competition file's run (not for a workload file of its own), else all (1, 2 on CPU)
        chosen = competition.run if not args.workloads else None
        batch_sizes = args.batch_sizes or (chosen and chosen.batch_sizes) or (
            CPU_BATCH_SIZES if device == "cpu" and not args.workloads else None)
        families = args.families or (chosen and chosen.families) or None
        workload_file = Path(args.workloads or project.workload_file(defn)).resolve()
        workloads = select(load_workloads(defn, workload_file), batch_sizes, families)
        fresh = tempfile.TemporaryDirectory(prefix="harness_seed_") if args.seed is not None else None
        root = Path(fresh.name) if fresh else project.root
        if fresh:
            workloads = [make_workload(defn, w.family, w.axes, args.seed, root=root, device=device, params=w.params)
                         for w in workloads]
        timed = device == "cuda" and not fresh
        trace_root = (None if args.no_traces or fresh else Path(args.traces) if args.traces
                      else project.traces if timed and not args.workloads else None)
        for name in [REFERENCE, *(s.name for s in solutions)] if trace_root is not None else ():
            traces.load_traces(defn.name, name, trace_root)     # a malformed trace file stops the run before it starts
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    unmet = {s.name: unmet_needs(s, device) for s in solutions}
    for sol in [s for s in solutions if unmet[s.name]]:
        print(f"skipping {sol.name}: {unmet[sol.name]}", flush=True)
    solutions = [s for s in solutions if not unmet[s.name]]
    env = cluster_env or traces.environment(device)
    run_seed = args.run_seed if args.run_seed is not None else int.from_bytes(os.urandom(7), "little")
    on = device if slots == [None] else f"{len(slots)} x {device}" + (
        f" ({', '.join(f'cuda:{g}' for g in slots)})" if device == "cuda" else "")
    if args.ray is not None:
        on = f"a Ray cluster ({cluster_slots} x {device})"
    print(f"{defn.name}: {len(solutions)} solution(s) x {len(workloads)} workload(s) on {on} "
          f"({env['hardware']}), run seed {run_seed}"
          + (f", fresh inputs from base seed {args.seed}, not timed" if fresh else ""), flush=True)
    if sandbox.unavailable():
        print(f"WARNING: solutions run UNSANDBOXED: {sandbox.unavailable()}; traces record it", flush=True)
    # speedups need the reference's latency on the same workloads and hardware: from its traces, else timed now
    reference_ms = {}
    if timed and trace_root is not None and all(s.name != REFERENCE for s in solutions):
        recorded = traces.reference_latencies(defn.name, env["hardware"], trace_root)
        reference_ms = {w.uuid: recorded.get(w.uuid) for w in workloads}
        if None in reference_ms.values():
            print("timing the reference too, for the speedups", flush=True)
            solutions.insert(0, load_solution(REFERENCE, defn, project.solutions))
    # one copy rate for the whole run, so that every solution's floor in it is the same (on a cluster each job
    # measures its own: the driver may have no GPU)
    local = args.ray is None
    if timed and settings.bandwidth is None and local:
        settings = settings.replace(bandwidth=timing.copy_bandwidth(device))
    calibrations = [Calibration(defn, settings) if timed and local else None for _ in slots]   # one a GPU
    results: list[Result] = []
    unwritten: list[str] = []
    for sol in solutions:
        todo = workloads
        if sol.name == REFERENCE and reference_ms:
            todo = [w for w in workloads if reference_ms[w.uuid] is None]
        if timed and local:
            others = timing.gpu_processes(device)
            env["gpu_other_processes"] = others
            if others:
                print(f"WARNING: other processes use the GPU while {sol.name} is timed: {others}", flush=True)
        progress = _progress(sol.name, len(todo), op.WORDING.score_label)
        recorder = _Recorder(trace_root, env, reference_ms, sol.name == REFERENCE, progress)
        if local:
            done = evaluate_over(slots, calibrations, defn, sol, todo, device, root=root, settings=settings,
                                 hide=(project.root,), timed=timed, run_seed=run_seed, keep_going=args.keep_going,
                                 on_result=recorder, failures=project.stress_failures / "_timed_calls",
                                 save_outputs=Path(args.save_outputs).absolute() if args.save_outputs else None)
        else:
            done = cluster.evaluate_on_cluster(cluster_slots, project, defn, sol, todo, device, workload_file,
                                               settings, run_seed, timed, args.keep_going, recorder)
        if sol.name == REFERENCE:
            reference_ms.update({r.workload.uuid: r.latency_ms for r in done})
        for path in sorted(recorder.written):
            print(f"  wrote {path}", flush=True)
        if recorder.error:                  # a full disk: this solution's later records are lost, not the others'
            print(f"{cli.cell(sol.name)}: traces not written: {recorder.error}", flush=True)
            unwritten.append(sol.name)
        results += done
    for name, log in unloadable:
        print(f"{cli.cell(name)}: {COMPILE_ERROR}: {log}", flush=True)
    print()
    print(table(results, op, unloadable))
    print()
    print(summary(results, unloadable, len(workloads)), flush=True)
    return 0 if all(r.status == PASSED for r in results) and not unloadable and not unwritten else 1


if __name__ == "__main__":
    sys.exit(main())
