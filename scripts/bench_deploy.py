"""python scripts/bench_deploy.py --solution NAME [--batch-sizes 64,256,512] [--family random] [--traces DIR]: time a
solution's deployment form on the GPU and write traces/<definition>/deploy_<NAME>.json (rendered in LEADERBOARD.md
by `python -m harness.report`). Exits 1 when a case fails its check (below), 2 on bad input.

The deployment form is the solution's `pool.py::flush_inplace(pool, idx, q0)` on the operator's `Pool`
(harness/ops/leapquant_kda_flush.py, OPERATOR.md "Deployment form": one flat buffer in the published engine
layout, the dense window and the fill counter `count`). Cases, each one CUDA graph of one call on a pool of
B + 1 slots filled with a workload's inputs (family `--family`), timed by
harness.timing (graph replays between CUDA events, L2 flushed before each, median of REPLAY_CALLS after warm-up):
every program due at each batch size; the steady state at the largest, one sequence in 16 due (a different 16th
each call, as when every sequence flushes every 16 tokens); none due at the largest, against a 5 us target, both as
a graph of its own and as its marginal cost in a graph of several L2-cold steps, as a serving engine's decode graph
holds it; and, for scale, one graph of an empty kernel timed the same way (the timer's floor). Before
every call, outside the timed region, the pool is refilled with the inputs under a fresh assignment of sequences to
slots (idx), so nothing can be reused. The floor counts every byte the flushed programs read and write once, window
reset included, at the measured copy rate. After the last call of each case the due checkpoints must equal `run`'s
on the same inputs bit for bit, with their windows reset, and every other checkpoint and window must be as refilled
("checked" in the output)."""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import HarnessError, timing, traces  # noqa: E402
from harness.definition import find_definition  # noqa: E402
from harness.ops import load_op  # noqa: E402
from harness.run import DEFAULT_DEFINITION, _csv  # noqa: E402
from harness.runner import program_layout  # noqa: E402
from harness.solutions import load_entry, load_module, load_solution, source_sha256  # noqa: E402
from harness.workloads import load_inputs, load_workloads, select  # noqa: E402

DEPLOYMENT_SOURCE = "pool.py"
NONE_DUE_TARGET_US = 5.0
GRAPH_STEPS = 8          # steps of the graph that measures a none-due call's marginal cost
SEED = 20261204


def program_bytes(defn, op) -> int:
    """Bytes one flushed program reads and writes once: its part of every batched input and of every output, and
    the window reset it writes (OPERATOR.md: 51,776 + 4,672)."""
    batched, n_prefix = program_layout(defn)
    axes = defn.resolve_axes({"batch_size": 1})
    specs = [defn.inputs[n] for n in (*batched, *op.WINDOW_RESET)] + list(defn.outputs.values())
    return sum(math.prod(defn.shape(s, axes)[n_prefix:]) * s.torch_dtype.itemsize for s in specs)


def warm_graph(call, stream):
    """call() run once on `stream` (compilation, caches, allocator), then captured in a CUDA graph there."""
    with torch.cuda.stream(stream):
        call()
    torch.cuda.synchronize(stream.device)
    return timing.capture(call, stream)[0]


def median_ms(prepare, stream) -> float:
    """Median latency (ms) of the timed replays of the graphs prepare(k) returns (harness.timing, after warm-up)."""
    latencies = timing.time_replays(prepare, timing.REPLAY_WARMUP + timing.REPLAY_CALLS, stream)
    return statistics.median(latencies[timing.REPLAY_WARMUP:])


def marginal_in_graph_ms(call, stream, steps: int = GRAPH_STEPS) -> float:
    """What `call` adds, per call, to a CUDA graph of `steps` L2-cold steps (each an L2 flush, then the call): the
    graph's median replay time less that of the same graph without the calls, over `steps`. A serving engine's
    decode step is such a graph, so this is the call's cost there, without a graph launch and two events of its
    own. Only for calls that leave their inputs as they were (none due): the steps repeat them unchanged."""
    scratch = timing.l2_flush_buffer(stream.device)

    def steps_of(with_call: bool):
        def body():
            for i in range(steps):
                scratch.fill_(i)
                if with_call:
                    call()
        return body

    with_calls, without = (warm_graph(steps_of(c), stream) for c in (True, False))
    return (median_ms(lambda k: with_calls, stream) - median_ms(lambda k: without, stream)) / steps


def time_case(pool_mod, run, op, x: dict, axes: dict, counts, stream,
              in_graph: bool = False) -> tuple[float, bool, float | None]:
    """Median latency (ms) of flush_inplace on a pool of B + 1 slots holding the inputs x, the counters of call k's
    sequences counts(k) [B] (due: a full window); whether after the last call the due sequences' checkpoints
    equal run's on x bit for bit and their windows are reset, the others' unchanged; and with `in_graph`, the
    call's marginal cost in a graph of several steps on the pool as the last call left it (None otherwise)."""
    full = axes["window"]
    B, H = x["codes"].shape[:2]
    device = x["codes"].device
    pool = op.Pool(B + 1, device)
    idx = torch.empty(B, dtype=torch.int32, device=device)
    q0 = x["q0"].clone()
    fields = {k: v for k, v in x.items() if k != "q0"}
    gen = torch.Generator().manual_seed(SEED)
    last = {}

    def prepare(k):
        slots = (torch.randperm(B, generator=gen) + 1).to(device)
        due = counts(k).to(device)
        pool.write(slots, **fields, count=due[:, None].expand(B, H).to(torch.int32))
        idx.copy_(slots)
        last.update(slots=slots, due=due == full)
        return graph

    graph = None
    with torch.cuda.stream(stream):
        prepare(0)
    graph = warm_graph(lambda: pool_mod.flush_inplace(pool, idx, q0), stream)
    median = median_ms(prepare, stream)
    flushed = dict(zip(op.CHECKPOINT, run(x, axes)))
    flushed.update({name: torch.full_like(x[name], value) for name, value in op.WINDOW_RESET.items()})
    same = True
    for name, after in flushed.items():
        due = last["due"].reshape(-1, *[1] * (after.dim() - 1))
        same &= torch.equal(getattr(pool, name)[last["slots"]], torch.where(due, after, x[name]))
    marginal = marginal_in_graph_ms(lambda: pool_mod.flush_inplace(pool, idx, q0), stream) if in_graph else None
    return median, same, marginal


