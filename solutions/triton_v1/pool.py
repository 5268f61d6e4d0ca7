# SPDX-License-Identifier: Apache-2.0
"""The deployment form of the flush: a caller-owned pool updated in place (OPERATOR.md, "Deployment form").

`Pool(num_slots, device)` owns one flat byte buffer in the published engine layout: the region of (slot, head)
starts at byte HEADER + (33 slot + head) * REGION (32 heads and one spare region a slot) and its first
CHECKPOINT_BYTES bytes are the checkpoint: int8 codes [V, K] at +0, fp32 s_k [K] at +16,384, fp32 s_v [V] at +16,896,
fp16 rows u | q [R, K + V] at +17,408. The rest of each region, the spare regions and the HEADER bytes belong to the
caller and are never written. Beside the buffer, dense [slots, heads, ...] tensors: the window (kbuf, ubuf, gbuf,
w), pcum and the int32 fill counter, plus the kernel's scratch. Slot 0 is reserved: idx 0 means no sequence.

`flush_inplace(pool, idx, q0)` launches kernel.py's `_flush_kernel` (the one `run` uses, in its pool mode) with
one program per (sequence, head); a program whose slot is not full (counter != L) returns at once. It does no host
synchronisation and no allocation, so it can be captured in a CUDA graph and replayed with new pool contents; it
compiles on its first call (and again only for an idx tensor of different 16-byte alignment).

The caller's contract on idx's values (checking them needs the values on the host, which would break graph
capture): every value in [0, num_slots) and no slot twice. `check_idx` checks it, with a host synchronisation,
where the caller builds idx. In the kernel a slot out of range is treated as no sequence (nothing is read or
written), so a broken contract cannot write outside the pool; a slot given twice is flushed by two programs at
once and its checkpoint is undefined.
"""
import torch

from kernel import launch

HEADS, V, K, R, L = 32, 128, 128, 4, 16
HEADER = 49_152
REGION = 65_536
REGIONS_PER_SLOT = HEADS + 1
CODES_AT = 0
S_K_AT = CODES_AT + V * K               # 16,384
S_V_AT = S_K_AT + 4 * K                 # 16,896
TOKENS_AT = S_V_AT + 4 * V              # 17,408: fp16 rows u | q
CHECKPOINT_BYTES = TOKENS_AT + 2 * R * (K + V)     # 19,456
FIELDS = ("codes", "s_k", "s_v", "u", "q", "kbuf", "ubuf", "gbuf", "w", "pcum", "count")
EMPTY_SCALE = 1e-12                     # the scales of an empty checkpoint (the flush's clamp; the domain wants > 0)


