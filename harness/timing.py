"""The one timer: kernel time on the GPU timeline, L2-cold, on fresh inputs, checked against the harness's own clock.

Where each piece runs, and why a solution cannot bend the figure:

- In the solution's worker (the only place its CUDA graph can be replayed; untrusted, since the solution shares the
  process): `TimedLoop`. Warm-up and capture happen first, on the workload's committed inputs, into INPUT_SETS input
  sets with one graph each. Then the harness sends a *pool* of fresh programs (drawn from a seed that exists only in
  this run) and, last, only the seed of the *schedule* (`draw_calls`): which pool programs every timed program
  takes its parts from (in a family whose parts are drawn independently, the operator's INDEPENDENT_PARTS_FAMILIES,
  each of its PROGRAM_PARTS from a pool program of its own: for this operator the checkpoint from one, the window
  from another; in any other family all from one pool program, since parts drawn together can leave the domain when
  mixed), and under which of the operator's symmetries each part (for this operator a signed permutation of the
  value and of the key axis, exact in every dtype, which maps a part's share of the state S to D_v P_v S P_k D_k
  and changes every output; the parts' differ on the value axis, so even one program's parts meet in a relative
  position no pool program had, except where the operator's parts_movable says that would leave the domain). So no
  timed call holds a program that existed before its seed arrived: nothing can be looked up, and nothing that needs
  two parts computed ahead. Call k
  replays a captured preparation (keep call k - 1's outputs, refill the input set, poison the outputs with NaN or
  the integer minimum, flush the L2 with a write twice its size), then the solution's graph between two CUDA
  events.
- In the harness (trusted): the seeds; the memory every timed call's outputs are kept in (lent to the worker,
  harness.shared); the judge, which checks the outputs of *every* timed call in full; and a wall clock around the
  whole loop, from sending the seed to the reply and a first read of words of the outputs. The harness kills the
  worker as soon as the reply arrives and judges the outputs only once it is gone (the words read again then must
  not have changed), so the work that produced them happened inside the clock. The harness runs the same loop
  first in its own process with a null call (outputs written, no flush) to measure its overhead. Whatever the
  solution's process does to produce correct outputs (inside the events, outside them, in a hook it patched, all
  in the first call) falls inside the clock, so the wall time less the null loop's,
  plus the null call's own median, bounds the time per call; a median more than CLOCK_TOLERANCE below that bound is
  refused (`clock_disagreement`).

A solution must therefore be CUDA-graph capturable (no host synchronisation, side streams joined), as it must be
inside a serving engine; one that is not is refused with `NotCapturable`. On the CPU (tests only) the same loop runs
with plain calls for graphs and time.perf_counter for events.
"""
from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from typing import Callable

import torch

INPUT_SETS = 4
# every committed trace's honest loop clears these by 9 us a call or more (tests/test_timing.py checks them all)
CLOCK_TOLERANCE = 0.05          # the median may fall this far below the mean the harness's clock allows ...
CLOCK_SLACK_MS = 0.5            # ... after this much of the loop's wall time is set aside as noise
# ... and this much a call. Against the null loop in the harness's process (runner.Calibration), the committed
# honest loops need up to 20.3 us a call of it (cuda_v1, B = 2, H100; its loop runs 15-24 us a call longer than the
# null loop plus the difference of the calls at B <= 64, triton_v1 and the reference 12-20 us, torch_v1 -6 to +7 us:
# steady within a kernel, so a cost outside its events rather than noise; its cause is not measured), so 30 us
# leaves ~10 us a call above the largest; test_every_recorded_honest_loop_passes_the_clock_check holds it to them.
CLOCK_SLACK_PER_CALL_MS = 0.030
IMPOSSIBLE_FRACTION = 0.9       # a median below this fraction of the memory floor cannot be real


class NotCapturable(Exception):
    pass


