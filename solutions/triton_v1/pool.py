# SPDX-License-Identifier: Apache-2.0
"""triton_v1's deployment form: `flush_inplace(pool, idx, q0)` on a caller-owned pool (docs/operator.md, "Deployment
form"; the harness's `harness.ops.leapquant_kda_flush.Pool` is one: any object with its attributes will do).

The pool is one flat byte buffer in the published engine layout, the region of (slot, head) at byte
49,152 + (33 slot + head) * 65,536 holding the checkpoint (codes, s_k, s_v, fp16 rows u | q), with typed views of
those fields (`codes`, `s_k`, `s_v`, `u`, `q` [slots, 32, ...]), the dense window (`kbuf`, `ubuf`, `gbuf`, `w`),
`pcum` and the int32 fill counter `count` [slots, 32], `num_slots`, `device`, and `check_call(idx, q0)` for the
argument checks that need no values.

It launches kernel.py's `_flush_kernel` (the one `run` uses, in its pool mode), one program per (sequence, head); a
program whose slot is not full (counter != L) or outside [1, num_slots) returns at once. In place: the kernel keeps
vectors and A rows in the output's codes region, which here is the codes still being read, so pool
mode uses a scratch of its own (16 KB per (slot, head)), allocated on the first call for a pool, like the
compilation. After that a call does no host synchronisation and no allocation, so it can be captured in a CUDA graph
and replayed with new pool contents. idx's values are the caller's contract (in range, no slot twice): a slot given
twice is flushed by two programs at once and its checkpoint is undefined.
"""
import weakref

import torch

from kernel import launch

REGION = 65_536
_scratch = weakref.WeakKeyDictionary()     # pool -> its kernel scratch


def flush_inplace(pool, idx: torch.Tensor, q0: torch.Tensor) -> None:
    """Flush in place every (idx[n], head) whose counter is L and reset its window (w = 0, pcum = 0, gbuf = 1; the
    counter stays L); everything else stays as it is. idx: int32 [N] slots (0 = no sequence); q0: float32 [V, R]."""
    pool.check_call(idx, q0)                 # metadata only: no host synchronisation
    if not idx.numel():
        return
    heads, (V, K), R, L = pool.codes.shape[1], pool.codes.shape[2:], pool.u.shape[2], pool.kbuf.shape[2]
    scratch = _scratch.get(pool)
    if scratch is None:
        scratch = _scratch[pool] = torch.empty((pool.num_slots * heads, V * K), dtype=torch.int8, device=pool.device)
    checkpoint = (pool.codes, pool.s_k, pool.s_v, pool.u, pool.q)
    launch(idx.numel() * heads, (*checkpoint, pool.kbuf, pool.ubuf, pool.gbuf, pool.w, pool.pcum, q0, *checkpoint),
           V, K, L, R, p_idx=idx, p_count=pool.count, p_scratch=scratch, num_slots=pool.num_slots,
           POOL=True, H=heads, REGION=REGION)
