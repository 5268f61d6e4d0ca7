"""The one timer: kernel time on the GPU timeline, L2-cold, on fresh inputs, checked against the harness's own clock.

Where each piece runs, and why a solution cannot bend the figure:

- In the solution's worker (the only place its CUDA graph can be replayed; it is untrusted, since the solution
  shares the process): `TimedLoop`. Warm-up and capture happen first, on the workload's committed inputs, into
  INPUT_SETS input sets with one graph each. Then the harness sends a *pool* of fresh programs (drawn by the harness
  from a seed that exists only in this run) and, last, the seed of the *schedule*: for every timed call and every
  independent part of a program (here the checkpoint and the window), which pool programs it takes. Call k refills its input set
  from the pool by that schedule, poisons the outputs (NaN; the minimum for integers), flushes the L2 with a write
  twice its size, replays the graph between two CUDA events and copies the outputs aside. So every timed call runs
  on programs that did not exist before its schedule arrived: nothing can be looked up or computed ahead.
- In the harness (trusted): the schedule, drawn only after the pool is in place; the judge, which checks the
  outputs of *every* timed call in full; and a wall clock around the whole timed loop, from sending the schedule to
  receiving the reply. The same loop is run by the harness's own null worker (a solution that does nothing) to
  measure the loop's overhead. Whatever the solution's process does to produce correct outputs (inside the events,
  outside them, in a hook it patched) falls between sending and reply, so the wall time less the null loop's bounds
  the time it really spent; reported event times that sum to less than that (by more than CLOCK_TOLERANCE), or whose
  median sits below the bulk of their own distribution, are refused.

A solution must therefore be CUDA-graph capturable (no host synchronisation, side streams joined), as it must be
inside a serving engine; one that is not is refused with `NotCapturable`.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from typing import Callable

import torch

INPUT_SETS = 4
WARMUP_REPLAYS = 3              # untimed replays of each graph before the timed loop
MIN_CALLS, MAX_CALLS = 20, 50   # timed calls per workload: enough programs for a steady median, outputs judged all
TIMED_PROGRAMS = 1 << 17
POOL_PROGRAMS = 2048            # the fewest programs a pool holds: small batches draw from a larger fresh pool
CLOCK_TOLERANCE = 0.10          # reported kernel time may fall this far below what the harness's clock allows
IMPOSSIBLE_FRACTION = 0.9       # a median below this fraction of the memory floor cannot be real


class NotCapturable(Exception):
    pass


def timed_calls(n_programs: int) -> int:
    return min(MAX_CALLS, max(MIN_CALLS, math.ceil(TIMED_PROGRAMS / n_programs)))


def schedule(n_calls: int, n_parts: int, n_programs: int, pool_programs: int, seed: int,
             device="cpu") -> torch.Tensor:
    """int64 [n_calls, n_parts, n_programs] on `device`: for call k and part g, the pool program each program slot
    takes, without repeats within a call and part. A pure function of its arguments on one device and torch build,
    so that the harness sends only the seed into the timed region and judges with its own copy."""
    gen = torch.Generator(device=device).manual_seed(seed)
    keys = torch.rand(n_calls, n_parts, pool_programs, generator=gen, device=device)
    return torch.argsort(keys, dim=-1, stable=True)[..., :n_programs]


def poison(outputs) -> None:
    """Fill output buffers with values no correct flush writes (NaN; the type's minimum for integers), so an output
    left unwritten cannot pass for a result."""
    for t in outputs:
        t.fill_(float("nan") if t.is_floating_point() else (torch.iinfo(t.dtype).min if t.dtype != torch.bool else 0))


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


def _flat(t: torch.Tensor, n_prefix: int) -> torch.Tensor:
    return t.view(-1, *t.shape[n_prefix:])


class TimedLoop:
    """The worker's half of a timed measurement (see the module docstring): `prepare` on the warm-up inputs, then
    `load_pool`, `run(schedule)` and `outputs(first, count)`."""

    def __init__(self, call: Callable, warm: dict, axes: dict, parts: list[list[str]], n_prefix: int, n_calls: int):
        self.device = next(iter(warm.values())).device
        self.parts, self.n_prefix, self.n_calls = parts, n_prefix, n_calls
        self.stream = torch.cuda.Stream(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.sets = [{k: v.clone() for k, v in warm.items()} for _ in range(INPUT_SETS)]
        self.graphs, self.outputs = [], []
        with torch.cuda.stream(self.stream):
            for s in self.sets:
                for _ in range(2):
                    call(s, axes)               # warm-up: compilation, autotuning caches, allocator
            torch.cuda.synchronize(self.device)
            for s in self.sets:
                graph, out = capture(lambda: call(s, axes), self.stream)
                self.graphs.append(graph)
                self.outputs.append(tuple(out))
            for graph in self.graphs:
                for _ in range(WARMUP_REPLAYS):
                    graph.replay()
        for out in self.outputs:
            if any(not isinstance(t, torch.Tensor) or t.device != self.device for t in out):
                raise TypeError("the captured call returned something other than tensors on the inputs' device")
        self.slots = [tuple(torch.empty_like(t) for t in self.outputs[0]) for _ in range(n_calls)]
        self.scratch = l2_flush_buffer(self.device)
        torch.cuda.synchronize(self.device)

    def load_pool(self, pool: dict) -> None:
        """Take the pool of fresh programs, capture each call's preparation as a graph of its own (so that the loop
        launches four things a call and the GPU, not the host, sets its pace) and run the loop once, untimed, so
        that every kernel it uses is loaded before the clock starts."""
        batched = {name for part in self.parts for name in part}
        self.pool = {k: (_flat(v, self.n_prefix) if k in batched else v).to(self.device) for k, v in pool.items()}
        for s in self.sets:
            for name in s.keys() - batched:
                s[name].copy_(self.pool[name])
        n_programs = _flat(self.sets[0][self.parts[0][0]], self.n_prefix).shape[0]
        pool_programs = self.pool[self.parts[0][0]].shape[0]
        self.index = torch.zeros(self.n_calls, len(self.parts), n_programs, dtype=torch.int64, device=self.device)
        with torch.cuda.stream(self.stream):
            self.prepares = [capture(lambda: self._prepare(k), self.stream)[0] for k in range(self.n_calls)]
            self.finish = capture(lambda: self._copy_out(self.n_calls - 1), self.stream)[0]
        self.pool_programs = pool_programs
        self.run(int.from_bytes(os.urandom(7), "little"))
        torch.cuda.synchronize(self.device)

    def _prepare(self, k: int) -> None:
        """Before call k: keep call k - 1's outputs, refill call k's input set from the pool by index[k], poison its
        outputs and flush the L2."""
        if k:
            self._copy_out(k - 1)
        i = k % INPUT_SETS
        for g, names in enumerate(self.parts):
            for name in names:
                torch.index_select(self.pool[name], 0, self.index[k, g], out=_flat(self.sets[i][name], self.n_prefix))
        poison(self.outputs[i])
        self.scratch.fill_(k & 0xFF)

    def _copy_out(self, k: int) -> None:
        for dst, src in zip(self.slots[k], self.outputs[k % INPUT_SETS]):
            dst.copy_(src)

    def run(self, seed: int) -> list[float]:
        """Latency (ms) of each timed call; call k's part g takes the pool programs schedule(..., seed)[k, g]."""
        events = []
        t0 = time.perf_counter()
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            self.index.copy_(schedule(*self.index.shape, self.pool_programs, seed, self.device))
            first.record(self.stream)
            for k in range(self.n_calls):
                self.prepares[k].replay()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
                self.graphs[k % INPUT_SETS].replay()
                end.record(self.stream)
                events.append((start, end))
            self.finish.replay()
            last.record(self.stream)
        torch.cuda.synchronize(self.device)
        self.loop_ms = ((time.perf_counter() - t0) * 1e3, first.elapsed_time(last))
        return [s.elapsed_time(e) for s, e in events]

    def outputs_of(self, first: int, count: int) -> tuple:
        """The outputs of calls first .. first + count - 1, concatenated along the program axes' first dim."""
        return tuple(torch.cat([self.slots[k][j] for k in range(first, first + count)])
                     for j in range(len(self.slots[0])))


