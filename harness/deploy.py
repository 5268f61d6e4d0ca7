"""The deployment form inside a solution's worker (harness.worker's "deploy_case" and "deploy_empty" requests, sent by
harness/deploy_bench.py, `python -m harness deploy`): the solution's `pool.py::flush_inplace(pool, idx, *args)` on the
operator's `Pool` of B + 1 slots, timed with harness.timing's replay timer on a GPU (graph replays between CUDA events,
L2 flushed before each, median after warm-up), called untimed on the CPU. The harness sends the inputs and the
schedule (every call's slot assignment and fill counters) and judges the state the last call left; nothing here
decides what is correct."""
from __future__ import annotations

import statistics

import torch

from harness import timing

DEPLOYMENT_SOURCE = "pool.py"
GRAPH_STEPS = 8          # steps of the graph that measures a none-due call's marginal cost


def side_stream(device) -> torch.cuda.Stream:
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


def warm_graph(call, stream):
    """call() run once on `stream` (compilation, caches, allocator), then captured in a CUDA graph there."""
    with torch.cuda.stream(stream):
        call()
    torch.cuda.synchronize(stream.device)
    return timing.capture(call, stream)[0]


def median_ms(prepare, stream, n_calls: int, warmup: int) -> float:
    """Median latency (ms) of the timed replays of the graphs prepare(k) returns, k < n_calls (harness.timing; the
    first `warmup` are not counted)."""
    latencies = timing.time_replays(prepare, n_calls, stream)
    return statistics.median(latencies[warmup:])


def marginal_in_graph_ms(call, stream, n_calls: int, warmup: int, steps: int = GRAPH_STEPS) -> float:
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
    return (median_ms(lambda k: with_calls, stream, n_calls, warmup)
            - median_ms(lambda k: without, stream, n_calls, warmup)) / steps


def run_case(flush_inplace, op, inputs: dict, count: torch.Tensor, slots: torch.Tensor,
             in_graph: bool, warmup: int) -> tuple[float | None, float | None, dict]:
    """flush_inplace on a pool of B + 1 slots: before call k, outside the timed region, sequence n of `inputs`
    (batched [B, ...]; the op's POOL_CALL_ARGS, shared by all, are passed to the call) is written to slot slots[k, n]
    with fill counters count[k, n]. On a GPU
    every call is one replay of a graph of one call (len(slots) replays, the first `warmup` not counted), on the
    CPU a plain call. Returns the median latency (ms; None on the CPU); with `in_graph` (a GPU only), the call's
    marginal cost in a graph of several steps on the pool as the last call left it (None otherwise); and the state
    the last call left: every checkpoint and window field and the counters of its slots, in the order of the
    sequences."""
    device = next(iter(inputs.values())).device
    pool = op.Pool(slots.shape[1] + 1, device)
    slots = slots.long()
    idx = torch.empty(slots.shape[1], dtype=torch.int32, device=device)
    shared = [inputs[name].clone() for name in op.POOL_CALL_ARGS]
    fields = {k: v for k, v in inputs.items() if k not in op.POOL_CALL_ARGS}

    def prepare(k):
        pool.write(slots[k], **fields, count=count[k])
        idx.copy_(slots[k])
        return graph

    def call():
        flush_inplace(pool, idx, *shared)

    graph = median = marginal = None
    if device.type == "cuda":
        stream = side_stream(device)
        with torch.cuda.stream(stream):
            prepare(0)
        graph = warm_graph(call, stream)
        median = median_ms(prepare, stream, len(slots), warmup)
    else:
        for k in range(len(slots)):
            prepare(k)
            call()
    state = {name: getattr(pool, name)[slots[-1]] for name in (*op.CHECKPOINT, *op.WINDOW, "count")}
    if in_graph:
        marginal = marginal_in_graph_ms(call, stream, len(slots), warmup)
    return median, marginal, state


def empty_graph_us(device, n_calls: int, warmup: int) -> float:
    """Median latency (us) of a CUDA graph holding one empty kernel, timed as the cases are: what this timer reads
    for no work at all (graph launch, events, the kernel's launch), the context of the none-due target."""
    stream = side_stream(device)
    graph = warm_graph(lambda: torch.cuda._sleep(0), stream)
    return median_ms(lambda k: graph, stream, n_calls, warmup) * 1e3
