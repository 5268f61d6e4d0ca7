"""Evaluate solutions on workloads: each solution runs in its own spawned worker process; loading, judging and
timing stay in this (the parent) process, out of the solution's reach. A crash, hang or exception in one solution
becomes a status for its workloads and never stops the others."""
from __future__ import annotations

import math
import os
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.multiprocessing as mp

from harness import HarnessError, timing
from harness.definition import Definition
from harness.ops import Verdict, load_op
from harness.solutions import Solution, load_entry
from harness.workloads import Workload, load_inputs

PASSED = "PASSED"
INCORRECT_SHAPE = "INCORRECT_SHAPE"
INCORRECT_DTYPE = "INCORRECT_DTYPE"
INCORRECT_NUMERICAL = "INCORRECT_NUMERICAL"
RUNTIME_ERROR = "RUNTIME_ERROR"
COMPILE_ERROR = "COMPILE_ERROR"
TIMEOUT = "TIMEOUT"


@dataclass
class Result:
    solution: str
    workload: Workload
    status: str
    log: str = ""
    verdict: Verdict | None = None
    latency_ms: float | None = None     # median kernel time on the GPU
    floor_ms: float | None = None       # the memory floor of this workload on this GPU


def _one_line(e: BaseException) -> str:
    """The exception as one line, with the deepest frame of the solution's own code when there is one."""
    msg = " ".join(str(e).split()) or "(no message)"
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/harness/" not in f.filename]
    where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    return f"{type(e).__name__}: {msg[:400]}{where}"


def _worker(conn, sol: Solution, defn: Definition, env: dict, cpu: bool) -> None:
    """Child process: load the solution, then answer ("run", inputs, axes) with its outputs and
    ("time", inputs, axes, batched, n_prefix, perms, samples) with timing.time_calls' results (tensors sent back
    on the CPU)."""
    os.environ.update(env)
    if cpu:
        # one intra-op thread: with more, torch's CPU matmuls in a worker came out with other roundings in about one
        # start in ten, enough to flip a sensitive edge head across the criterion from one identical run to the next
        torch.set_num_threads(1)
    timing.guard()
    try:
        fn = load_entry(sol, defn)
    except BaseException as e:  # noqa: BLE001 - any failure to load is the solution's compile error
        conn.send(("compile_error", _one_line(e)))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "stop":
            return
        try:
            if msg[0] == "run":
                out = fn(msg[1], msg[2])
                devices = [str(t.device) for t in out if isinstance(t, torch.Tensor)] \
                    if isinstance(out, tuple) else []
                reply = (_cpu(out), devices)
            else:
                t, samples, last = timing.time_calls(fn, *msg[1:])
                reply = (t, _cpu(samples), _cpu(last))
            patched = timing.tampered()
            conn.send(("error", f"the solution replaced {patched}") if patched else ("ok", reply))
        except BaseException as e:  # noqa: BLE001 - reported as the workload's RUNTIME_ERROR
            conn.send(("error", _one_line(e)))


def _cpu(x):
    """Tensors (in nested tuples and lists) moved to the CPU: they cross the process boundary as shared memory."""
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, (tuple, list)):
        return type(x)(_cpu(v) for v in x)
    return x


