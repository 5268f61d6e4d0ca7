"""Evaluate solutions on workloads. Each solution runs in its own worker process inside the sandbox
(harness.sandbox), spoken to only through harness.wire messages with deadlines; loading the workloads, drawing fresh
inputs and schedules, judging and the clock that checks the timing stay in this process. A crash, hang, malformed
reply or exception in one solution becomes a status for its workloads and never stops the others; after a timeout
or a dead worker its remaining workloads are reported without running them (unless keep_going)."""
from __future__ import annotations

import collections
import gc
import hashlib
import math
import os
import signal
import socket
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from harness import HarnessError, one_line, sandbox, shared, timing, wire
from harness.definition import Definition
from harness.ops import Verdict, load_op
from harness.project import Settings
from harness.records import EvaluationStatus
from harness.solutions import Solution, is_reference, load_entry, null_solution
from harness.workloads import Workload, generate_tensors, load_inputs, write_reproducer

PASSED = EvaluationStatus.PASSED
INCORRECT_SHAPE = EvaluationStatus.INCORRECT_SHAPE
INCORRECT_DTYPE = EvaluationStatus.INCORRECT_DTYPE
INCORRECT_NUMERICAL = EvaluationStatus.INCORRECT_NUMERICAL
RUNTIME_ERROR = EvaluationStatus.RUNTIME_ERROR
COMPILE_ERROR = EvaluationStatus.COMPILE_ERROR
TIMEOUT = EvaluationStatus.TIMEOUT
STOP_GRACE_S = 2.0
JUDGED_PROGRAMS = 1 << 14       # programs the judge takes at once when it checks the timed calls
LATE_WRITE_SAMPLES = 1 << 16    # words of the timed calls' outputs read at the reply and again once the worker is gone


@dataclass
class Result:
    solution: str
    workload: Workload
    status: EvaluationStatus
    log: str = ""
    verdict: Verdict | None = None
    latency_ms: float | None = None     # median kernel time on the GPU
    floor_ms: float | None = None       # the memory floor of this workload on this GPU
    fresh_seed: int | None = None       # the seed of the fresh inputs it was also judged (and timed) on
    clock: dict = field(default_factory=dict)   # the timed loop against the harness's clock
    isolation: str = ""                 # "bwrap", or "unsandboxed (why)"
    sha256: str = ""                    # of the sources the worker was given, taken before they ran
    device: str = ""                    # where it ran: "cpu", "cuda", or "cuda:<index>" in a run over several GPUs


def gpu_uuid(index: int | None) -> str:
    """The UUID ("GPU-...", as CUDA_VISIBLE_DEVICES and the driver write it) of this process's CUDA device `index`
    (None: the current one), which names that GPU to a worker whatever its own device numbering."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
    return f"GPU-{props.uuid}"


def _one_line(text, limit: int = 500) -> str:
    """Whatever a worker sent as a message, as one printable line of at most `limit` characters."""
    return one_line(text, limit)


def home_name(sol: Solution) -> str:
    """The name of a solution's home (its build cache, one per sources hash): a folder's is named after the folder
    too, so that a same-named solution elsewhere (another project on this machine) neither shares nor prunes it, nor
    the reference's (no folder, its bare name)."""
    if sol.folder is None:
        return sol.name
    return f"{sol.name}@{hashlib.sha256(str(sol.folder.resolve()).encode()).hexdigest()[:8]}"


