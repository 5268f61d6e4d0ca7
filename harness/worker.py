"""A solution's worker process: `python -m harness.worker FD`, started by harness.runner inside the sandbox.

It loads the solution named in the first message and answers requests on the socket FD (harness.wire messages):
"run" (the outputs of one call), the timed loop's "time_prepare" (which lends the memory the timed calls' outputs go
to), "time_pool" and "time_run" (harness.timing.TimedLoop; the harness kills the worker after that reply), the
deployment form's "deploy_case" and "deploy_empty" (harness.deploy: the solution's pool.py, imported at the first
such request), and "stop". Everything it sends is data that the harness checks; nothing in this process is trusted,
since the solution's code runs in it.
"""
from __future__ import annotations

import functools
import gc
import os
import socket
import sys
import traceback
from pathlib import Path

import torch

from harness import deploy, one_line, shared, timing, wire
from harness.definition import parse_definition
from harness.ops import load_op
from harness.solutions import REFERENCE, Solution, load_entry, load_module, reference_solution

WAIT_FOREVER = 1e9


def _one_line(e: BaseException) -> str:
    """The exception as one line, with the deepest frame of the solution's own code when there is one."""
    msg = one_line(e) or "(no message)"
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/harness/" not in f.filename]
    where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    return f"{type(e).__name__}: {msg[:400]}{where}"


def describe_outputs(out) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """What a call returned, as descriptors the harness checks (a plain dense tensor, or what else it was) and the
    tensors to send (moved to the CPU)."""
    if not isinstance(out, tuple):
        return [{"kind": type(out).__name__}], {}
    specs, tensors = [], {}
    for i, t in enumerate(out):
        if type(t) is not torch.Tensor:
            specs.append({"kind": type(t).__name__})
        elif t.layout != torch.strided:
            specs.append({"kind": f"tensor with layout {t.layout}"})
        else:
            specs.append({"kind": "tensor", "device": str(t.device)})
            tensors[f"out{i}"] = t.detach().cpu()
    return specs, tensors


def _load(msg: dict, defn) -> Solution:
    spec = msg["solution"]
    if spec["name"] == REFERENCE:
        return reference_solution(defn)
    return Solution(spec["name"], defn.name, "", spec["language"], spec["entry_file"], spec["entry_function"],
                    spec["destination_passing_style"], sources=tuple(spec["sources"]),
                    folder=Path(msg["solution_dir"]))


def serve(sock: socket.socket) -> None:
    msg, _ = wire.receive(sock, WAIT_FOREVER, wire.MAX_TENSOR_BYTES)
    device = msg["device"]
    if device == "cpu":
        # one intra-op thread: with more, torch's CPU matmuls came out with other roundings in about one start in
        # ten, enough to flip a sensitive edge head across the criterion from one identical run to the next
        torch.set_num_threads(1)
    try:
        defn = parse_definition(msg["definition"], "definition")
        op = load_op(defn.op_type)
        sol = _load(msg, defn)
        fn = load_entry(sol, defn)
    except BaseException as e:  # noqa: BLE001 - any failure to load is the solution's compile error
        wire.send(sock, {"status": "compile_error", "message": _one_line(e)})
        return
    wire.send(sock, {"status": "ready"})
    loop = flush_inplace = None
    while True:
        try:
            msg, tensors = wire.receive(sock, WAIT_FOREVER, wire.MAX_TENSOR_BYTES, borrows=True)
        except EOFError:
            return
        request = msg["op"]
        lent_fd = msg.pop("lent_fd", None)
        if lent_fd is not None and request not in ("time_prepare", "run"):
            os.close(lent_fd)
        if request == "stop":
            return
        try:
            if request == "run":
                # the inputs lie in memory the harness lent, which it compares with its own copy after the reply
                lent = shared.Borrowed(lent_fd, msg["lent_bytes"], device)
                try:
                    names = [name for name, _, _ in msg["inputs"]]
                    specs = [(wire.DTYPES[dtype], tuple(shape)) for _, dtype, shape in msg["inputs"]]
                    inputs = dict(zip(names, shared.views(lent.tensor, specs, 1)[0]))
                    described, out = describe_outputs(fn(inputs, msg["axes"]))
                    inputs = None
                finally:
                    lent.release()
                wire.send(sock, {"status": "ok", "outputs": described}, out)
            elif request == "time_prepare":
                # the last workload's graphs and their private memory pools returned to the device before this
                # workload's are captured: cached, they held tens of GB at large batches, enough to run an 80 GB
                # card (shared with the harness's own process) out of memory
                loop = None
                if device == "cuda":
                    gc.collect()
                    torch.cuda.empty_cache()
                warm = {k: v.to(device) for k, v in tensors.items()}
                specs = [(wire.DTYPES[dtype], tuple(shape)) for dtype, shape in msg["outputs"]]
                # never released: the harness kills this process after the timed loop's reply
                slots = shared.views(shared.Borrowed(lent_fd, msg["lent_bytes"], device).tensor, specs,
                                     msg["n_calls"])
                # the loop poisons each call's outputs before it, outside the timed region
                loop = timing.TimedLoop(functools.partial(fn, fill=False), warm, msg["axes"], msg["batched"],
                                        msg["n_prefix"], msg["n_calls"], op, msg["warmup_replays"], slots,
                                        msg["mix_parts"])
                wire.send(sock, {"status": "ok"})
            elif request == "time_pool":
                loop.load_pool(tensors)
                # freed now, not when the next request replaces them: unmapping the pool's file took ~25 ms that the
                # harness's clock charged to the first timed loop
                msg = tensors = None
                gc.collect()    # before the clock starts: the timed request then runs with collection off
                wire.send(sock, {"status": "ok"})
            elif request == "time_run":
                gc.disable()    # no collection pause between the harness's clock and the loop
                try:
                    latencies = loop.run(int(msg["seed"]))
                    wire.send(sock, {"status": "ok", "latencies_ms": latencies, "loop_ms": loop.loop_ms})
                finally:
                    gc.enable()
            elif request == "deploy_case":
                if flush_inplace is None:
                    flush_inplace = load_module(sol, deploy.DEPLOYMENT_SOURCE).flush_inplace
                inputs = {k: v.to(device) for k, v in tensors.items()}
                count, slots = inputs.pop("count"), inputs.pop("slots")
                median, marginal, state = deploy.run_case(flush_inplace, op, inputs, count, slots, msg["in_graph"],
                                                          msg["warmup"])
                wire.send(sock, {"status": "ok", "median_ms": median, "marginal_ms": marginal},
                          {k: v.cpu() for k, v in state.items()})
            elif request == "deploy_empty":
                empty_us = deploy.empty_graph_us(device, msg["calls"], msg["warmup"])
                wire.send(sock, {"status": "ok", "empty_graph_us": empty_us})
            else:
                raise ValueError(f"unknown request {request!r}")
        except BaseException as e:  # noqa: BLE001 - reported as the workload's RUNTIME_ERROR
            wire.send(sock, {"status": "error", "message": _one_line(e)})


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    try:
        serve(sock)
    finally:
        sock.close()
        sys.stdout.flush()
        os._exit(0)         # no atexit hooks of the solution's: the harness has its answers


if __name__ == "__main__":
    main()