def clock_disagreement(latencies_ms: list[float], wall_ms: float, null_wall_ms: float) -> str | None:
    """Why the worker's event times cannot be what its loop took (None when they can): their sum below what the
    harness's clock measured beyond the null loop, or their median below the bulk of their own distribution."""
    n = len(latencies_ms)
    spent = wall_ms - null_wall_ms
    reported = sum(latencies_ms)
    if reported < (1 - CLOCK_TOLERANCE) * spent:
        return (f"the timed calls report {reported / n * 1e3:.1f} us each, the harness's clock {spent / n * 1e3:.1f} "
                f"us (loop {wall_ms:.2f} ms, null loop {null_wall_ms:.2f} ms): work done outside the timed region")
    bulk = sorted(latencies_ms)[:max(1, math.ceil(0.9 * n))]
    median = statistics.median(latencies_ms)
    if median < (1 - CLOCK_TOLERANCE) * statistics.fmean(bulk):
        return f"median {median * 1e3:.1f} us is below the mean of 90% of the calls {statistics.fmean(bulk) * 1e3:.1f} us"
    return None


def gpu_processes(device) -> list[int] | None:
    """PIDs of other processes holding a context on the GPU (NVML), leaving out this one and its descendants (its
    workers); None when NVML cannot tell."""
    try:
        import pynvml
        pynvml.nvmlInit()
        index = torch.device(device).index or 0
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        pids = {p.pid for p in pynvml.nvmlDeviceGetComputeProcesses(handle)}
        pids |= {p.pid for p in pynvml.nvmlDeviceGetGraphicsProcesses(handle)}
    except Exception:  # noqa: BLE001 - no NVML library or no permission: unknown, and said so by the caller
        return None
    return sorted(pids - _own_processes())


def _own_processes() -> set[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    own, grew = {os.getpid()}, True
    while grew:
        more = {pid for pid, ppid in parents.items() if ppid in own} - own
        own |= more
        grew = bool(more)
    return own


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
