"""python -m harness deploy --solution NAME [--batch-sizes 64,256,512] [--family random] [--traces DIR]
[--device auto|cuda|cpu]: time a solution's deployment form on the GPU and write
<traces>/<definition>/deploy_<NAME>.json (traces: the project's traces/ by default; rendered in LEADERBOARD.md by
`python -m harness.report`). Exits 1 when a case fails its check (below) or the solution's worker fails, 2 on bad
input.

The deployment form is the solution's `pool.py::flush_inplace(pool, idx, ...)` on the operator's `Pool`
(harness/ops/<op_type>/, docs/operator.md "Deployment form": one flat buffer in the published engine
layout, the dense window and the fill counter `count`). It runs in the solution's sandboxed worker, as
`python -m harness.run` runs `run` (harness.runner.Worker; the worker's side is harness/deploy.py). Cases, each one
CUDA graph of one call on a pool of B + 1 slots filled with a workload's inputs (family `--family`), timed by
harness.timing (graph replays between CUDA events, L2 flushed before each, median of Settings.replay_calls after
warm-up):
every program due at each batch size; the steady state at the largest, one sequence in 16 due (a different 16th
each call, as when every sequence flushes every 16 tokens); none due at the largest, against a 5 us target, both as
a graph of its own and as its marginal cost in a graph of several L2-cold steps, as a serving engine's decode graph
holds it; and, for scale, one graph of an empty kernel timed the same way (the timer's floor). Before every call,
outside the timed region, the pool is refilled with the inputs under a fresh assignment of sequences to slots (idx,
drawn here and sent with the inputs), so nothing can be reused. The floor counts every byte the flushed programs
read and write once, window reset included, at the measured copy rate. After the last call of each case the worker
sends the state of its slots and this process judges it ("checked" and "status" in the record): the due sequences'
checkpoints meet the operator's criterion against the reference on their inputs and their windows are reset (the
fields of the operator's WINDOW_RESET; the others may keep their values), every other sequence's checkpoint and
window is as refilled, and no counter changes. The times are the worker's own (its CUDA events around the
replays): unlike `harness run`'s, they are not checked against this process's clock, and the state judged is the one
the worker sends; a median below timing.IMPOSSIBLE_FRACTION of the floor is refused. Read them as the solution's
claim, not as a ranked result.

With `--device cpu` (CI: Triton through its interpreter) each case is one untimed call, judged the same way, and
nothing is written."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from harness import HarnessError, cli, deploy, timing, traces, wire
from harness.competition import load_competition
from harness.definition import project_definition
from harness.ops import load_op
from harness.project import Settings, write_file
from harness.records import DeployRecord
from harness.runner import INCORRECT_NUMERICAL, PASSED, RUNTIME_ERROR, Worker, program_layout
from harness.solutions import load_solution
from harness.workloads import load_inputs, load_workloads, select

NONE_DUE_TARGET_US = 5.0
SEED = 20261204


def program_bytes(defn, op) -> int:
    """Bytes one flushed program reads and writes once: its part of every batched input and of every output, and
    the window reset it writes."""
    batched, n_prefix = program_layout(defn)
    axes = defn.resolve_axes({"batch_size": 1})
    specs = [defn.inputs[n] for n in (*batched, *op.WINDOW_RESET)] + list(defn.outputs.values())
    return sum(math.prod(defn.shape(s, axes)[n_prefix:]) * s.torch_dtype.itemsize for s in specs)


def schedule(counts, batch_size: int, n_calls: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Call k's fill counter of every sequence, counts(k), as int32 [n_calls, B], and its slots, a fresh
    permutation of 1..B, as int32 [n_calls, B] (drawn from SEED)."""
    gen = torch.Generator().manual_seed(SEED)
    slots = torch.stack([torch.randperm(batch_size, generator=gen) + 1 for _ in range(n_calls)])
    return torch.stack([counts(k) for k in range(n_calls)]).to(torch.int32), slots.to(torch.int32)


