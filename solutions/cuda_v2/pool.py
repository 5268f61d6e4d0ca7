# SPDX-License-Identifier: Apache-2.0
"""cuda_v2's deployment form: `flush_inplace(pool, idx, q0)` on a caller-owned pool (docs/operator.md, "Deployment
form"; the harness's `harness.ops.leapquant_kda_flush.Pool` is one: any object with its attributes will do).

The pool is one flat byte buffer (`buffer`) in the published engine layout, the region of (slot, head) at byte
49,152 + (33 slot + head) * 65,536 holding the checkpoint (codes +0, s_k +16,384, s_v +16,896, fp16 rows u | q
+17,408), with the dense window (`kbuf`, `ubuf`, `gbuf`, `w`), `pcum` and the int32 fill counter `count` [slots, 32]
beside it, and `check_call(idx, q0)` for the argument checks that need no values.

The same kernel as `run` (flush.cu, its deployment instantiation): persistent CTAs check their candidate programs
(n, head) 256 at a time, all threads at once (slot idx[n] in [1, num_slots) and count == 16), and flush the due ones
in place, each one's inputs copied into shared memory before any of its outputs is written; the window of a flushed
program is reset (w = 0, pcum = 0, gbuf = 1; the counter stays 16). No host synchronisation, no allocation: the call
can be captured in a CUDA graph and replayed with new pool contents. idx's values are the caller's contract (in
range, no slot twice): a slot given twice is flushed by two CTAs at once and its checkpoint is undefined.
"""
from main import extension


def flush_inplace(pool, idx, q0) -> None:
    """Flush in place every (idx[n], head) whose counter is 16 and reset its window; everything else stays as it is.
    idx: int32 [N] slots (0 = no sequence); q0: float32 [V, R]."""
    pool.check_call(idx, q0)                 # metadata only: no host synchronisation
    if not pool.buffer.is_cuda:
        raise RuntimeError(f"cuda_v2 runs on CUDA tensors only (an H200, sm_90a); the pool is on {pool.device}")
    if idx.numel():
        extension().flush_inplace(pool.buffer, pool.kbuf, pool.ubuf, pool.gbuf, pool.w, pool.pcum, pool.count, idx,
                                  q0)