def draw_calls(n_calls: int, n_programs: int, pool_programs: int, seed: int, op, axes: dict, device="cpu", *,
               mix_parts: bool) -> tuple[torch.Tensor, dict]:
    """What the timed calls run on, as a pure function of its arguments on one device and torch build (so that the
    harness sends only the seed into the timed region and judges with its own copy): int64 [n_calls, parts,
    n_programs], the pool program each of the operator's PROGRAM_PARTS of each program slot of call k takes (no
    repeats within a call and part; with mix_parts False every part of a slot takes the same one), and the
    parameters of the operator's symmetries (`draw_variants` / `apply_variant`), [n_calls, parts, ...]: one for
    each part of each call, related as the operator draws them."""
    gen = torch.Generator(device=device).manual_seed(seed)
    parts = len(op.PROGRAM_PARTS)
    keys = torch.rand(n_calls, parts, pool_programs, generator=gen, device=device)
    index = torch.argsort(keys, dim=-1, stable=True)[..., :n_programs]
    if not mix_parts:
        index = index[:, :1].expand_as(index).contiguous()
    variants = op.draw_variants(n_calls, parts, axes, gen)
    return index, variants


def mixes_parts(op, family: str) -> bool:
    """Whether a timed program of `family` takes its parts from different pool programs (draw_calls)."""
    return family in op.INDEPENDENT_PARTS_FAMILIES


def call_inputs(op, pool: dict, batched, unit: tuple, index: torch.Tensor, variants: dict, k: int,
                movable: torch.Tensor) -> dict:
    """The inputs of timed call k: each batched input (flattened over the program axes in the pool) from the pool
    programs index[k, part] of its part, in the shape `unit` of the program axes, under its part's symmetry of
    call k; a program whose part 0 comes from a pool program that `movable` (parts_movable) marks False moves every
    part by part 0's. Every family takes the same steps, so that one null loop measures every family's."""
    part = program_parts(op, batched)
    x = {name: v for name, v in pool.items() if name not in batched}
    together = ~movable.index_select(0, index[k, 0]).reshape(unit)
    for p in range(len(op.PROGRAM_PARTS)):
        gathered = {name: v.index_select(0, index[k, p]).reshape(*unit, *v.shape[1:])
                    for name, v in pool.items() if part.get(name) == p}
        moved = op.apply_variant(gathered, {n: v[k, p] for n, v in variants.items()})
        if p:
            first = op.apply_variant(gathered, {n: v[k, 0] for n, v in variants.items()})
            moved = {name: torch.where(together.view(*unit, *(1,) * (t.dim() - len(unit))), first[name], t)
                     for name, t in moved.items()}
        x.update(moved)
    return {name: x[name] for name in pool}


def parts_movable(op, pool: dict, batched, mix_parts: bool) -> torch.Tensor:
    """call_inputs' `movable` for a pool flattened over the program axes: every program where parts are mixed (the
    operator's INDEPENDENT_PARTS_FAMILIES keep any two parts in the domain), else the operator's parts_movable."""
    if mix_parts:
        first = pool[next(iter(batched))]
        return torch.ones(first.shape[0], dtype=torch.bool, device=first.device)
    return op.parts_movable({k: v for k, v in pool.items() if k in batched})


def program_parts(op, batched) -> dict[str, int]:
    """Each batched input's part (its group's place in op.PROGRAM_PARTS); ValueError unless every one is in exactly
    one group."""
    part = {name: i for i, group in enumerate(op.PROGRAM_PARTS) for name in group}
    grouped = [name for group in op.PROGRAM_PARTS for name in group]
    if sorted(grouped) != sorted(batched):
        raise ValueError(f"the operator's PROGRAM_PARTS group {sorted(grouped)}, not the batched inputs "
                         f"{sorted(batched)} each once")
    return part


def poison(outputs) -> None:
    """Fill output buffers with values no correct flush writes (NaN; the type's minimum for integers), so an output
    left unwritten cannot pass for a result."""
    for t in outputs:
        t.fill_(float("nan") if t.is_floating_point() else (torch.iinfo(t.dtype).min if t.dtype != torch.bool else 0))


