"""The deployment form's caller-owned pool (docs/operator.md, "Deployment form") and the caller's contract on idx."""
from __future__ import annotations

import torch

from harness.ops.leapquant_kda_flush.layout import CHECKPOINT, DTYPES, WINDOW, WINDOW_RESET

# The caller-owned pool a serving engine flushes in place (docs/operator.md, "Deployment form"); solutions provide
# `flush_inplace(pool, idx, q0)` for it in their `pool.py`. The region of (slot, head) starts at byte
# POOL_HEADER + (33 slot + head) * POOL_REGION (32 heads and one spare region a slot) and its first CHECKPOINT_BYTES
# are the checkpoint: int8 codes [V, K] at +0, fp32 s_k [K] at +16,384, fp32 s_v [V] at +16,896, fp16 rows u | q
# [R, K + V] at +17,408. The rest of each region, the spare regions and the header belong to the caller.
POOL_HEADER = 49_152
POOL_REGION = 65_536
POOL_REGIONS_PER_SLOT = 33
POOL_OFFSETS = {"codes": 0, "s_k": 16_384, "s_v": 16_896, "u": 17_408, "q": 17_408 + 256}
CHECKPOINT_BYTES = 19_456
EMPTY_SCALE = 1e-12     # the scales of an empty checkpoint (the flush's clamp; the domain wants > 0)


class Pool:
    """One flat byte buffer in the published engine layout with typed views [num_slots, heads, ...] of the checkpoint
    fields (codes, s_k, s_v, u, q; `regions` [num_slots, 33, POOL_REGION] bytes), and beside it the dense window
    (kbuf, ubuf, gbuf, w), pcum and the int32 fill counter `count` [num_slots, heads]. Slot 0 is reserved (idx 0 means
    no sequence). Every checkpoint starts empty and every window reset. Shapes: the definition's, heads = 32,
    V = K = 128, R = 4, L = 16."""

    HEADS, V, K, R, L = 32, 128, 128, 4, 16

    def __init__(self, num_slots: int, device):
        if not isinstance(num_slots, int) or num_slots < 2:
            raise ValueError(f"num_slots must be an int >= 2 (slot 0 is reserved), got {num_slots!r}")
        H, V, K, R, L = self.HEADS, self.V, self.K, self.R, self.L
        self.num_slots = num_slots
        self.buffer = torch.zeros(POOL_HEADER + num_slots * POOL_REGIONS_PER_SLOT * POOL_REGION, dtype=torch.uint8,
                                  device=device)
        self.device = self.buffer.device        # with its index ("cuda:0"), as every tensor's device is
        self.regions = self.buffer[POOL_HEADER:].view(num_slots, POOL_REGIONS_PER_SLOT, POOL_REGION)
        self.codes = self._field(torch.int8, "codes", (V, K), K)
        self.s_k = self._field(torch.float32, "s_k", (K,), K)
        self.s_v = self._field(torch.float32, "s_v", (V,), V)
        self.u = self._field(torch.float16, "u", (R, K), K + V)
        self.q = self._field(torch.float16, "q", (R, V), K + V)
        self.s_k.fill_(EMPTY_SCALE)
        self.s_v.fill_(EMPTY_SCALE)

        def dense(*shape, dtype, fill=0.0):
            return torch.full((num_slots, H, *shape), fill, dtype=dtype, device=self.device)
        self.kbuf = dense(L, K, dtype=DTYPES["kbuf"])
        self.ubuf = dense(L, V, dtype=DTYPES["ubuf"])
        self.gbuf = dense(L, K, dtype=DTYPES["gbuf"], fill=WINDOW_RESET["gbuf"])
        self.w = dense(L, dtype=DTYPES["w"], fill=WINDOW_RESET["w"])
        self.pcum = dense(K, dtype=DTYPES["pcum"], fill=WINDOW_RESET["pcum"])
        self.count = dense(dtype=torch.int32)

    def write(self, slots, **tensors) -> None:
        """Put per-sequence tensors [N, heads, ...] (any of the checkpoint and window fields and count) into the
        slots `slots` [N]."""
        for name, t in tensors.items():
            if name not in (*CHECKPOINT, *WINDOW, "count"):
                raise ValueError(f"no pool field {name!r} (fields: {', '.join((*CHECKPOINT, *WINDOW, 'count'))})")
            getattr(self, name)[slots] = t

    def check_call(self, idx, q0) -> None:
        """What `flush_inplace(self, idx, q0)` may check without the values (no host synchronisation): raises
        ValueError in one line. idx's values are the caller's contract, checked by `check_idx`."""
        self.check_idx_tensor(idx)
        shape = (self.V, self.R)
        if not isinstance(q0, torch.Tensor) or q0.dtype != torch.float32 or tuple(q0.shape) != shape \
                or not q0.is_contiguous() or q0.device != self.device:
            got = f"{q0.dtype} {list(q0.shape)} on {q0.device}" if isinstance(q0, torch.Tensor) else type(q0).__name__
            raise ValueError(f"q0 must be a contiguous float32 {list(shape)} tensor on {self.device}, got {got}")

    def check_idx_tensor(self, idx) -> None:
        """idx is a contiguous 1-D int32 tensor on the pool's device, or ValueError in one line."""
        if not isinstance(idx, torch.Tensor) or idx.dtype != torch.int32 or idx.dim() != 1 or not idx.is_contiguous():
            got = f"{idx.dtype} {list(idx.shape)}" if isinstance(idx, torch.Tensor) else type(idx).__name__
            raise ValueError(f"idx must be a contiguous 1-D int32 tensor of slots, got {got}")
        if idx.device != self.device:
            raise ValueError(f"idx is on {idx.device}, the pool on {self.device}")

    def _field(self, dtype, name: str, shape: tuple, row: int) -> torch.Tensor:
        """[num_slots, heads, *shape] view of a checkpoint field in every region; the last dim contiguous, the one
        before it `row` elements apart."""
        size = dtype.itemsize
        per_region = POOL_REGION // size
        inner = (row, 1) if len(shape) == 2 else (1,)
        return self.buffer.view(dtype).as_strided((self.num_slots, self.HEADS, *shape),
                                                  (POOL_REGIONS_PER_SLOT * per_region, per_region, *inner),
                                                  (POOL_HEADER + POOL_OFFSETS[name]) // size)


def check_idx(pool: Pool, idx) -> None:
    """The caller's contract on idx, checked on the host (a synchronisation): every value in [0, num_slots) and no
    slot twice (0 may repeat). Raises ValueError in one line."""
    pool.check_idx_tensor(idx)
    values = idx.cpu()
    bad = values[(values < 0) | (values >= pool.num_slots)]
    if bad.numel():
        raise ValueError(f"idx holds slot {int(bad[0])}, outside [0, {pool.num_slots})")
    used, counts = values[values != 0].unique(return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"idx holds slot {int(used[counts > 1][0])} more than once")