def check_state(defn, op, x: dict, count: torch.Tensor, state: dict) -> tuple[str, str]:
    """(status, log) of the state a case's last call left in its slots (`state`, per sequence in the order of x, as
    the worker read it from the pool), that call's inputs x and fill counters count [B, ...]: the counters as
    written; every sequence not due with its checkpoint and window as written; every due one (a full window) with
    its window reset (op.WINDOW_RESET) and its checkpoint meeting op.judge against the reference on its inputs."""
    device = x[op.CHECKPOINT[0]].device
    written = {**{name: x[name] for name in (*op.CHECKPOINT, *op.WINDOW)}, "count": count.to(device)}
    for name, want in written.items():
        got = state.get(name)
        if got is None or got.dtype != want.dtype or got.shape != want.shape:
            sent = "nothing" if got is None else f"{got.dtype} {list(got.shape)}"
            return RUNTIME_ERROR, f"malformed reply: the pool's {name} came back as {sent}, expected " \
                                  f"{want.dtype} {list(want.shape)}"
    got = {name: state[name].to(device) for name in written}

    def differs(name, want) -> torch.Tensor:
        """[B]: whether any element of sequence n's field `name` differs from `want` (a tensor like it, or a value)."""
        return (got[name] != want).flatten(1).any(-1)

    due = (count == defn.const_axes[op.DUE_EVERY]).flatten(1).all(-1).to(device)
    recounted = differs("count", written["count"])
    if recounted.any():
        return INCORRECT_NUMERICAL, f"sequence {int(recounted.nonzero()[0])}: its counter changed (it stays as the " \
                                    "caller wrote it)"
    for name in (*op.CHECKPOINT, *op.WINDOW):
        changed = differs(name, written[name]) & ~due
        if changed.any():
            return INCORRECT_NUMERICAL, f"sequence {int(changed.nonzero()[0])} (not due): its {name} changed"
    for name, value in op.WINDOW_RESET.items():
        kept = differs(name, value) & due
        if kept.any():
            return INCORRECT_NUMERICAL, f"sequence {int(kept.nonzero()[0])} (due): its {name} is not reset to {value:g}"
    if not due.any():
        return PASSED, ""
    batched, _ = program_layout(defn)
    inputs = {name: (t[due] if name in batched else t) for name, t in x.items()}
    verdict = op.judge(inputs, tuple(got[name][due] for name in op.CHECKPOINT), defn.reference_run()(**inputs),
                       defn.reference)
    if not verdict.passed:
        return INCORRECT_NUMERICAL, f"due checkpoints: {verdict.reason}"
    return PASSED, ""


def _latency(value, wanted: bool, least: float = 0.0) -> bool:
    """A reply's latency is what was asked: None when not wanted, else a finite number >= least."""
    if not wanted:
        return value is None
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= least


