# SPDX-License-Identifier: Apache-2.0
"""gluon_v1's deployment form: `flush_inplace(pool, idx, q0)` on a caller-owned pool (docs/operator.md, "Deployment
form"; the harness's `harness.ops.leapquant_kda_flush.Pool` is one: any object with its attributes will do).

It launches kernel.py's `_flush_kernel` in its pool mode, one program per (sequence, head): the checkpoint is read
and written in place in the region of (idx[n], head) of the pool's flat buffer (kernel.py keeps every input in
registers before the first barrier of the subspace iteration and writes after it, so no scratch is needed); a
program whose slot is not full (counter != L) or outside [1, num_slots) returns at once; a flushed program resets
its window (w = 0, pcum = 0, gbuf = 1; the counter stays L). No host synchronisation and no allocation: the call can
be captured in a CUDA graph. idx's values are the caller's contract (in range, no slot twice)."""
from kernel import launch

REGION = 65_536


def flush_inplace(pool, idx, q0) -> None:
    """Flush in place every (idx[n], head) whose counter is L and reset its window; everything else stays as it is.
    idx: int32 [N] slots (0 = no sequence); q0: float32 [V, R]."""
    if not pool.device.type == "cuda":
        raise RuntimeError(f"gluon_v1 runs on CUDA tensors only (Gluon has no CPU interpreter); got {pool.device}")
    pool.check_call(idx, q0)                 # metadata only: no host synchronisation
    if not idx.numel():
        return
    heads, (V, K), R, L = pool.codes.shape[1], pool.codes.shape[2:], pool.u.shape[2], pool.kbuf.shape[2]
    checkpoint = (pool.codes, pool.s_k, pool.s_v, pool.u, pool.q)
    launch(idx.numel() * heads, (*checkpoint, pool.kbuf, pool.ubuf, pool.gbuf, pool.w, pool.pcum, q0, *checkpoint),
           V, K, L, R, p_idx=idx, p_count=pool.count, num_slots=pool.num_slots, POOL=True, H=heads, REGION=REGION)
