"""Evaluate solutions on workloads: each solution runs in its own spawned worker process; loading, judging and
timing stay in this (the parent) process, out of the solution's reach. A crash, hang or exception in one solution
becomes a status for its workloads and never stops the others."""
from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from typing import Callable

import torch
import torch.multiprocessing as mp

from harness import HarnessError
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
STATUSES = (PASSED, INCORRECT_SHAPE, INCORRECT_DTYPE, INCORRECT_NUMERICAL, RUNTIME_ERROR, COMPILE_ERROR, TIMEOUT)


@dataclass
class Result:
    solution: str
    workload: Workload
    device: str
    status: str
    log: str = ""
    verdict: Verdict | None = None
    latency_ms: float | None = None


def _one_line(e: BaseException) -> str:
    """The exception as one line, with the deepest frame of the solution's own code when there is one."""
    msg = " ".join(str(e).split()) or "(no message)"
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/harness/" not in f.filename]
    where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    return f"{type(e).__name__}: {msg[:400]}{where}"


def _worker(conn, sol: Solution, defn: Definition, env: dict) -> None:
    """Child process: load the solution, then answer ("run", inputs, axes) messages with its outputs."""
    os.environ.update(env)
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
        _, inputs, axes = msg
        try:
            out = fn(inputs, axes)
            if inputs and next(iter(inputs.values())).is_cuda:
                torch.cuda.synchronize()
            conn.send(("ok", out))
        except BaseException as e:  # noqa: BLE001 - reported as the workload's RUNTIME_ERROR
            conn.send(("error", _one_line(e)))


class Worker:
    """A solution's process. `call` returns ("ok", outputs) or (status, one-line log)."""

    def __init__(self, sol: Solution, defn: Definition, device: str, timeout_s: float):
        self.sol, self.defn, self.device, self.timeout_s = sol, defn, device, timeout_s
        self.env = {"TRITON_INTERPRET": "1"} if device == "cpu" and sol.language == "triton" else {}
        self.proc = None
        self.load_error: str | None = None

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, self.sol, self.defn, self.env), daemon=True)
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

    def call(self, inputs: dict, axes: dict):
        if self.proc is None or not self.proc.is_alive():
            self.start()
        if self.load_error:
            return COMPILE_ERROR, self.load_error
        self.conn.send(("run", inputs, axes))
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


def check_outputs(defn: Definition, outputs, axes: dict, device: torch.device) -> tuple[str, str]:
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
        if t.device != device:
            return RUNTIME_ERROR, f"{name} is on {t.device}, the inputs on {device}"
    return PASSED, ""


def modified_input(pristine: dict, used: dict) -> str | None:
    for name, t in pristine.items():
        if not torch.equal(t, used[name]):
            return name
    return None


def evaluate(defn: Definition, sol: Solution, workloads: list[Workload], device: str, timeout_s: float = 300.0,
             on_result: Callable[[Result], None] = lambda r: None) -> list[Result]:
    """Judge one solution on each workload, in its own worker process."""
    op = load_op(defn.op_type)
    reference = defn.reference_run()
    worker = Worker(sol, defn, device, timeout_s)
    results = []
    try:
        for w in workloads:
            result = Result(sol.name, w, device, PASSED)
            try:
                pristine = load_inputs(defn, w, device)
            except HarnessError as e:
                result.status, result.log = RUNTIME_ERROR, f"workload: {e}"
            else:
                _judge_one(defn, op, reference, worker, pristine, result)
            results.append(result)
            on_result(result)
    finally:
        worker.stop()
    return results


def _judge_one(defn, op, reference, worker: Worker, pristine: dict, result: Result) -> None:
    axes = defn.resolve_axes(result.workload.axes)
    used = {k: v.clone() for k, v in pristine.items()}
    status, payload = worker.call(used, axes)
    if status != "ok":
        result.status, result.log = status, payload
        return
    outputs = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in payload) \
        if isinstance(payload, tuple) else payload
    result.status, result.log = check_outputs(defn, outputs, axes, next(iter(pristine.values())).device)
    if result.status != PASSED:
        return
    name = modified_input(pristine, used)
    if name is not None:
        result.status, result.log = RUNTIME_ERROR, f"the solution modified its input {name!r}"
        return
    verdict = op.judge(pristine, outputs, reference(**pristine))
    result.verdict = verdict
    if not verdict.passed:
        result.status, result.log = INCORRECT_NUMERICAL, verdict.reason