def run_case(worker: Worker, defn, op, x: dict, counts, n_calls: int, warmup: int,
             in_graph: bool) -> tuple[str, str, float | None, float | None]:
    """One case in the solution's worker (harness.deploy.run_case): n_calls calls, call k with fill counters
    counts(k) [B], timed on a GPU (the first `warmup` not counted); then the state the last call left judged
    (check_state). Returns (status, log,
    median ms, and with `in_graph` the call's marginal cost in ms in a graph of several steps); the latencies are
    None on the CPU or when the worker failed."""
    batched, n_prefix = program_layout(defn)
    programs = x[batched[0]].shape[:n_prefix]       # the fill counters' shape: [B, ...], one per program
    B, per_sequence = programs[0], (1,) * (n_prefix - 1)
    count, slots = schedule(counts, B, n_calls)
    header = {"op": "deploy_case", "in_graph": in_graph, "warmup": warmup}
    tensors = {**x, "count": count.view(n_calls, B, *per_sequence).expand(n_calls, *programs).contiguous(),
               "slots": slots}
    # the state it returns is the pool the case ran on: at most the inputs' bytes (twice, for a wrong dtype)
    state_bytes = 2 * sum(t.numel() * t.element_size() for t in x.values()) + wire.MAX_PADDING
    status, reply, state = worker.request(header, tensors, "running a deployment case", state_bytes)
    if status != "ok":
        return status, reply, None, None
    timed = x[batched[0]].device.type == "cuda"
    median, marginal = reply.get("median_ms"), reply.get("marginal_ms")
    if not _latency(median, timed) or not _latency(marginal, timed and in_graph, -math.inf):
        return RUNTIME_ERROR, "malformed reply: no valid latency", None, None
    status, log = check_state(defn, op, x, count[-1].view(B, *per_sequence).expand(*programs), state)
    return status, log, median, marginal


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = cli.description(__doc__)
    p.epilog = cli.epilog("a case failed its check, or the solution's worker failed", families=True)
    cli.add_solution(p, help="solution folder name under solutions/ (its sources list pool.py)")
    cli.add_batch_sizes(p, default=(64, 256, 512),
                        help="comma-separated batch sizes of the all-due cases; the largest also gives the pool of "
                             "the 1-in-16 and none-due cases (default: 64,256,512)")
    cli.add_family(p, "random")
    cli.add_definition(p)
    cli.add_device(p, "cuda", help="cuda: timed, the record written; cpu: each case one untimed call, judged, "
                                   "nothing written; auto: cuda when torch sees a GPU, else cpu")
    cli.add_timeout(p, help="seconds per request to the worker (a case, compilation and capture included)")
    cli.add_traces(p, help="root of the output (default: the project's traces/)")


def main(argv=None) -> int:
    return execute(cli.parse(add_arguments, "python -m harness.deploy_bench", argv))


def execute(args: argparse.Namespace) -> int:
    try:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise HarnessError("the deployment benchmark needs a GPU: torch sees none (--device cpu judges untimed)")
        device = cli.resolve_device(args.device, "one untimed call a case, judged")
        project = cli.project_of(args)
        settings = cli.settings_of(args, load_competition(project))
        defn = project_definition(project, args.definition)
        op = load_op(defn.op_type)
        sol = load_solution(args.solution, defn, project.solutions)
        if deploy.DEPLOYMENT_SOURCE not in sol.sources:
            raise HarnessError(f"{sol.name}: no {deploy.DEPLOYMENT_SOURCE} among its sources (its deployment form)")
        workloads = {w.axes["batch_size"]: w for w in select(load_workloads(defn, project.workload_file(defn)),
                                                             args.batch_sizes, [args.family])}
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    worker = Worker(sol, defn, device, settings.timeout_s, hide=[project.root])
    try:
        return _bench(worker, defn, op, workloads, args, device, project, settings)
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        worker.close()