class Worker:
    """A solution's sandboxed process. `request` returns ("ok", header, tensors) or (status, one-line log, None);
    `fatal` is set once the worker timed out, died or sent a malformed reply (it is then stopped)."""

    def __init__(self, sol: Solution, defn: Definition, device: str, timeout_s: float, hide: list[Path],
                 gpu: int | None = None):
        self.sol, self.defn, self.device, self.timeout_s = sol, defn, device, timeout_s
        self.load_error: str | None = None
        try:
            self.files = sol.files(defn)                    # read, and hashed, before anything of it runs
        except OSError as e:
            self.files, self.load_error = [], _one_line(f"its files cannot be staged: {e}")
        self.sha256 = sandbox.files_sha256(self.files)
        env = {"TRITON_INTERPRET": "1"} if device == "cpu" and sol.language == "triton" else {}
        uuid = gpu_uuid(gpu) if device == "cuda" else None      # the worker sees that one GPU, as "cuda"
        self.box = sandbox.Sandbox(home_name(sol), self.files, self.sha256, hide, env, gpu=uuid)
        self.proc: subprocess.Popen | None = None
        self.fatal: str | None = None
        self.gone = True                        # whether the last stop left none of its processes behind
        self.home_overflow: str | None = None   # why the home watch ended it

    @property
    def isolation(self) -> str:
        if not self.box.sandboxed:
            return f"unsandboxed ({self.box.downgrade})"
        return f"bwrap ({self.box.gpu_note})" if self.box.gpu_note else "bwrap"

    def start(self) -> None:
        self.sock, child = socket.socketpair()
        try:
            self.proc = self.box.popen(["-m", "harness.worker", str(child.fileno())], pass_fds=(child.fileno(),))
        except OSError as e:
            self.load_error = f"the worker process does not start ({type(e).__name__}: {e})"
            return
        finally:
            child.close()
        self.output = collections.deque(maxlen=20)
        threading.Thread(target=self._drain, args=(self.proc.stdout, self.output), daemon=True).start()
        threading.Thread(target=self._watch_home, args=(self.proc,), daemon=True).start()
        try:
            wire.send(self.sock, {"definition": self.defn.to_json(), "solution": self.sol.worker_spec(),
                                  "solution_dir": str(self.box.solution_dir), "device": self.device})
        except OSError as e:        # it ended before reading a byte (a sandbox that failed to start)
            self.stop(grace=False)
            said = " | ".join(self.output)
            self.load_error = _one_line(f"the worker ended at its start ({type(e).__name__}"
                                        f"{'; it said: ' + said if said else ''})")
            return
        status, header, _ = self._receive("loading", 0)
        if status != "ok":
            self.load_error = header
        elif header.get("status") != "ready":
            self.load_error = _one_line(header.get("message", "the worker did not load the solution"))
            self.stop()

    def _watch_home(self, proc: subprocess.Popen) -> None:
        """While the worker runs, measure its home every HOME_CHECK_S: one larger than HOME_BYTES (its one
        persistent, writable place, on the host's disk) ends it at once, not when it is done."""
        while proc.poll() is None:
            time.sleep(sandbox.HOME_CHECK_S)
            if proc.poll() is None and self.box.home_too_large():
                self.home_overflow = (f"its home grew past {sandbox.HOME_BYTES >> 20} MiB or "
                                      f"{sandbox.HOME_ENTRIES} files and folders; worker killed")
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                return

    @staticmethod
    def _drain(stream, last) -> None:
        """Keep the worker's last lines of output (for a dead worker's log), reading in bounded chunks: a line
        without end must not grow this process."""
        pending = b""
        while chunk := stream.read1(1 << 16):
            *lines, pending = (pending + chunk).split(b"\n")
            pending = pending[-300:]
            last.extend(_one_line(line.decode(errors="replace"), 300) for line in lines[-20:] if line.strip())

    def _receive(self, what: str, max_bytes: int):
        try:
            header, tensors = wire.receive(self.sock, self.timeout_s, max_bytes)
        except TimeoutError:
            return self._fail(TIMEOUT, f"no answer within {self.timeout_s:g} s while {what}; worker killed")
        except (EOFError, ConnectionError, OSError):
            if self.home_overflow:
                return self._fail(RUNTIME_ERROR, self.home_overflow)
            try:
                code = self.proc.wait(5) if self.proc else None
            except subprocess.TimeoutExpired:
                code = "none: it closed its end and went on"
            said = f"; it printed: {self.output[-1]}" if self.output else ""
            return self._fail(RUNTIME_ERROR, f"worker process died while {what} (exit code {code}){said}")
        except wire.WireError as e:
            return self._fail(RUNTIME_ERROR, f"malformed reply while {what}: {e}; worker killed")
        if header.get("status") == "error":
            return RUNTIME_ERROR, _one_line(header.get("message")), None
        return "ok", header, tensors

    def _fail(self, status: str, log: str):
        self.fatal = self.fatal or log
        self.stop()
        return status, log, None

    def request(self, header: dict, tensors: dict | None, what: str, max_bytes: int, lend: int | None = None):
        """Send a request; the reply's tensors may take at most max_bytes (more is a malformed reply, and the worker
        is stopped): every caller states what it expects, so that a reply cannot make this process allocate more."""
        if self.fatal:
            return RUNTIME_ERROR, f"worker stopped earlier: {self.fatal}", None
        if self.load_error is None and self.proc is None:
            self.start()                    # first request
        if self.load_error:
            return COMPILE_ERROR, self.load_error, None
        try:
            wire.send(self.sock, header, {k: v.detach().cpu() for k, v in (tensors or {}).items()}, lend)
        except OSError:
            pass                            # it died before reading: the receive reports how
        return self._receive(what, max_bytes)

    def stop(self, grace: bool = True) -> None:
        """End the worker: asked to stop, then killed after STOP_GRACE_S (at once without `grace`). A later
        request starts a new one."""
        if self.proc is None:
            return
        try:
            if grace:
                wire.send(self.sock, {"op": "stop"})
                self.proc.wait(STOP_GRACE_S)
        except (OSError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)    # the sandbox's PID namespace ends with it
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.sock.close()
        self.proc = None
        self.gone = self.box.wait_gone()        # False: something it started may still run

    def close(self) -> None:
        self.stop()
        self.box.close()


