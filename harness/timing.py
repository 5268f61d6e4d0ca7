"""The one timer: kernel time on the GPU timeline, L2-cold, on inputs that change before every call.

Each call is a CUDA-graph replay (captured once per input set after warm-up) between two CUDA events on the
replay stream, so work the solution forks onto other streams and joins is inside the graph and counted, and work
it leaves outside (a side stream it never joins, a host synchronisation) breaks the capture: such a solution is
refused with `NotCapturable`, as serving engines replay the flush inside a graph too.

Before every timed call, outside the timed region: the input set about to be used is refilled in place with a
fresh permutation of the workload's programs (so no output can be replayed from an earlier call), its output
buffers are poisoned (NaN; -128 for integers) and the L2 is flushed by a write twice its size. The outputs of every
timed call are sampled for the judge, and the last call's outputs are returned whole.

Trust: the judge runs in the parent process, out of the solution's reach, and so does the schedule (which programs
each call sees and which are sampled). The timer itself has to run where the graph is captured, in the solution's
worker process (a CUDA graph cannot be replayed from another process, and interprocess CUDA events carry no
timing); `guard()` records the functions it relies on before the solution is imported and `tampered()` reports any
the solution replaced, which the runner turns into a RUNTIME_ERROR.
"""
from __future__ import annotations

import statistics
import sys
import time  # noqa: F401 - loaded for the guard's time.perf_counter
from dataclasses import dataclass
from typing import Callable

import torch

WARMUP_CALLS = 5
TIMED_CALLS = 50
INPUT_SETS = 4
SAMPLED_PROGRAMS = 16
IMPOSSIBLE_FRACTION = 0.9       # a median below this fraction of the memory floor cannot be real

_GUARDED = ("torch.cuda.Event", "torch.cuda.Event.record", "torch.cuda.Event.elapsed_time", "torch.cuda.CUDAGraph",
            "torch.cuda.CUDAGraph.replay", "torch.cuda.graph", "torch.cuda.synchronize", "time.perf_counter",
            "torch.Tensor.index_select", "torch.Tensor.copy_", "harness.timing.time_calls",
            "harness.timing.capture", "harness.timing.time_replays", "harness.timing.permuted",
            "harness.timing.tampered")
_originals: dict[str, object] = {}


def _resolve(path: str):
    """The object at a dotted path, through the longest prefix that is a loaded module (None if gone)."""
    parts = path.split(".")
    i = next(i for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in sys.modules)
    obj = sys.modules[".".join(parts[:i])]
    for name in parts[i:]:
        obj = getattr(obj, name, None)
    return obj


def guard() -> None:
    """Remember the timing functions as they are before any solution code runs."""
    _originals.update({path: _resolve(path) for path in _GUARDED})


def tampered() -> str | None:
    """The name of a guarded function the solution replaced, if any."""
    for path, original in _originals.items():
        if _resolve(path) is not original:
            return path
    return None


class NotCapturable(Exception):
    pass


@dataclass
class Timing:
    latencies_ms: list[float]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.latencies_ms)


def permuted(base: dict, batched: tuple[str, ...], n_prefix: int, perm: torch.Tensor, into: dict) -> None:
    """into[name] <- base[name] with its first n_prefix dims (the programs) permuted by perm, in place."""
    for name in batched:
        src, dst = base[name], into[name]
        flat_src = src.reshape(-1, *src.shape[n_prefix:])
        dst.view(-1, *dst.shape[n_prefix:]).copy_(flat_src.index_select(0, perm))


def poison(outputs) -> None:
    """Fill output buffers with values no correct flush writes (NaN; the type's minimum for integers), so an output
    left unwritten cannot pass for a result."""
    for t in outputs:
        t.fill_(float("nan") if t.is_floating_point() else (torch.iinfo(t.dtype).min if t.dtype != torch.bool else 0))


