"""harness.shared: memory the harness lends a worker. What the borrowing process writes is what the owner reads, at
the offsets the layout gives, on the CPU and (skipped without one) on a GPU."""
import os
import socket
import subprocess
import sys

import pytest
import torch

from harness import shared

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

SPECS = [(torch.int8, (3, 5)), (torch.float32, (7,)), (torch.float16, (2, 2))]

# a borrowing process: takes the fd from the socket, fills every view of two groups with its index + 1, exits
BORROWER = """
import socket, sys, torch
from harness import shared
sock = socket.socket(fileno=int(sys.argv[1]))
_, [fd], _, _ = socket.recv_fds(sock, 16, 1)
specs = [(torch.int8, (3, 5)), (torch.float32, (7,)), (torch.float16, (2, 2))]
lent = shared.Borrowed(fd, int(sys.argv[2]), sys.argv[3])
for k, group in enumerate(shared.views(lent.tensor, specs, 2)):
    for j, t in enumerate(group):
        t.fill_(10 * k + j + 1)
if sys.argv[3] != "cpu":
    torch.cuda.synchronize()
"""


def test_layout_aligns_every_tensor_and_views_cover_it():
    offsets, size = shared.layout(SPECS)
    assert offsets == [0, shared.ALIGN, 2 * shared.ALIGN] and size == 3 * shared.ALIGN
    buffer = torch.zeros(2 * size, dtype=torch.uint8)
    groups = shared.views(buffer, SPECS, 2)
    assert [(t.dtype, tuple(t.shape)) for t in groups[1]] == SPECS
    groups[1][1].fill_(1.0)
    assert buffer[size + shared.ALIGN:size + shared.ALIGN + 28].view(torch.float32).eq(1.0).all()
    with pytest.raises(ValueError, match="cannot hold"):
        shared.views(buffer, SPECS, 3)


def lend_to_a_process(device: str) -> torch.Tensor:
    lent = shared.Lent(2 * shared.layout(SPECS)[1], device)
    ours, theirs = socket.socketpair()
    try:
        socket.send_fds(ours, [b"x"], [lent.fd])
        done = subprocess.run([sys.executable, "-c", BORROWER, str(theirs.fileno()), str(lent.nbytes), device],
                              pass_fds=(theirs.fileno(),), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return [tuple(t.cpu().clone() for t in group) for group in shared.views(lent.tensor, SPECS, 2)]
    finally:
        ours.close()
        theirs.close()
        lent.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_what_a_borrower_writes_the_owner_reads(device):
    groups = lend_to_a_process(device)
    for k, group in enumerate(groups):
        for j, t in enumerate(group):
            assert t.eq(10 * k + j + 1).all(), (k, j, t)


def test_a_borrower_cannot_shrink_the_lent_memory():
    """Reads past the end of a shrunk memfd would kill the owner with SIGBUS: its size is sealed."""
    lent = shared.Lent(4096, "cpu")
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(lent.fd, 0)
        assert lent.tensor[-1].item() == 0
    finally:
        lent.close()