class Pool:
    """The buffer, its typed views [num_slots, HEADS, ...] (codes, s_k, s_v, u, q; `regions` [num_slots, 33, REGION]
    bytes), the dense window, pcum and count tensors. Every checkpoint starts empty and every window reset."""

    def __init__(self, num_slots: int, device):
        if not isinstance(num_slots, int) or num_slots < 2:
            raise ValueError(f"num_slots must be an int >= 2 (slot 0 is reserved), got {num_slots!r}")
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.buffer = torch.zeros(HEADER + num_slots * REGIONS_PER_SLOT * REGION, dtype=torch.uint8,
                                  device=self.device)
        self.regions = self.buffer[HEADER:].view(num_slots, REGIONS_PER_SLOT, REGION)
        self.codes = self._field(torch.int8, CODES_AT, (V, K), K)
        self.s_k = self._field(torch.float32, S_K_AT, (K,), K)
        self.s_v = self._field(torch.float32, S_V_AT, (V,), V)
        self.u = self._field(torch.float16, TOKENS_AT, (R, K), K + V)
        self.q = self._field(torch.float16, TOKENS_AT + 2 * K, (R, V), K + V)
        self.s_k.fill_(EMPTY_SCALE)
        self.s_v.fill_(EMPTY_SCALE)
        dense = lambda *shape, dtype, fill=0.0: torch.full((num_slots, HEADS, *shape), fill, dtype=dtype,  # noqa: E731
                                                            device=self.device)
        self.kbuf = dense(L, K, dtype=torch.bfloat16)
        self.ubuf = dense(L, V, dtype=torch.bfloat16)
        self.gbuf = dense(L, K, dtype=torch.float16, fill=1.0)
        self.w = dense(L, dtype=torch.float32)
        self.pcum = dense(K, dtype=torch.float32)
        self.count = dense(dtype=torch.int32, fill=0)
        # 16 KB a (slot, head) for the kernel's vectors and A rows: in the functional form they go through the output's
        # codes region, which here is the codes the kernel is still reading
        self.scratch = torch.empty((num_slots * HEADS, V * K), dtype=torch.int8, device=self.device)

    def write(self, slots, **tensors) -> None:
        """Put per-sequence tensors [N, HEADS, ...] (any of codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, count)
        into the slots `slots` [N]."""
        for name, t in tensors.items():
            if name not in FIELDS:
                raise ValueError(f"no pool field {name!r} (fields: {', '.join(FIELDS)})")
            getattr(self, name)[slots] = t

    def _field(self, dtype, offset: int, shape: tuple, row: int) -> torch.Tensor:
        """[num_slots, HEADS, *shape] view of the field at byte `offset` of every region; the last dim contiguous,
        the one before it `row` elements apart."""
        size = dtype.itemsize
        per_region = REGION // size
        inner = (row, 1) if len(shape) == 2 else (1,)
        return self.buffer.view(dtype).as_strided((self.num_slots, HEADS, *shape),
                                                  (REGIONS_PER_SLOT * per_region, per_region, *inner),
                                                  (HEADER + offset) // size)


def _check_idx_tensor(pool: Pool, idx) -> None:
    if not isinstance(idx, torch.Tensor) or idx.dtype != torch.int32 or idx.dim() != 1 or not idx.is_contiguous():
        got = f"{idx.dtype} {list(idx.shape)}" if isinstance(idx, torch.Tensor) else type(idx).__name__
        raise ValueError(f"idx must be a contiguous 1-D int32 tensor of slots, got {got}")
    if idx.device != pool.device:
        raise ValueError(f"idx is on {idx.device}, the pool on {pool.device}")


def check_idx(pool: Pool, idx) -> None:
    """The caller's contract on idx (module docstring), checked on the host: raises ValueError in one line."""
    _check_idx_tensor(pool, idx)
    values = idx.cpu()
    bad = values[(values < 0) | (values >= pool.num_slots)]
    if bad.numel():
        raise ValueError(f"idx holds slot {int(bad[0])}, outside [0, {pool.num_slots})")
    used, counts = values[values != 0].unique(return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"idx holds slot {int(used[counts > 1][0])} more than once")


def flush_inplace(pool: Pool, idx: torch.Tensor, q0: torch.Tensor) -> None:
    """Flush in place every (idx[n], head) whose counter is L and reset its window (w = 0, pcum = 0, gbuf = 1; the
    counter stays L); everything else stays as it is. idx: int32 [N] slots (0 = no sequence), on the pool's device,
    under the contract of the module docstring; q0: float32 [V, R]."""
    _check_idx_tensor(pool, idx)     # metadata only: no host synchronisation
    if not isinstance(q0, torch.Tensor) or q0.dtype != torch.float32 or tuple(q0.shape) != (V, R) \
            or not q0.is_contiguous() or q0.device != pool.device:
        got = f"{q0.dtype} {list(q0.shape)} on {q0.device}" if isinstance(q0, torch.Tensor) else type(q0).__name__
        raise ValueError(f"q0 must be a contiguous float32 [{V}, {R}] tensor on {pool.device}, got {got}")
    if idx.numel():
        checkpoint = (pool.codes, pool.s_k, pool.s_v, pool.u, pool.q)
        launch(idx.numel() * HEADS, (*checkpoint, pool.kbuf, pool.ubuf, pool.gbuf, pool.w, pool.pcum, q0, *checkpoint),
               V, K, L, R, idx_ptr=idx, count_ptr=pool.count, scratch_ptr=pool.scratch, num_slots=pool.num_slots,
               POOL=True, H=HEADS, REGION=REGION)
