"""The message format between the harness and a solution's worker: nothing that crosses it is executed.

A message is one JSON object (length-prefixed, at most MAX_HEADER bytes) plus, when it carries tensors, one sealed
memfd holding their bytes back to back, passed as a file descriptor over the Unix socket. The JSON lists each
tensor as {"name", "dtype", "shape", "offset"}; the receiver checks the dtype against a fixed list, the shape and
offsets against the file's size, that the file is a sealed memfd (so the sender can no longer change it), and builds
plain dense torch tensors from the bytes. Every receive has a deadline: a sender that stalls mid-message, sends
garbage, too much or the wrong kind of file gets a WireError with one line, never a hang or foreign code run.
"""
from __future__ import annotations

import fcntl
import json
import math
import mmap
import os
import socket
import stat
import struct
import time

import torch

MAX_HEADER = 1 << 22
MAX_TENSOR_BYTES = 1 << 36      # 64 GiB: the worker's bound on the harness's (trusted) requests
_LENGTH = struct.Struct("<Q")
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
# no bool: a byte other than 0 or 1 is not one
def dtype_name(dtype: torch.dtype) -> str:
    """How a message names a dtype (FlashInfer-bench's name: torch's without "torch.")."""
    return str(dtype).removeprefix("torch.")


DTYPES = {dtype_name(d): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)}
_ALIGN = 64
MAX_PADDING = 16 * _ALIGN       # what alignment adds to a message of a dozen tensors


class WireError(Exception):
    """A malformed, late or oversized message; str() is one line."""