def check_outputs(defn: Definition, specs, tensors: dict, axes: dict, device: str) -> tuple[str, str]:
    """(status, log) of a worker's reply against the definition: count, plain dense tensors, shapes, dtypes,
    device."""
    outputs = list(defn.outputs.items())
    if not isinstance(specs, list) or len(specs) != len(outputs) or not all(isinstance(s, dict) for s in specs):
        n = len(specs) if isinstance(specs, list) else "?"
        return INCORRECT_SHAPE, f"returned {n} outputs, the definition has {len(outputs)}"
    for i, ((name, spec), desc) in enumerate(zip(outputs, specs)):
        t = tensors.get(f"out{i}")
        if desc.get("kind") != "tensor" or t is None:
            return INCORRECT_SHAPE, f"{name} is a {str(desc.get('kind'))[:60]}, not a plain dense tensor"
        shape = defn.shape(spec, axes)
        if tuple(t.shape) != shape:
            return INCORRECT_SHAPE, f"{name} has shape {tuple(t.shape)}, expected {shape}"
        if t.dtype != spec.torch_dtype:
            return INCORRECT_DTYPE, f"{name} is {t.dtype}, expected {spec.torch_dtype}"
        where = str(desc.get("device", ""))
        if where.split(":")[0] != device:
            return RUNTIME_ERROR, f"outputs on {where[:20]}, the inputs on {device}"
    return PASSED, ""


def program_layout(defn: Definition) -> tuple[tuple[str, ...], int]:
    """The axes every output starts with (one program each) and the inputs that share them."""
    shapes = [s.shape for s in defn.outputs.values()]
    n = 0
    while all(len(s) > n and s[n] == shapes[0][n] for s in shapes):
        n += 1
    batched = tuple(name for name, s in defn.inputs.items() if s.shape[:n] == shapes[0][:n])
    return batched, n


def outputs_nbytes(defn: Definition, axes: dict) -> int:
    return sum(math.prod(defn.shape(s, axes)) * s.torch_dtype.itemsize for s in defn.outputs.values())


def reply_bytes(defn: Definition, axes: dict) -> int:
    """The most a reply carrying a call's outputs may hold: room for outputs of the widest dtype (so that a wrong
    dtype is reported as such rather than as a malformed reply) and the wire's alignment."""
    return 8 * outputs_nbytes(defn, axes) + wire.MAX_PADDING


def floor_ms(defn: Definition, axes: dict, bandwidth: float) -> float:
    """Every input read once and every output written once, at the measured copy rate."""
    nbytes = sum(math.prod(defn.shape(s, axes)) * s.torch_dtype.itemsize
                 for s in (*defn.inputs.values(), *defn.outputs.values()))
    return nbytes / bandwidth * 1e3


def fresh_seed(run_seed: int, w: Workload) -> int:
    return int.from_bytes(hashlib.sha256(f"{run_seed}/{w.uuid}".encode()).digest()[:7], "little")


def pool_axes(defn: Definition, w: Workload, least: int) -> tuple[dict, int, int]:
    """The var axes of a workload's fresh pool, its programs per call and the pool's programs: the var axis of the
    program axes scaled so that the pool holds at least `least` programs (Settings.pool_programs when timed, else
    1: one call's worth)."""
    _, n_prefix = program_layout(defn)
    prefix = defn.outputs[next(iter(defn.outputs))].shape[:n_prefix]
    axes = defn.resolve_axes(w.axes)
    n_programs = math.prod(axes[a] for a in prefix)
    var = next((a for a in prefix if a in w.axes), None)
    scale = math.ceil(least / n_programs) if var else 1
    return {**w.axes, **({var: w.axes[var] * scale} if var else {})}, n_programs, n_programs * scale