def _bench(worker: Worker, defn, op, workloads: dict, args: argparse.Namespace, device: str, project,
           settings: Settings) -> int:
    timed = device == "cuda"
    if worker.isolation != "bwrap":
        print(f"WARNING: the solution runs {worker.isolation}; the record says so", flush=True)
    per_program = program_bytes(defn, op)
    bandwidth = (settings.bandwidth or timing.copy_bandwidth("cuda")) if timed else None
    replays = settings.replay_warmup + settings.replay_calls
    print(f"{worker.sol.name}: deployment form, {args.family} inputs, "
          + (f"copy rate {bandwidth / 1e12:.2f} TB/s, {per_program} bytes a flushed program (window reset included)"
             if timed else "on the CPU: one untimed call a case, judged"), flush=True)
    full = defn.const_axes[op.DUE_EVERY]   # a sequence is due every `full` decode steps
    largest = max(args.batch_sizes)
    batched, n_prefix = program_layout(defn)
    cases = [("all due", b, lambda k, b=b: torch.full((b,), full)) for b in sorted(args.batch_sizes)]
    cases += [(f"1 in {full} due", largest, lambda k: full - (torch.arange(largest) + k) % full),
              ("none due", largest, lambda k: 1 + (torch.arange(largest) + k) % (full - 1))]
    empty_us = None
    if timed:
        status, reply, _ = worker.request({"op": "deploy_empty", "calls": replays, "warmup": settings.replay_warmup},
                                          None, "timing an empty graph", 0)
        if status != "ok" or not _latency(reply.get("empty_graph_us"), True):
            print(f"  empty kernel: {status if status != 'ok' else RUNTIME_ERROR}: "
                  f"{reply if status != 'ok' else 'malformed reply: no valid latency'}", flush=True)
            return 1
        empty_us = reply["empty_graph_us"]
        print(f"  {'empty kernel':>12}      : {empty_us:9.1f} us  (this timer's floor: one graph of an empty kernel)",
              flush=True)
    rows, passed = [], True
    for case, b, counts in cases:
        x = load_inputs(defn, workloads[b], device, root=project.root)
        due_programs = int((counts(0) == full).sum()) * math.prod(x[batched[0]].shape[1:n_prefix])
        status, log, median_ms, marginal_ms = run_case(worker, defn, op, x, counts, replays if timed else 1,
                                                       settings.replay_warmup, in_graph=timed and not due_programs)
        del x
        passed &= status == PASSED
        verdict = status if status == PASSED else f"{status}: {log}"
        if timed and median_ms is None:
            print(f"  {case:>12} B={b:4d}: {verdict}; no record written", flush=True)
            return 1
        if not timed:
            print(f"  {case:>12} B={b:4d}: one call, untimed: {verdict}", flush=True)
            continue
        floor = due_programs * per_program / bandwidth * 1e3 if due_programs else None
        if floor and median_ms < timing.IMPOSSIBLE_FRACTION * floor:
            status, log = RUNTIME_ERROR, (f"median {median_ms * 1e3:.1f} us is below {timing.IMPOSSIBLE_FRACTION}x "
                                          f"the memory floor {floor * 1e3:.1f} us: physically impossible")
            passed, verdict = False, f"{status}: {log}"
        row = {"case": case, "batch_size": b, "due_programs": due_programs,
               "median_us": median_ms * 1e3, "floor_us": floor * 1e3 if floor else None,
               "x_floor": median_ms / floor if floor else None, "checked": status == PASSED, "status": status,
               "log": log}
        if not due_programs:
            row["target_us"] = NONE_DUE_TARGET_US
        rows.append(row)
        print(f"  {case:>12} B={b:4d}: {row['median_us']:9.1f} us"
              + (f"  floor {row['floor_us']:.1f} us  x{row['x_floor']:.2f}" if floor else
                 f"  (target <= {NONE_DUE_TARGET_US} us)")
              + ("" if status == PASSED else f"  {verdict}"), flush=True)
        if marginal_ms is not None:
            rows.append({**row, "case": f"{case}, per call in a graph of {deploy.GRAPH_STEPS}",
                         "median_us": marginal_ms * 1e3})
            print(f"  {case:>12} B={b:4d}: {marginal_ms * 1e3:9.1f} us  per call inside a graph of "
                  f"{deploy.GRAPH_STEPS} L2-cold steps (the graph's launch and events not counted)", flush=True)
        torch.cuda.empty_cache()
    if not timed:
        return 0 if passed else 1
    record = DeployRecord(definition=defn.name, solution=worker.sol.name, solution_sha256=worker.sha256,
                          sandbox=worker.isolation, environment=traces.environment("cuda"), family=args.family,
                          copy_bandwidth=bandwidth, bytes_per_program=per_program, timed_calls=settings.replay_calls,
                          empty_graph_us=empty_us, rows=rows)
    path = Path(args.traces or project.traces) / defn.name / f"deploy_{worker.sol.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, json.dumps(record.to_json(), indent=1) + "\n")
    print(f"wrote {path}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
