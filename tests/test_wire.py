"""harness.wire through a socketpair: tensors of every dtype come back bit for bit, and whatever a hostile worker
sends instead (a stall, a trickle, too much, not JSON, a bad descriptor, the wrong kind or number of files) ends in
TimeoutError, EOFError or a one-line WireError before the deadline, never a hang or another exception."""
import fcntl
import json
import os
import socket
import struct
import threading
import time

import pytest
import torch

from harness import wire

SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
DEADLINE_S = 0.5


@pytest.fixture
def pair():
    """(sender, receiver): the worker's end and the harness's end."""
    sender, receiver = socket.socketpair()
    yield sender, receiver
    sender.close()
    receiver.close()


def frame(body: bytes) -> bytes:
    return struct.pack("<Q", len(body)) + body


def sealed_memfd(size: int, data: bytes = b"") -> int:
    fd = os.memfd_create("forged", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    os.pwrite(fd, data, 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def send_raw(sock, header: dict, fds: list[int]) -> None:
    """A message framed as wire.send frames it, with any header and files: what a forging worker can send."""
    socket.send_fds(sock, [frame(json.dumps(header).encode())], fds)
    for fd in fds:
        os.close(fd)


def descriptor(**changes) -> dict:
    return {"name": "out0", "dtype": "float32", "shape": [4], "offset": 0, **changes}


def receive_error(receiver) -> str:
    with pytest.raises(wire.WireError) as e:
        wire.receive(receiver, DEADLINE_S, wire.MAX_TENSOR_BYTES)
    assert "\n" not in str(e.value)
    return str(e.value)


def sample(dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """Values that use the dtype's whole byte pattern range (random bytes, NaN patterns included for floats)."""
    g = torch.Generator().manual_seed(len(shape) * 131 + dtype.itemsize)
    n = torch.Size(shape).numel() * dtype.itemsize
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and \
        torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_tensors_of_every_dtype_round_trip(pair):
    sender, receiver = pair
    tensors = {}
    for name, dtype in wire.DTYPES.items():
        tensors[f"{name}_2d"] = sample(dtype, (3, 5))
        tensors[f"{name}_0d"] = sample(dtype, ())
        tensors[f"{name}_empty"] = sample(dtype, (0, 7))
    tensors["strided"] = sample(torch.float32, (6, 4)).t()       # sent as its values, contiguous
    wire.send(sender, {"op": "run", "axes": {"batch_size": 1}}, tensors)
    header, received = wire.receive(receiver, DEADLINE_S, wire.MAX_TENSOR_BYTES)
    assert header == {"op": "run", "axes": {"batch_size": 1}}
    assert list(received) == list(tensors)
    for name, t in tensors.items():
        assert same_bits(t, received[name]), name


def test_message_without_tensors_carries_no_file(pair):
    sender, receiver = pair
    wire.send(sender, {"op": "stop"})
    assert wire.receive(receiver, DEADLINE_S, wire.MAX_TENSOR_BYTES) == ({"op": "stop"}, {})


def test_sender_refuses_nan_in_a_header(pair):
    with pytest.raises(ValueError):
        wire.send(pair[0], {"latencies_ms": [float("nan")]})


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_constants_rejected(pair, constant):
    sender, receiver = pair
    sender.sendall(frame(b'{"tensors": [], "latencies_ms": [%s]}' % constant.encode()))
    assert constant in receive_error(receiver)


def test_header_then_stall_times_out_at_the_deadline(pair):
    sender, receiver = pair
    sender.sendall(struct.pack("<Q", 100) + b'{"tensors"')
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        wire.receive(receiver, DEADLINE_S, wire.MAX_TENSOR_BYTES)
    assert time.monotonic() - t0 < DEADLINE_S + 0.5


def test_a_trickle_does_not_extend_the_deadline(pair):
    """One byte every 50 ms keeps every single recv short: the deadline is for the whole message."""
    sender, receiver = pair
    data = frame(b'{"tensors": [], "pad": "' + b"x" * 200 + b'"}')
    stop = threading.Event()

    def trickle():
        for i in range(len(data)):
            if stop.wait(0.05):
                return
            sender.send(data[i:i + 1])
    thread = threading.Thread(target=trickle)
    thread.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            wire.receive(receiver, DEADLINE_S, wire.MAX_TENSOR_BYTES)
        assert time.monotonic() - t0 < DEADLINE_S + 0.5
    finally:
        stop.set()
        thread.join()


def test_oversized_header_refused_before_it_is_read(pair):
    sender, receiver = pair
    sender.sendall(struct.pack("<Q", wire.MAX_HEADER + 1))
    assert f"{wire.MAX_HEADER + 1} bytes" in receive_error(receiver)


@pytest.mark.parametrize("body", [b"\x80\x04\x95 a pickle, not JSON", b"\xff\xfe\xfd", b'{"tensors": [', b"[1, 2]",
                                  b'{"no tensors list": 1}', b"[" * 100_000])
def test_a_body_that_is_not_a_json_object_with_tensors_is_refused(pair, body):
    sender, receiver = pair
    sender.sendall(frame(body))
    receive_error(receiver)


def test_an_integer_too_long_to_parse_is_refused(pair):
    """json.loads raises a plain ValueError, not JSONDecodeError, for an integer of more than 4300 digits."""
    sender, receiver = pair
    sender.sendall(frame(b'{"tensors": [], "n": ' + b"9" * 5000 + b"}"))
    receive_error(receiver)


@pytest.mark.parametrize("change, says", [
    ({"offset": 64}, "bytes for tensors of"),
    ({"offset": 1 << 62}, "limit"),
    ({"offset": -64}, "has offset"),
    ({"offset": 3}, "has offset"),
    ({"offset": True}, "has offset"),
    ({"dtype": "bool"}, "has dtype"),
    ({"dtype": "object"}, "has dtype"),
    ({"shape": [1 << 40]}, "has shape"),
    ({"shape": [-1]}, "has shape"),
    ({"shape": [1] * 17}, "has shape"),
    ({"shape": [1 << 30, 1 << 30]}, "limit"),
    ({"name": ["out0"]}, "not a short string"),
    ({"extra": 1}, "not {name, dtype, shape, offset}"),
])
def test_a_bad_descriptor_is_refused(pair, change, says):
    sender, receiver = pair
    send_raw(sender, {"tensors": [descriptor(**change)]}, [sealed_memfd(64)])
    assert says in receive_error(receiver)


def test_a_tensor_sent_twice_is_refused(pair):
    sender, receiver = pair
    send_raw(sender, {"tensors": [descriptor(), descriptor()]}, [sealed_memfd(64)])
    assert "sent twice" in receive_error(receiver)


def test_an_empty_file_holds_only_empty_tensors(pair):
    """mmap refuses an empty file: an empty tensor is built without it, and a non-empty one is refused."""
    sender, receiver = pair
    send_raw(sender, {"tensors": [descriptor(shape=[0])]}, [sealed_memfd(0)])
    _, tensors = wire.receive(receiver, 5, wire.MAX_TENSOR_BYTES)
    assert [t.numel() for t in tensors.values()] == [0]
    send_raw(sender, {"tensors": [descriptor(shape=[1])]}, [sealed_memfd(0)])
    assert "holds 0 bytes" in receive_error(receiver)


def test_a_file_larger_than_memory_is_refused(pair):
    """2**49 bytes (more than any user address space; never paged in): refused by its declared size, before any
    mapping, as is any message over the receiver's limit."""
    sender, receiver = pair
    send_raw(sender, {"tensors": [descriptor(dtype="uint8", shape=[1 << 39, 1 << 10])]}, [sealed_memfd(1 << 49)])
    receive_error(receiver)


def test_a_regular_file_is_refused(pair, tmp_path):
    sender, receiver = pair
    path = tmp_path / "not_a_memfd"
    path.write_bytes(bytes(64))
    send_raw(sender, {"tensors": [descriptor()]}, [os.open(path, os.O_RDONLY)])
    assert "not a sealed memfd" in receive_error(receiver)


def test_an_unsealed_memfd_is_refused(pair):
    """Its sender could still change the bytes after the receiver checked them."""
    sender, receiver = pair
    fd = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 64)
    send_raw(sender, {"tensors": [descriptor()]}, [fd])
    assert "not a sealed memfd" in receive_error(receiver)


def test_a_pipe_is_refused(pair):
    sender, receiver = pair
    read_end, write_end = os.pipe()
    os.close(write_end)
    send_raw(sender, {"tensors": [descriptor()]}, [read_end])
    assert "not a regular file" in receive_error(receiver)


@pytest.mark.parametrize("n_files", [2, 5])
def test_more_than_one_file_is_refused(pair, n_files):
    """5 is more than the receiver takes at once (its control buffer holds 4): truncated, still refused."""
    sender, receiver = pair
    send_raw(sender, {"tensors": [descriptor()]}, [sealed_memfd(64) for _ in range(n_files)])
    receive_error(receiver)


def test_tensors_without_a_file_are_refused(pair):
    sender, receiver = pair
    sender.sendall(frame(json.dumps({"tensors": [descriptor()]}).encode()))
    assert "0 files for 1 tensors" in receive_error(receiver)


def test_received_files_are_closed(pair):
    """Refused or not, no descriptor of the sender's stays open in the receiver."""
    sender, receiver = pair
    before = set(os.listdir("/proc/self/fd"))
    send_raw(sender, {"tensors": [descriptor(dtype="bool")]}, [sealed_memfd(64), sealed_memfd(64)])
    receive_error(receiver)
    wire.send(sender, {"op": "run"}, {"x": torch.ones(3)})
    wire.receive(receiver, DEADLINE_S, wire.MAX_TENSOR_BYTES)
    assert set(os.listdir("/proc/self/fd")) == before


def test_peer_closed_raises_eof(pair):
    sender, receiver = pair
    sender.close()
    with pytest.raises(EOFError):
        wire.receive(receiver, DEADLINE_S, wire.MAX_TENSOR_BYTES)


def test_peer_closed_mid_message_raises_eof(pair):
    sender, receiver = pair
    sender.sendall(struct.pack("<Q", 100) + b'{"tens')
    sender.close()
    with pytest.raises(EOFError):
        wire.receive(receiver, DEADLINE_S, wire.MAX_TENSOR_BYTES)


def test_lent_memory_reaches_only_a_receiver_that_borrows(pair):
    """The harness lends memory to its worker (harness.shared); a worker cannot push a file onto the harness so."""
    sender, receiver = pair
    fd = os.memfd_create("lent", 0)
    try:
        wire.send(sender, {"op": "run"}, {"x": torch.arange(4.0)}, lend=fd)
        header, tensors = wire.receive(receiver, DEADLINE_S, wire.MAX_TENSOR_BYTES, borrows=True)
        assert torch.equal(tensors["x"], torch.arange(4.0))
        assert os.fstat(header["lent_fd"]).st_ino == os.fstat(fd).st_ino
        os.close(header["lent_fd"])
        wire.send(sender, {"status": "ok"}, None, lend=fd)
        with pytest.raises(wire.WireError, match="lends memory"):
            wire.receive(receiver, DEADLINE_S, 0)
    finally:
        os.close(fd)