class Programs:
    """A workload's fresh pool of programs, drawn from the run's seed (pool_axes). `first()` is one call's inputs
    from it; `calls(...)` those of timed calls (timing.call_inputs)."""

    def __init__(self, defn: Definition, w: Workload, seed: int, device: str, least: int):
        batched, self.n_prefix = program_layout(defn)
        self.batched = set(batched)
        var_axes, self.n_programs, self.pool_programs = pool_axes(defn, w, least)
        self.pool = generate_tensors(defn, w.family, var_axes, seed, device, w.params)
        self.unit = defn.shape(defn.inputs[batched[0]], defn.resolve_axes(w.axes))[:self.n_prefix]
        self.flat = {k: timing.flat_programs(v, self.n_prefix) if k in self.batched else v
                     for k, v in self.pool.items()}

    def first(self) -> dict:
        """The inputs of one call on the pool's first programs: a fresh draw of the family."""
        return {k: (v[:self.n_programs].reshape(*self.unit, *v.shape[1:]) if k in self.batched else v)
                for k, v in self.flat.items()}

    def movable(self, op, mix_parts: bool) -> torch.Tensor:
        """timing.call_inputs' `movable` for this pool."""
        return timing.parts_movable(op, self.flat, self.batched, mix_parts)

    def calls(self, op, index: torch.Tensor, variants: dict, movable: torch.Tensor, first: int, count: int) -> dict:
        """The inputs of timed calls first .. first + count - 1 (timing.call_inputs), concatenated along the first
        dim."""
        calls = [timing.call_inputs(op, self.flat, self.batched, self.unit, index, variants, k, movable)
                 for k in range(first, first + count)]
        return {k: (torch.cat([c[k] for c in calls]) if k in self.batched else v) for k, v in self.flat.items()}


class Calibration:
    """The timed loop with the harness's own null call (outputs written, no flush), run per shape in this process
    (trusted code, nothing of a solution's in it): its wall time is the loop's overhead, which the clock check
    subtracts. A null loop in a sandboxed worker of its own ran ~21 us a call shorter than the same loop measured in
    a plain process, and shorter than a solution's loop less the difference of the calls, so it let that much a call
    of a solution's time go unchecked; this process's null loop is at least as long as the sandboxed solutions'
    loops less their calls', which errs only towards refusing work moved out of the events. Measured before the
    solution's worker starts, so that no solution process exists to slow it down."""

    def __init__(self, defn: Definition, settings: Settings):
        self.defn, self.settings = defn, settings
        self.walls: dict[tuple, tuple[float, float]] = {}
        self.loops: dict[tuple, object] = {}
        self.null = load_entry(null_solution(defn), defn)

    def measure(self, op, pristine: dict, axes: dict, batched, n_prefix: int, n_calls: int,
                pool_programs: int) -> None:
        key = _key(axes, n_calls, pool_programs)
        device = next(iter(pristine.values())).device
        n_programs = math.prod(pristine[batched[0]].shape[:n_prefix])
        rows = torch.arange(pool_programs, device=device) % n_programs
        pool = {k: (timing.flat_programs(v, n_prefix).index_select(0, rows).reshape(-1, *v.shape[1:])
                    if k in batched else v)
                for k, v in pristine.items()}
        specs = output_specs(self.defn, axes)
        output_bytes = n_calls * shared.layout(specs)[1]
        lent = shared.Lent(output_bytes, device)       # the memory kind a worker's slots are
        loop, threads = None, torch.get_num_threads()
        if device.type == "cpu":
            torch.set_num_threads(1)    # as a CPU worker runs (harness.worker)
        try:
            # one shape's loop serves every family: their preparations take the same steps (timing.call_inputs)
            loop = timing.TimedLoop(self.null, pristine, axes, list(batched), n_prefix, n_calls, op,
                                    self.settings.warmup_replays, shared.views(lent.tensor, specs, n_calls),
                                    mix_parts=True)
            loop.load_pool(pool)
            walls, calls = [], []
            for _ in range(self.settings.calibration_repeats):
                gc.collect()
                gc.disable()            # as the solution's worker runs its loop, and as the harness's clock does
                try:
                    t0 = time.perf_counter()
                    latencies = loop.run(int.from_bytes(os.urandom(7), "little"))
                    _sample_words(lent, output_bytes)       # as the solution's clock ends (_timed_measure)
                    walls.append((time.perf_counter() - t0) * 1e3)
                finally:
                    gc.enable()
                calls.append(statistics.median(latencies))
            self.loops[key] = list(loop.loop_ms)
        except (RuntimeError, torch.OutOfMemoryError) as e:
            raise HarnessError(f"the harness's null loop failed: {_one_line(e, 200)}") from None
        finally:
            del loop
            lent.close()
            torch.set_num_threads(threads)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        self.walls[key] = statistics.median(walls), statistics.median(calls)

    def null_loop(self, axes: dict, n_calls: int, pool_programs: int) -> tuple[float, float]:
        """(wall time of the null loop, median of its calls), in ms."""
        return self.walls[_key(axes, n_calls, pool_programs)]


def _key(axes: dict, n_calls: int, pool_programs: int) -> tuple:
    return tuple(sorted(axes.items())), n_calls, pool_programs