def capture(call: Callable, stream, pool=None) -> tuple:
    """call() captured in a CUDA graph on `stream` (warm it up first: compilation, caches, allocator), its memory
    from `pool` (another graph's `pool()`; None: a private pool of its own); returns the graph and what the call
    returned. NotCapturable when the call's launch pattern cannot be captured."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=stream, pool=pool):
            out = call()
    except Exception as e:  # noqa: BLE001 - the solution's launch pattern, reported as its error
        raise NotCapturable(f"not CUDA-graph capturable ({type(e).__name__}: {' '.join(str(e).split())[:160]});"
                            " launch on the current stream, join side streams, no host synchronisation") from None
    return graph, out


def l2_flush_buffer(device) -> torch.Tensor:
    """Scratch whose fill evicts the whole L2: twice its size, at least 128 MB."""
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return torch.empty(max(2 * l2, 1 << 27), dtype=torch.uint8, device=device)


def flat_programs(t: torch.Tensor, n_prefix: int) -> torch.Tensor:
    """t with its first n_prefix dims (the program axes) as one."""
    return t.reshape(-1, *t.shape[n_prefix:])


class _Rerun:
    """The CPU's stand-in for a captured CUDA graph (so that the whole timed path runs in CI): `replay` calls again
    and copies what it returns into the first call's outputs."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.out = fn()

    def replay(self) -> None:
        out = self.fn()
        for dst, src in zip(self.out or (), out or ()):
            dst.copy_(src)