class Worker:
    """A solution's process. `call` returns ("ok", outputs) or (status, one-line log)."""

    def __init__(self, sol: Solution, defn: Definition, device: str, timeout_s: float):
        self.sol, self.defn, self.timeout_s = sol, defn, timeout_s
        self.cpu = device == "cpu"
        self.env = {"TRITON_INTERPRET": "1"} if self.cpu and sol.language == "triton" else {}
        self.proc = None
        self.load_error: str | None = None

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, self.sol, self.defn, self.env, self.cpu), daemon=True)
        self.proc.start()
        child.close()
        status, payload = self._receive(self.timeout_s, "loading")
        if status != "ready":
            self.load_error = payload if status == "compile_error" else f"{status}: {payload}"

    def _receive(self, timeout_s: float, what: str):
        if not self.conn.poll(timeout_s):
            self.stop()
            return TIMEOUT, f"no answer within {timeout_s:g} s while {what}; worker killed"
        try:
            return self.conn.recv()
        except (EOFError, ConnectionResetError):
            self.proc.join(5)
            code = self.proc.exitcode
            self.stop()
            return RUNTIME_ERROR, f"worker process died while {what} (exit code {code})"

    def call(self, *message):
        if self.load_error is None and (self.proc is None or not self.proc.is_alive()):
            self.start()                    # first call, or the worker died or was killed on the last one
        if self.load_error:
            return COMPILE_ERROR, self.load_error
        self.conn.send(message)
        status, payload = self._receive(self.timeout_s, "running")
        if status == "error":
            return RUNTIME_ERROR, payload
        return status, payload

    def stop(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(2)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
        self.proc = None


def check_outputs(defn: Definition, outputs, devices: list[str], axes: dict, device: str) -> tuple[str, str]:
    """(status, log) of the outputs' count, types, shapes, dtypes and device against the definition."""
    specs = list(defn.outputs.items())
    if not isinstance(outputs, tuple) or len(outputs) != len(specs):
        n = len(outputs) if isinstance(outputs, tuple) else type(outputs).__name__
        return INCORRECT_SHAPE, f"returned {n} outputs, the definition has {len(specs)}"
    for (name, spec), t in zip(specs, outputs):
        if not isinstance(t, torch.Tensor):
            return INCORRECT_SHAPE, f"{name} is a {type(t).__name__}, not a tensor"
        shape = defn.shape(spec, axes)
        if tuple(t.shape) != shape:
            return INCORRECT_SHAPE, f"{name} has shape {tuple(t.shape)}, expected {shape}"
        if t.dtype != spec.torch_dtype:
            return INCORRECT_DTYPE, f"{name} is {t.dtype}, expected {spec.torch_dtype}"
    wrong = [d for d in devices if torch.device(d).type != torch.device(device).type]
    if wrong:
        return RUNTIME_ERROR, f"outputs on {wrong[0]}, the inputs on {device}"
    return PASSED, ""


def modified_input(pristine: dict, used: dict) -> str | None:
    for name, t in pristine.items():
        if not torch.equal(t, used[name]):
            return name
    return None


def program_layout(defn: Definition) -> tuple[tuple[str, ...], int]:
    """The axes every output starts with (one program each: here batch x heads) and the inputs that share them."""
    shapes = [s.shape for s in defn.outputs.values()]
    n = 0
    while all(len(s) > n and s[n] == shapes[0][n] for s in shapes):
        n += 1
    batched = tuple(name for name, s in defn.inputs.items() if s.shape[:n] == shapes[0][:n])
    return batched, n


def floor_ms(defn: Definition, axes: dict, bandwidth: float) -> float:
    """Every input read once and every output written once, at the measured copy rate."""
    nbytes = sum(math.prod(defn.shape(s, axes)) * s.torch_dtype.itemsize
                 for s in (*defn.inputs.values(), *defn.outputs.values()))
    return nbytes / bandwidth * 1e3


def evaluate(defn: Definition, sol: Solution, workloads: list[Workload], device: str, timeout_s: float = 300.0,
             on_result: Callable[[Result], None] = lambda r: None, timed: bool | None = None,
             bandwidth: float | None = None, root: str | Path = ".") -> list[Result]:
    """Judge one solution on each workload in its own worker process; on a GPU, time the ones that pass, each against
    the memory floor at `bandwidth` (bytes/s; measured now if not given). The workloads' blobs are under `root`."""
    timed = device == "cuda" if timed is None else timed
    if timed and bandwidth is None:
        bandwidth = timing.copy_bandwidth(device)
    op = load_op(defn.op_type)
    worker = Worker(sol, defn, device, timeout_s)
    results = []
    try:
        for w in workloads:
            result = Result(sol.name, w, PASSED)
            try:
                pristine = load_inputs(defn, w, device, root)
            except HarnessError as e:
                result.status, result.log = RUNTIME_ERROR, f"workload: {e}"
            else:
                _judge_one(defn, op, worker, pristine, result)
                if timed and result.status == PASSED:
                    _time_one(defn, op, worker, pristine, result, bandwidth)
                del pristine
            results.append(result)
            on_result(result)
    finally:
        worker.stop()
    return results


def _judge_one(defn, op, worker: Worker, pristine: dict, result: Result) -> None:
    axes = defn.resolve_axes(result.workload.axes)
    used = {k: v.clone() for k, v in pristine.items()}
    status, payload = worker.call("run", used, axes)
    if status != "ok":
        result.status, result.log = status, payload
        return
    outputs, devices = payload
    device = next(iter(pristine.values())).device
    result.status, result.log = check_outputs(defn, outputs, devices, axes, device.type)
    if result.status != PASSED:
        return
    name = modified_input(pristine, used)
    if name is not None:
        result.status, result.log = RUNTIME_ERROR, f"the solution modified its input {name!r}"
        return
    outputs = tuple(t.to(device) for t in outputs)
    verdict = op.judge(pristine, outputs, defn.reference_run()(**pristine))
    result.verdict = verdict
    if not verdict.passed:
        result.status, result.log = INCORRECT_NUMERICAL, verdict.reason


def _time_one(defn, op, worker: Worker, pristine: dict, result: Result, bandwidth: float) -> None:
    """Time the solution, judge the outputs of the timed calls, and refuse a physically impossible median."""
    axes = defn.resolve_axes(result.workload.axes)
    batched, n_prefix = program_layout(defn)
    n_programs = math.prod(pristine[batched[0]].shape[:n_prefix])
    perms, samples = timing.schedule(n_programs, result.workload.seed)
    status, payload = worker.call("time", {k: v.clone() for k, v in pristine.items()}, axes, batched, n_prefix,
                                  perms, samples)
    if status != "ok":
        result.status, result.log = status, f"while timing: {payload}"
        return
    t, sampled, last_outputs = payload
    device = next(iter(pristine.values())).device
    reference = defn.reference_run()
    flat = {k: (v.reshape(-1, *v.shape[n_prefix:]) if k in batched else v) for k, v in pristine.items()}
    timed_perms = perms[timing.WARMUP_CALLS:]
    checks = [(perm[sample], outs) for perm, sample, outs in zip(timed_perms, samples, sampled)]
    checks.append((timed_perms[-1], last_outputs))
    for k, (programs, outs) in enumerate(checks):
        programs = programs.to(device)
        inputs = {n: (v.index_select(0, programs)[None] if n in batched else v) for n, v in flat.items()}
        outs = tuple(o.to(device).reshape(1, -1, *o.shape[n_prefix if k == len(checks) - 1 else 1:])
                     for o in outs)
        verdict = op.judge(inputs, outs, reference(**inputs))
        if not verdict.passed:
            result.status = INCORRECT_NUMERICAL
            result.log = f"timed call {min(k, len(checks) - 2)}: {verdict.reason}"
            return
    result.latency_ms = t.median_ms
    result.floor_ms = floor_ms(defn, axes, bandwidth)
    if result.latency_ms < timing.IMPOSSIBLE_FRACTION * result.floor_ms:
        result.status = RUNTIME_ERROR
        result.log = (f"median {result.latency_ms * 1e3:.1f} us is below {timing.IMPOSSIBLE_FRACTION}x the memory "
                      f"floor {result.floor_ms * 1e3:.1f} us: physically impossible")