@dataclass
class Measurement:
    """One timed loop: the time_run reply's header (or a one-line log when not "ok"), the schedule seed sent, the
    harness's wall time from sending it to the first read of the outputs after the reply, and the lent memory
    holding every timed call's outputs (the caller reads, then closes it)."""
    status: str
    reply: dict | str
    seed: int | None = None
    wall_ms: float | None = None
    outputs: shared.Lent | None = None


def output_specs(defn: Definition, axes: dict) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    return [(s.torch_dtype, defn.shape(s, axes)) for s in defn.outputs.values()]


def _timed_measure(defn: Definition, worker: Worker, warm: dict, pool: dict, axes: dict, batched, n_prefix: int,
                   n_calls: int, warmup_replays: int, mix_parts: bool) -> Measurement:
    """One timed loop in the worker (harness.timing): capture on `warm`, lend it the memory for the outputs of the
    n_calls timed calls, send the pool, then the schedule seed alone, timed by the wall clock until the reply and a
    read of words of the outputs at random places. The worker is killed the moment it replies (whatever it replied),
    and the outputs are judged only once it is gone. Work it left running past its reply (GPU kernels outlive the
    process until the driver tears its context down) lands either before that read (inside the clock) or after it
    (the same words, read again once the worker is gone, show it)."""
    specs = output_specs(defn, axes)
    device = next(iter(pool.values())).device
    output_bytes = n_calls * shared.layout(specs)[1]
    lent = shared.Lent(output_bytes, device)
    seed = int.from_bytes(os.urandom(7), "little")
    wall_ms = probe = None
    try:
        status, reply, _ = worker.request(
            {"op": "time_prepare", "axes": axes, "batched": list(batched), "n_prefix": n_prefix,
             "n_calls": n_calls, "warmup_replays": warmup_replays, "lent_bytes": lent.nbytes, "mix_parts": mix_parts,
             "outputs": [[wire.dtype_name(dtype), list(shape)] for dtype, shape in specs]},
            warm, "capturing", 0, lend=lent.fd)
        if status == "ok":
            status, reply, _ = worker.request({"op": "time_pool"}, pool, "loading the pool", 0)
        if status == "ok":
            gc.collect()
            gc.disable()        # a collection of this process's large heap inside the window reads as the solution's
            try:
                t0 = time.perf_counter()
                status, reply, _ = worker.request({"op": "time_run", "seed": seed}, None, "timing", 0)
                if status == "ok":
                    # read inside the clock: GPU work the worker left queued at its reply that lands before this
                    # read is charged to it, and work that lands after it changes the words read again below
                    probe = _sample_words(lent, output_bytes)
                wall_ms = (time.perf_counter() - t0) * 1e3
            finally:
                gc.enable()
    finally:
        worker.stop(grace=False)
    if status == "ok" and not worker.gone:
        status, reply = RUNTIME_ERROR, f"the worker's processes outlived the kill by {sandbox.GONE_TIMEOUT_S:g} s"
    if status == "ok" and not torch.equal(_sample_words(lent, output_bytes, probe[0])[1], probe[1]):
        status, reply = RUNTIME_ERROR, "its outputs changed after its reply: work left running past the timed loop"
    if status != "ok":
        lent.close()
        return Measurement(status, reply)
    return Measurement(status, reply, seed, wall_ms, lent)