def schedule(n_programs: int, seed: int, timed_calls: int = TIMED_CALLS):
    """The program permutation of every call (warm-up first) and the programs sampled from each timed call. Drawn
    by the parent, which judges with its own copy: the solution's process cannot choose what it is checked on."""
    gen = torch.Generator().manual_seed(seed)
    perms = [torch.randperm(n_programs, generator=gen) for _ in range(WARMUP_CALLS + timed_calls)]
    samples = [torch.randint(n_programs, (SAMPLED_PROGRAMS,), generator=gen) for _ in range(timed_calls)]
    return perms, samples


def capture(call: Callable, stream) -> tuple:
    """call() captured in a CUDA graph on `stream` (warm it up first: compilation, caches, allocator); returns the
    graph and what the call returned. NotCapturable when the call's launch pattern cannot be captured."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=stream):
            out = call()
    except Exception as e:  # noqa: BLE001 - the solution's launch pattern, reported as its error
        raise NotCapturable(f"not CUDA-graph capturable ({type(e).__name__}: {' '.join(str(e).split())[:160]});"
                            " launch on the current stream, join side streams, no host synchronisation") from None
    return graph, out


def l2_flush_buffer(device) -> torch.Tensor:
    """Scratch whose fill evicts the whole L2: twice its size, at least 128 MB."""
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return torch.empty(max(2 * l2, 1 << 27), dtype=torch.uint8, device=device)


def time_replays(prepare: Callable, n_calls: int, stream, after: Callable | None = None) -> list[float]:
    """Latency (ms) of n_calls CUDA-graph replays, each between two CUDA events on `stream`, L2-cold. Before call k,
    outside the timed region: `prepare(k)` readies (refills, poisons) the inputs on `stream` and returns the graph
    to replay, then the L2 is flushed by a write twice its size; `after(k)`, if given, runs after the replay (e.g.
    to sample its outputs). Synchronises once at the end."""
    device = stream.device
    scratch = l2_flush_buffer(device)
    events = []
    with torch.cuda.stream(stream):
        for k in range(n_calls):
            graph = prepare(k)
            scratch.fill_(k & 0xFF)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            graph.replay()
            end.record(stream)
            events.append((start, end))
            if after is not None:
                after(k)
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) for s, e in events]


def time_calls(call: Callable, base: dict, axes: dict, batched: tuple[str, ...], n_prefix: int,
               perms: list[torch.Tensor], samples: list[torch.Tensor]) -> tuple[Timing, list, tuple]:
    """Time `call(inputs, axes)` on the GPU, call k on base permuted by perms[k]. Returns the timing, the sampled
    outputs of every timed call (programs samples[j] of call WARMUP_CALLS + j) and the last call's outputs."""
    device = next(iter(base.values())).device
    sets = [{k: v.clone() for k, v in base.items()} for _ in range(INPUT_SETS)]
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graphs, outputs = [], []
    with torch.cuda.stream(stream):
        for s in sets:
            for _ in range(2):
                call(s, axes)               # warm-up: compilation, autotuning caches, allocator
        torch.cuda.synchronize(device)
        for s in sets:
            graph, out = capture(lambda: call(s, axes), stream)
            graphs.append(graph)
            outputs.append(out)

    def prepare(k):
        i = k % INPUT_SETS
        permuted(base, batched, n_prefix, perms[k].to(device), sets[i])
        poison(outputs[i])
        return graphs[i]

    sampled = []

    def sample(k):
        if k >= WARMUP_CALLS:
            chosen = samples[k - WARMUP_CALLS].to(device)
            sampled.append(tuple(t.reshape(-1, *t.shape[n_prefix:]).index_select(0, chosen).clone()
                                 for t in outputs[k % INPUT_SETS]))

    latencies = time_replays(prepare, len(perms), stream, after=sample)[WARMUP_CALLS:]
    last = tuple(t.clone() for t in outputs[(len(perms) - 1) % INPUT_SETS])
    torch.cuda.synchronize(device)
    return Timing(latencies), sampled, last


def copy_bandwidth(device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written (the memory floor's ceiling):
    the fastest of the repeats, since anything else on the GPU or a clock still ramping up can only slow a copy."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / min(times)