def _pack(tensors: dict[str, torch.Tensor]) -> tuple[list[dict], int | None]:
    """The tensors' descriptors and a sealed memfd of their bytes (None when there are none)."""
    if not tensors:
        return [], None
    specs, offset = [], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        specs.append({"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape),
                      "offset": offset})
        offset += -(-nbytes // _ALIGN) * _ALIGN
    fd = os.memfd_create("wire", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, max(offset, 1))
        with mmap.mmap(fd, max(offset, 1)) as buf:
            for spec, t in zip(specs, tensors.values()):
                if t.numel():
                    dst = torch.frombuffer(buf, dtype=torch.uint8, count=t.numel() * t.element_size(),
                                           offset=spec["offset"])
                    dst.copy_(t.detach().contiguous().view(-1).view(torch.uint8))
                    del dst
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return specs, fd


def send(sock: socket.socket, header: dict, tensors: dict[str, torch.Tensor] | None = None,
         lend: int | None = None) -> None:
    """Send header and tensors; `lend`, a file descriptor of memory the sender owns (harness.shared), goes with them
    (the sender keeps its own copy of the descriptor)."""
    specs, fd = _pack(tensors or {})
    body = json.dumps({**header, "tensors": specs, "lent": lend is not None}, allow_nan=False).encode()
    data = _LENGTH.pack(len(body)) + body
    fds = [f for f in (fd, lend) if f is not None]
    try:
        if not fds:
            sock.sendall(data)
        else:
            sent = socket.send_fds(sock, [data], fds)
            if sent < len(data):
                sock.sendall(data[sent:])
    finally:
        if fd is not None:
            os.close(fd)


def _recv(sock: socket.socket, n: int, deadline: float, fds: list[int]) -> bytes:
    """Exactly n bytes before the deadline, collecting any file descriptors that arrive with them."""
    chunks, got = [], 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        try:
            data, new_fds, flags, _ = socket.recv_fds(sock, n - got, 4)
        except socket.timeout:
            raise TimeoutError from None
        fds.extend(new_fds)
        if flags & socket.MSG_CTRUNC:
            raise WireError("the message carried more file descriptors than it may")
        if not data:
            raise EOFError
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


def receive(sock: socket.socket, timeout_s: float, max_bytes: int,
            borrows: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """(header, tensors) of the next message. TimeoutError when it is not complete within timeout_s, EOFError when
    the peer closed, WireError when it is malformed or its tensors take more than max_bytes (the receiver's bound
    for what it asked: 0 for a reply that carries no tensors; the tensors are copied into the receiver's memory).
    A message that lends memory is refused unless `borrows` (the worker's side); then header["lent_fd"] is its file
    descriptor, the caller's to close."""
    deadline = time.monotonic() + timeout_s
    fds: list[int] = []
    try:
        (length,) = _LENGTH.unpack(_recv(sock, _LENGTH.size, deadline, fds))
        if length > MAX_HEADER:
            raise WireError(f"message header of {length} bytes (limit {MAX_HEADER})")
        try:
            header = json.loads(_recv(sock, length, deadline, fds), parse_constant=_no_constant)
        except (ValueError, RecursionError) as e:      # bad UTF-8, bad JSON, integers too long to convert
            raise WireError(f"message is not JSON ({type(e).__name__})") from None
        if not isinstance(header, dict) or not isinstance(header.get("tensors"), list):
            raise WireError("message is not a JSON object with a 'tensors' list")
        lent = header.pop("lent", False) is True
        if lent and not borrows:
            raise WireError("the message lends memory")
        if len(fds) != bool(header["tensors"]) + lent:
            raise WireError(f"message carries {len(fds)} files for {len(header['tensors'])} tensors")
        if lent:
            header["lent_fd"] = fds.pop()
        tensors = _unpack(header.pop("tensors"), fds[0] if fds else None, max_bytes)
        return header, tensors
    finally:
        for fd in fds:
            os.close(fd)


def _no_constant(name):
    raise WireError(f"message holds {name}")


def _unpack(specs: list, fd: int | None, max_bytes: int) -> dict[str, torch.Tensor]:
    if not specs:
        return {}
    parsed = [_spec(spec) for spec in specs]
    needed = max(offset + math.prod(shape) * dtype.itemsize for _, dtype, shape, offset in parsed)
    if needed > max_bytes:
        raise WireError(f"the message's tensors take {needed} bytes (limit {max_bytes})")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise WireError("the tensor file is not a regular file")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if seals & _SEALS != _SEALS:
        raise WireError("the tensor file is not a sealed memfd")
    size = st.st_size
    if not needed <= size <= needed + _ALIGN:
        raise WireError(f"the tensor file holds {size} bytes for tensors of {needed}")
    if needed == 0:
        return {name: torch.empty(shape, dtype=dtype) for name, dtype, shape, _ in parsed}
    tensors = {}
    try:
        buf = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as e:
        raise WireError(f"the tensor file cannot be mapped ({type(e).__name__})") from None
    with buf:
        for name, dtype, shape, offset in parsed:
            nbytes = math.prod(shape) * dtype.itemsize
            if name in tensors:
                raise WireError(f"tensor {name!r} sent twice")
            flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset) if nbytes else \
                torch.empty(0, dtype=torch.uint8)
            try:
                tensors[name] = flat.clone().view(dtype).reshape(shape)
            except (RuntimeError, MemoryError):
                raise WireError(f"tensor {name!r} of {nbytes} bytes does not fit in memory") from None
            finally:
                del flat
    return tensors


def _spec(spec) -> tuple[str, torch.dtype, list[int], int]:
    if not isinstance(spec, dict) or set(spec) != {"name", "dtype", "shape", "offset"}:
        raise WireError("a tensor descriptor is not {name, dtype, shape, offset}")
    name, dtype, shape, offset = spec["name"], spec["dtype"], spec["shape"], spec["offset"]
    if not isinstance(name, str) or len(name) > 200:
        raise WireError("a tensor name is not a short string")
    if dtype not in DTYPES:
        raise WireError(f"tensor {name!r} has dtype {str(dtype)[:40]!r}")
    if not isinstance(shape, list) or len(shape) > 16 or \
            not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 1 << 40 for n in shape):
        raise WireError(f"tensor {name!r} has shape {str(shape)[:60]}")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0 or offset % _ALIGN:
        raise WireError(f"tensor {name!r} has offset {str(offset)[:40]}")
    return name, DTYPES[dtype], shape, offset