def _sample_words(lent: shared.Lent, nbytes: int, where: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(places, values) of LATE_WRITE_SAMPLES 4-byte words of the first `nbytes` of the lent memory: at places drawn
    here (unknown to the worker) unless given."""
    words = lent.tensor[:nbytes // 4 * 4].view(torch.int32)
    if where is None and words.numel() == 0:
        where = torch.zeros(0, dtype=torch.long, device=words.device)
    elif where is None:
        draw = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))
        where = torch.randint(words.numel(), (LATE_WRITE_SAMPLES,), generator=draw).to(words.device)
    return where, words[where].cpu()


def _times(value, n: int) -> list[float] | None:
    """A worker's list of n times (ms) as floats, or None unless it is exactly that: nothing else it sends reaches a
    record."""
    if not isinstance(value, list) or len(value) != n or \
            not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
                    for x in value):
        return None
    return [float(x) for x in value]


def deal(workloads: list, n: int) -> list[list]:
    """The workloads dealt round-robin into at most n non-empty shares (a run over several devices or jobs)."""
    return [share for share in (workloads[i::n] for i in range(n)) if share]


def evaluate(defn: Definition, sol: Solution, workloads: list[Workload], device: str, *, root: str | Path,
             settings: Settings = Settings(), hide: tuple[Path, ...] = (),
             on_result: Callable[[Result], None] = lambda r: None, timed: bool | None = None,
             run_seed: int | None = None, keep_going: bool = False,
             calibration: Calibration | None = None, gpu: int | None = None,
             failures: Path | None = None, save_outputs: Path | None = None) -> list[Result]:
    """Judge one solution on each workload, on its committed inputs and on fresh inputs drawn from `run_seed` (a
    fresh random seed when None); on a GPU, time the ones that pass on fresh inputs, every timed call judged, each
    against the memory floor at settings.bandwidth (bytes/s; measured now if not set). The blobs are under `root`;
    the solution's worker sees neither `root` nor the folders in `hide` (the project's). With `gpu` (a run over
    several GPUs, device "cuda"), this thread and the worker use that GPU alone. With `failures`, a timed call that
    fails leaves the inputs of its failing batch element there (they come from the device's generator under the
    schedule seed, which may not exist elsewhere). With `save_outputs`, the solution's outputs on each workload's
    committed inputs are written to save_outputs/<solution>/<the blob's name>, to study a verdict."""
    if gpu is not None and device == "cuda":
        torch.cuda.set_device(gpu)          # this thread's tensors, judge and clock on that GPU
    timed = device == "cuda" if timed is None else timed
    if timed and settings.bandwidth is None:
        settings = settings.replace(bandwidth=timing.copy_bandwidth(device))
    run_seed = int.from_bytes(os.urandom(7), "little") if run_seed is None else run_seed
    op = load_op(defn.op_type)
    hide = [Path(root).resolve(), *(Path(h).resolve() for h in hide)]
    if timed and calibration is None:
        calibration = Calibration(defn, settings)
    worker = Worker(sol, defn, device, settings.timeout_s, hide, gpu)
    where = device if gpu is None else f"{device}:{gpu}"
    results, stopped = [], None
    try:
        if timed:
            try:
                _calibrate(defn, op, calibration, workloads, device, root, settings)
            except HarnessError as e:           # no overhead to check a clock against: no figure can be trusted
                timed, stopped = False, (RUNTIME_ERROR, f"not timed: {e}"[:400])
        for w in workloads:
            result = Result(sol.name, w, PASSED, isolation=worker.isolation, sha256=worker.sha256, device=where)
            if stopped:
                result.status, result.log = stopped
            else:
                try:
                    _evaluate_one(defn, op, worker, w, device, root, run_seed, timed, settings, calibration, result,
                                  failures, save_outputs)
                except torch.OutOfMemoryError as e:     # the harness's own share (inputs, checks) did not fit
                    result.status, result.log = RUNTIME_ERROR, ("the harness ran out of device memory on this "
                                                                f"workload: {str(e).splitlines()[0]}")[:400]
                finally:
                    if device == "cuda":        # the workload's inputs and checks, cached, returned to the device
                        torch.cuda.empty_cache()
                if worker.fatal and not keep_going:
                    stopped = (result.status, f"not run: the worker was stopped on {w.label} ({worker.fatal})"[:400])
                worker.fatal = None         # with keep_going, the next request starts a fresh worker
            results.append(result)
            on_result(result)
    finally:
        worker.close()
    return results


def _calibrate(defn, op, calibration: Calibration, workloads, device, root, settings: Settings) -> None:
    batched, n_prefix = program_layout(defn)
    for w in workloads:
        axes = defn.resolve_axes(w.axes)
        _, n_programs, pool_programs = pool_axes(defn, w, settings.pool_programs)
        n_calls = settings.timed_calls(n_programs)
        if _key(axes, n_calls, pool_programs) in calibration.walls:
            continue                        # this shape was measured for an earlier workload or solution
        try:
            pristine = load_inputs(defn, w, device, root=root)
        except (HarnessError, torch.OutOfMemoryError):
            continue                        # reported as that workload's error
        calibration.measure(op, pristine, axes, batched, n_prefix, n_calls, pool_programs)


def _evaluate_one(defn, op, worker: Worker, w: Workload, device: str, root, run_seed: int, timed: bool,
                  settings: Settings, calibration, result: Result, failures: Path | None = None,
                  save_outputs: Path | None = None) -> None:
    try:
        pristine = load_inputs(defn, w, device, root=root)
    except HarnessError as e:
        result.status, result.log = RUNTIME_ERROR, f"workload: {e}"
        return
    keep = None
    if save_outputs is not None:
        def keep(outputs, path=Path(save_outputs) / result.solution / Path(w.blob).name):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                save_file({name: t.detach().cpu().contiguous() for name, t in zip(defn.outputs, outputs)}, str(path))
            except OSError as e:            # the verdict stands; only the copy for study is lost
                result.log = f"outputs not saved: {path}: {e.strerror}"
    _judge_one(defn, op, worker, pristine, result, keep=keep)
    if result.status != PASSED:
        return
    result.fresh_seed = fresh_seed(run_seed, w)
    programs = Programs(defn, w, result.fresh_seed, device, settings.pool_programs if timed else 1)
    _judge_one(defn, op, worker, programs.first(), result, "fresh inputs: ")
    if result.status == PASSED and timed:
        _time_one(defn, op, worker, pristine, programs, result, settings, calibration, failures, root)