class TimedLoop:
    """The worker's half of a timed measurement (see the module docstring): built on the warm-up inputs (warm-up,
    capture) and `slots`, the outputs of every timed call in memory the harness lent (harness.shared), then
    `load_pool` and `run(seed)`, after whose reply the harness kills the worker and reads the slots. On the CPU
    (tests only) graphs are plain calls and the clock is time.perf_counter."""

    def __init__(self, call: Callable, warm: dict, axes: dict, batched: list[str], n_prefix: int, n_calls: int, op,
                 warmup_replays: int, slots: list[tuple[torch.Tensor, ...]], mix_parts: bool):
        self.device = next(iter(warm.values())).device
        self.cuda = self.device.type == "cuda"
        self.axes, self.batched, self.n_prefix, self.n_calls, self.op = axes, set(batched), n_prefix, n_calls, op
        self.mix_parts = mix_parts
        if self.cuda:
            self.stream = torch.cuda.Stream(self.device)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.sets = [{k: v.clone() for k, v in warm.items()} for _ in range(INPUT_SETS)]
        self.graphs, self.outputs = [], []
        with self._on_stream():
            for s in self.sets:
                for _ in range(2):
                    call(s, axes)               # warm-up: compilation, autotuning caches, allocator
            self._synchronize()
            for s in self.sets:
                graph, out = self._capture(lambda s=s: call(s, axes), self._shared_pool(self.graphs))
                self.graphs.append(graph)
                self.outputs.append(tuple(out))
            for graph in self.graphs:
                for _ in range(warmup_replays):
                    graph.replay()
        for out in self.outputs:
            if any(type(t) is not torch.Tensor or t.device != self.device for t in out):
                raise TypeError("the captured call returned something other than tensors on the inputs' device")
            if [(t.dtype, t.shape) for t in out] != [(t.dtype, t.shape) for t in slots[0]]:
                raise TypeError("the captured call's outputs differ in dtype or shape from the definition's")
        self.slots = slots
        self.scratch = l2_flush_buffer(self.device) if self.cuda else torch.empty(1, dtype=torch.uint8)
        self._synchronize()

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def _shared_pool(self, graphs: list):
        """The memory pool of the first of `graphs`, shared by the rest. Graphs sharing a pool reuse each other's
        temporaries, which is safe here because they run one at a time and each call's outputs are copied out
        before the next call graph runs; with a pool each, the INPUT_SETS call graphs and the n_calls preparations
        held tens of GB at large batches, more than an 80 GB card has beside the harness."""
        return graphs[0].pool() if self.cuda and graphs else None

    def _capture(self, fn: Callable, pool=None):
        if self.cuda:
            return capture(fn, self.stream, pool)
        rerun = _Rerun(fn)
        return rerun, rerun.out

    def _synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _stamp(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def _elapsed_ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3

    def load_pool(self, pool: dict) -> None:
        """Take the pool of fresh programs, capture each call's preparation as a graph of its own (so that the loop
        launches four things a call and the GPU, not the host, sets its pace) and run the loop once, untimed, so
        that every kernel it uses is loaded before the clock starts."""
        self.pool = {k: (flat_programs(v, self.n_prefix) if k in self.batched else v).to(self.device)
                     for k, v in pool.items()}
        self.unit = tuple(self.sets[0][next(iter(self.batched))].shape[:self.n_prefix])
        self.pool_programs = self.pool[next(iter(self.batched))].shape[0]
        self.index, self.variants = draw_calls(self.n_calls, math.prod(self.unit), self.pool_programs, 0, self.op,
                                               self.axes, self.device, mix_parts=self.mix_parts)
        self.movable = parts_movable(self.op, self.pool, self.batched, self.mix_parts)
        with self._on_stream():
            self.prepares = []
            for k in range(self.n_calls):
                self.prepares.append(self._capture(lambda k=k: self._prepare(k), self._shared_pool(self.prepares))[0])
            self.finish = self._capture(lambda: self._copy_out(self.n_calls - 1), self._shared_pool(self.prepares))[0]
        self.run(int.from_bytes(os.urandom(7), "little"))

    def _prepare(self, k: int) -> None:
        """Before call k: keep call k - 1's outputs, refill call k's input set from the pool (index[k], symmetry k),
        poison its outputs and flush the L2."""
        if k:
            self._copy_out(k - 1)
        i = k % INPUT_SETS
        inputs = call_inputs(self.op, self.pool, self.batched, self.unit, self.index, self.variants, k, self.movable)
        for name, t in self.sets[i].items():
            t.copy_(inputs[name])
        poison(self.outputs[i])
        self.scratch.fill_(k & 0xFF)

    def _copy_out(self, k: int) -> None:
        for dst, src in zip(self.slots[k], self.outputs[k % INPUT_SETS]):
            dst.copy_(src)

    def run(self, seed: int) -> list[float]:
        """Latency (ms) of each timed call, on the pool programs and symmetries draw_calls(..., seed) gives."""
        t0 = time.perf_counter()
        stamps = []
        with self._on_stream():
            index, variants = draw_calls(self.n_calls, math.prod(self.unit), self.pool_programs, seed, self.op,
                                         self.axes, self.device, mix_parts=self.mix_parts)
            self.index.copy_(index)
            for name, params in variants.items():
                self.variants[name].copy_(params)
            first = self._stamp()
            for k in range(self.n_calls):
                self.prepares[k].replay()
                start = self._stamp()
                self.graphs[k % INPUT_SETS].replay()
                stamps.append((start, self._stamp()))
            self.finish.replay()
            last = self._stamp()
        self._synchronize()
        self.loop_ms = ((time.perf_counter() - t0) * 1e3, self._elapsed_ms(first, last))
        return [self._elapsed_ms(a, b) for a, b in stamps]


def time_replays(prepare: Callable, n_calls: int, stream) -> list[float]:
    """The deployment benchmark's timer (harness/deploy.py, in the solution's worker; its figures are the worker's
    own, not checked against the harness's clock). Latency (ms) of n_calls CUDA-graph replays, each between two CUDA
    events on `stream`, L2-cold: before call k, outside the timed region, `prepare(k)` readies the inputs and
    returns the graph to replay, then the L2 is flushed."""
    scratch = l2_flush_buffer(stream.device)
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
    torch.cuda.synchronize(stream.device)
    return [s.elapsed_time(e) for s, e in events]


def clock_disagreement(latencies_ms: list[float], wall_ms: float, null_wall_ms: float,
                       null_call_ms: float = 0.0) -> str | None:
    """Why the worker's median cannot be what its calls took (None when it can): below the mean per call that the
    harness's clock measured beyond the null loop (less CLOCK_SLACK_MS and CLOCK_SLACK_PER_CALL_MS a call for
    noise), plus the null call's own median, by more than CLOCK_TOLERANCE. Work moved out of the timed region, a
    forged clock, or work piled onto a few calls so that the median misses it all show up as this gap."""
    n = len(latencies_ms)
    allowed = (wall_ms - null_wall_ms - CLOCK_SLACK_MS) / n + null_call_ms - CLOCK_SLACK_PER_CALL_MS
    median = statistics.median(latencies_ms)
    if median < (1 - CLOCK_TOLERANCE) * allowed:
        return (f"median {median * 1e3:.1f} us a call, the harness's clock {allowed * 1e3:.1f} us (loop "
                f"{wall_ms:.2f} ms, null loop {null_wall_ms:.2f} ms with calls of {null_call_ms * 1e3:.1f} us, "
                f"{n} calls): time spent outside the timed region")
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