def empty_graph_us(stream) -> float:
    """Median latency (us) of a CUDA graph holding one empty kernel, timed as the cases are: what this timer reads
    for no work at all (graph launch, events, the kernel's launch), the context of the none-due target."""
    graph = warm_graph(lambda: torch.cuda._sleep(0), stream)
    return median_ms(lambda k: graph, stream) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/bench_deploy.py", description=__doc__.split(":")[0])
    p.add_argument("--solution", required=True)
    p.add_argument("--batch-sizes", type=_csv(int), default=(64, 256, 512))
    p.add_argument("--family", default="random")
    p.add_argument("--definition", default=DEFAULT_DEFINITION)
    p.add_argument("--traces", default=str(traces.TRACES), help="root of the output (default: %(default)s)")
    args = p.parse_args(argv)
    try:
        if not torch.cuda.is_available():
            raise HarnessError("the deployment benchmark needs a GPU: torch sees none")
        defn = find_definition(args.definition)
        op = load_op(defn.op_type)
        sol = load_solution(args.solution, defn)
        pool_mod = load_module(sol, DEPLOYMENT_SOURCE)
        run = load_entry(sol, defn)
        workloads = {w.axes["batch_size"]: w for w in select(load_workloads(defn), args.batch_sizes, [args.family])}
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    bandwidth = timing.copy_bandwidth("cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    largest = max(args.batch_sizes)
    per_program = program_bytes(defn, op)
    print(f"{sol.name}: deployment form, {args.family} inputs, copy rate {bandwidth / 1e12:.2f} TB/s, "
          f"{per_program} bytes a flushed program (window reset included)", flush=True)
    full = defn.const_axes["window"]       # a sequence is due every `full` decode steps
    cases = [("all due", b, lambda k, b=b: torch.full((b,), full)) for b in sorted(args.batch_sizes)]
    cases += [(f"1 in {full} due", largest, lambda k: full - (torch.arange(largest) + k) % full),
              ("none due", largest, lambda k: 1 + (torch.arange(largest) + k) % (full - 1))]
    empty_us = empty_graph_us(stream)
    print(f"  {'empty kernel':>12}      : {empty_us:9.1f} us  (this timer's floor: one graph of an empty kernel)",
          flush=True)
    rows, all_same = [], True
    for case, b, counts in cases:
        axes = defn.resolve_axes({"batch_size": b})
        x = load_inputs(defn, workloads[b], "cuda")
        due_programs = int((counts(0) == full).sum()) * defn.const_axes["num_heads"]
        median_ms, same, marginal_ms = time_case(pool_mod, run, op, x, axes, counts, stream,
                                                 in_graph=not due_programs)
        floor = due_programs * per_program / bandwidth * 1e3 if due_programs else None
        row = {"case": case, "batch_size": b, "due_programs": due_programs,
               "median_us": median_ms * 1e3, "floor_us": floor * 1e3 if floor else None,
               "x_floor": median_ms / floor if floor else None, "checked": same}
        if not due_programs:
            row["target_us"] = NONE_DUE_TARGET_US
        rows.append(row)
        all_same &= same
        print(f"  {case:>12} B={b:4d}: {row['median_us']:9.1f} us"
              + (f"  floor {row['floor_us']:.1f} us  x{row['x_floor']:.2f}" if floor else
                 f"  (target <= {NONE_DUE_TARGET_US} us)")
              + ("" if same else "  WRONG: differs from run or from its inputs"), flush=True)
        if marginal_ms is not None:
            rows.append({"case": f"{case}, per call in a graph of {GRAPH_STEPS}", "batch_size": b, "due_programs": 0,
                         "median_us": marginal_ms * 1e3, "floor_us": None, "x_floor": None, "checked": same,
                         "target_us": NONE_DUE_TARGET_US})
            print(f"  {case:>12} B={b:4d}: {marginal_ms * 1e3:9.1f} us  per call inside a graph of {GRAPH_STEPS} "
                  "L2-cold steps (the graph's launch and events not counted)", flush=True)
        del x
        torch.cuda.empty_cache()
    record = {"definition": defn.name, "solution": sol.name, "solution_sha256": source_sha256(sol, defn),
              "environment": traces.environment("cuda"), "family": args.family, "copy_bandwidth": bandwidth,
              "bytes_per_program": per_program, "timed_calls": timing.REPLAY_CALLS, "empty_graph_us": empty_us,
              "rows": rows}
    path = Path(args.traces) / defn.name / f"deploy_{sol.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())