def _timed_loop(defn, op, worker: Worker, pristine: dict, programs: Programs, result: Result, settings: Settings,
               failures: Path | None, root) -> tuple[list[float] | None, dict | None]:
    """One timed loop (_timed_measure) on calls drawn from a schedule seed of its own, every call's outputs judged:
    (its latencies, its clock record), or (None, None) with the result's status and log set."""
    axes = defn.resolve_axes(result.workload.axes)
    batched, n_prefix = program_layout(defn)
    n, n_calls = programs.n_programs, settings.timed_calls(programs.n_programs)
    mix_parts = timing.mixes_parts(op, result.workload.family)
    m = _timed_measure(defn, worker, pristine, programs.pool, axes, batched, n_prefix, n_calls,
                       settings.warmup_replays, mix_parts)
    if m.status != "ok":
        result.status, result.log = m.status, f"while timing: {m.reply}"
        return None, None
    try:
        latencies, loop_ms = _times(m.reply.get("latencies_ms"), n_calls), _times(m.reply.get("loop_ms"), 2)
        if latencies is None or loop_ms is None:
            result.status, result.log = RUNTIME_ERROR, "while timing: the reply holds no valid latencies"
            return None, None
        device = next(iter(programs.pool.values())).device
        index, variants = timing.draw_calls(n_calls, n, programs.pool_programs, m.seed, op, axes, device,
                                            mix_parts=mix_parts)
        slots = shared.views(m.outputs.tensor, output_specs(defn, axes), n_calls)
        chunk = max(1, JUDGED_PROGRAMS // n)
        reference = defn.reference_run()
        movable = programs.movable(op, mix_parts)
        for first in range(0, n_calls, chunk):
            count = min(chunk, n_calls - first)
            inputs = programs.calls(op, index, variants, movable, first, count)
            outs = tuple(torch.cat([slots[k][j] for k in range(first, first + count)]).to(device)
                         for j in range(len(defn.outputs)))
            verdict = op.judge(inputs, outs, reference(**inputs), defn.reference, yardstick=is_reference(worker.sol))
            if not verdict.passed:
                # the schedule seed with the run seed (in the trace) rebuilds these calls' inputs on this device's
                # generator (timing.draw_calls); the failing element's inputs are kept for any other machine
                kept = _keep_failing_inputs(defn, result, m.seed, inputs, verdict, batched, failures, root)
                result.status, result.log = INCORRECT_NUMERICAL, f"timed calls {first}-{first + count - 1}: " \
                                                                 f"{verdict.reason} (schedule seed {m.seed}{kept})"
                return None, None
    finally:
        m.outputs.close()
    return latencies, {"timed_calls": n_calls, "wall_ms": m.wall_ms, "reported_ms": sum(latencies),
                       "worker_loop_ms": loop_ms}


def _keep_failing_inputs(defn: Definition, result: Result, schedule_seed: int, inputs: dict, verdict: Verdict,
                         batched, folder: Path | None, root) -> str:
    """Write the inputs of the batch element that holds the verdict's failing program (extra["program"]) to folder
    as a reproducer workload (workloads.write_reproducer); what the log adds to say where ("" when there is nothing
    to keep)."""
    program = verdict.extra.get("program")
    if folder is None or not program:
        return ""
    element = int(program[0])
    kept = {k: (v[element:element + 1] if k in batched else v).detach() for k, v in inputs.items()}
    w = result.workload
    try:
        path = write_reproducer(defn, folder, f"{result.solution}_{w.uuid[:8]}_{schedule_seed}", w.family,
                                {**w.axes, next(iter(defn.outputs.values())).shape[0]: 1}, schedule_seed, root=root,
                                tensors=kept)
    except OSError as e:
        return f"; its inputs could not be kept: {e.strerror}"
    root = Path(root).resolve()
    if path.resolve().is_relative_to(root):
        path = path.resolve().relative_to(root)         # as the project's commands name it, from its root
    return (f"; element {element}'s inputs in {path.with_suffix('.safetensors')}, replay: python -m harness.run "
            f"--solution {result.solution} --workloads {path}")


def run_call(defn: Definition, worker: Worker, inputs: dict, axes: dict) -> tuple[str, str, tuple | None]:
    """(status, log, outputs in definition order on the inputs' device) of one call of the worker's solution on
    `inputs`, lent to it in memory the harness owns (harness.shared): its reply checked against the definition, and
    the lent inputs compared with `inputs` afterwards by the harness itself."""
    names = list(inputs)
    specs = [(t.dtype, tuple(t.shape)) for t in inputs.values()]
    device = next(iter(inputs.values())).device
    lent = shared.Lent(shared.layout(specs)[1], device)
    try:
        lent_inputs = dict(zip(names, shared.views(lent.tensor, specs, 1)[0]))
        for name, t in inputs.items():
            lent_inputs[name].copy_(t)
        lent.settle()
        header = {"op": "run", "axes": axes, "lent_bytes": lent.nbytes,
                  "inputs": [[name, wire.dtype_name(dtype), list(shape)] for name, (dtype, shape) in zip(names, specs)]}
        status, reply, tensors = worker.request(header, None, "running", reply_bytes(defn, axes), lend=lent.fd)
        if status != "ok":
            return status, reply, None
        status, log = check_outputs(defn, reply.get("outputs"), tensors, axes, device.type)
        if status != PASSED:
            return status, log, None
        modified = next((name for name in names if not torch.equal(lent_inputs[name], inputs[name])), None)
        if modified is not None:
            return RUNTIME_ERROR, f"the solution modified its input {modified!r}", None
        return PASSED, "", tuple(tensors[f"out{i}"].to(device) for i in range(len(defn.outputs)))
    finally:
        lent_inputs = None
        lent.close()


def judge_call(defn, op, worker: Worker, inputs: dict, var_axes: dict,
               keep: Callable[[tuple], None] | None = None) -> tuple[str, str, Verdict | None]:
    """(status, log, verdict) of one call of the worker's solution on `inputs` (run_call), its outputs judged
    against the reference run here; `keep` is handed the outputs (checked, in definition order) first."""
    status, log, outputs = run_call(defn, worker, inputs, defn.resolve_axes(var_axes))
    if status != PASSED:
        return status, log, None
    if keep is not None:
        keep(outputs)
    verdict = op.judge(inputs, outputs, defn.reference_run()(**inputs), defn.reference,
                       yardstick=is_reference(worker.sol))
    return (PASSED, "", verdict) if verdict.passed else (INCORRECT_NUMERICAL, verdict.reason, verdict)


def _judge_one(defn, op, worker: Worker, pristine: dict, result: Result, what: str = "", keep=None) -> None:
    status, log, verdict = judge_call(defn, op, worker, pristine, result.workload.axes, keep)
    if verdict is not None and (result.verdict is None or not verdict.passed
                                or (verdict.score or 0) > (result.verdict.score or 0)):
        result.verdict = verdict            # the worse of the committed and the fresh inputs' verdicts
    if status != PASSED:
        result.status, result.log = status, what + log


def _time_one(defn, op, worker: Worker, pristine: dict, programs: Programs, result: Result, settings: Settings,
              calibration: Calibration, failures: Path | None, root) -> None:
    """Time the solution on fresh programs, judge every timed call's outputs, and refuse a median that the
    harness's clock (on settings.clock_attempts loops, each on calls of its own) or the memory floor contradicts."""
    axes = defn.resolve_axes(result.workload.axes)
    n_calls = settings.timed_calls(programs.n_programs)
    null_wall, null_call = calibration.null_loop(axes, n_calls, programs.pool_programs)
    refusals = []
    for _ in range(settings.clock_attempts):
        latencies, clock = _timed_loop(defn, op, worker, pristine, programs, result, settings, failures, root)
        if latencies is None:
            return
        clock.update(null_wall_ms=null_wall, null_call_ms=null_call,
                     null_worker_loop_ms=calibration.loops.get(_key(axes, n_calls, programs.pool_programs)))
        refused = timing.clock_disagreement(latencies, clock["wall_ms"], null_wall, null_call)
        if not refused:
            break
        refusals.append(refused)
    if refused:
        result.status, result.log = RUNTIME_ERROR, f"timing refused ({len(refusals)} loops): {refusals[0]}"
        return
    result.clock = {**clock, "refused_loops": refusals}
    result.latency_ms = statistics.median(latencies)
    result.floor_ms = floor_ms(defn, axes, settings.bandwidth)
    if result.latency_ms < timing.IMPOSSIBLE_FRACTION * result.floor_ms:
        result.status = RUNTIME_ERROR
        result.log = (f"median {result.latency_ms * 1e3:.1f} us is below {timing.IMPOSSIBLE_FRACTION}x the memory "
                      f"floor {result.floor_ms * 1e3:.1f} us: physically impossible")
