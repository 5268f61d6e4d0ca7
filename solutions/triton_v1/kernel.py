# SPDX-License-Identifier: Apache-2.0
"""LeapQuant window flush (leapquant_kda_flush_r4_int8_h32_v128_k128) as one fused Triton kernel.

One program per (sequence, head), 4 warps.  The state is never materialised whole:

    S = A B + diag(s_v) codes diag(cs),    cs = s_k / 127 * exp(pcum)

with a 32-wide factor index f:
    f in [0, 16):   A[:, f] = ubuf_f                    B[f] = w_f kbuf_f * D_f
    f in [16, 20):  A[:, f] = hi(q_{f-16})              B[f] = u_{f-16} * exp(pcum)
    f in [20, 24):  A[:, f] = lo(q_{f-20})              B[f] = u_{f-20} * exp(pcum)
    f in [24, 32):  zero while rebuilding S; hi/lo(q_new) against -u_new for the residual E = S - q_new^T u_new
A holds only bf16-exact values (ubuf is bf16, an fp16 q is hi + lo exactly); B is fp32 and goes to the tensor cores
as a three-way bf16 split (hi + mid + lo, 24 bits: two-way splits fail the criterion on the hot-row heads).
The three subspace products use the factored form, chunked over 32 rows (columns) of V (K):
    S^T x = B^T (A^T x) + cs * codes^T (s_v x),        S z = A (B z) + s_v * codes (cs z)
The codes and A products run on tensor cores (codes are exact in bf16; the four vectors are a three-way split in the
columns 0-3 / 4-7 / 8-11 of a [*, 16] tile, summed when the result vectors are extracted); the B parts are fp32 FMAs.
The vectors the chunked loops read (cs * qk, qv) go through the head's own codes_new region as fp32 scratch (the last
pass overwrites it), behind a CTA barrier.  MGS2 runs on four 1-D vectors.  The residual is rebuilt twice in row
chunks of VC rows (once for s_k, once for s_v and the codes).  u_new is stored before the residual passes and read
back (after a CTA barrier) for the rows 24-31 of B.
Version 2 (NOTES.md; version 1 = commit c779a19): A is built once as bf16 rows in the scratch (bytes [8192, 16384) of
codes_new; q_new's hi / lo go into its columns 24-31 before the residual) and every chunk loads its rows from there;
the window rows of B come from a sequential per-thread decay product through the scratch (no block-wide scan);
pass 1 accumulates |E| elementwise and reduces once; pass 2 rounds with one FFMA and needs no clamp.

Config (fixed): 4 warps, num_stages 1, VC = PC = 32, L2 prefetch of the codes and ubuf lines at entry, and a
128-register cap (4 programs per SM).  NOTES.md has the measurements.

POOL (constexpr): the deployment form (pool.py, NOTES.md "Deployment form"): the checkpoint is read and written in
place in a flat pool, only the programs whose window is full run, and they reset their window; the scratch is then a
pool-owned tensor, since the codes region is the one being read. With POOL False (`run`) every pool argument is a
compile-time None and the kernel compiles to the same code as without them.

TC (constexpr): True on the GPU (bf16 tensor-core dots); False under the interpreter, where the same bf16-valued
operands stay fp32 and the dots run in ieee fp32 (the interpreter mishandles bf16 tl.dot).
"""
import os

import torch
import triton
import triton.language as tl


NUM_WARPS = 8
NUM_STAGES = 1
MAXNREG = 0      # no register cap: 255 registers, one program of 8 warps per SM (at 128: 2.3 KB of spills)
PF = 1           # prefetch the codes and ubuf at the start: 0 no, 1 to L2, 2 to L1


@triton.jit
def _bf(x):
    """x rounded to a bf16 value, kept as fp32."""
    return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _prefetch(ptrs, PF: tl.constexpr):
    """Ask for the lines at ptrs (one pointer a 128-byte line) ahead of their first use (GPU only)."""
    if PF == 1:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
    elif PF == 2:
        tl.inline_asm_elementwise("prefetch.global.L1 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _normalize(v):
    n = tl.sqrt(tl.sum(v * v, axis=0))
    n = tl.maximum(n, 1e-30)
    return v / n


@triton.jit
def _proj(v, c):
    return v - c * tl.sum(c * v, axis=0)


@triton.jit
def _mgs2(a0, a1, a2, a3):
    """Modified Gram-Schmidt with the projections applied twice, as the reference's _mgs."""
    c0 = _normalize(a0)
    v = a1
    v = _proj(v, c0)
    v = _proj(v, c0)
    c1 = _normalize(v)
    v = a2
    v = _proj(v, c0)
    v = _proj(v, c1)
    v = _proj(v, c0)
    v = _proj(v, c1)
    c2 = _normalize(v)
    v = a3
    v = _proj(v, c0)
    v = _proj(v, c1)
    v = _proj(v, c2)
    v = _proj(v, c0)
    v = _proj(v, c1)
    v = _proj(v, c2)
    c3 = _normalize(v)
    return c0, c1, c2, c3


@triton.jit
def _load_at(ubuf_h, q_h, f, rv, V: tl.constexpr, L: tl.constexpr, QS: tl.constexpr):
    """A^T [32, V]: ubuf in the rows 0-15, the exact bf16 hi / lo parts of q (rows QS apart) in 16-19 / 20-23, zero
    beyond."""
    ub = tl.load(ubuf_h + f[:, None] * V + rv[None, :], mask=f[:, None] < L, other=0.0).to(tl.float32)
    qa = tl.load(q_h + (f[:, None] % 4) * QS + rv[None, :], mask=(f[:, None] >= 16) & (f[:, None] < 24),
                 other=0.0).to(tl.float32)
    qhi = _bf(qa)
    return ub + tl.where(f[:, None] >= 20, qa - qhi, qhi)


@triton.jit
def _mm_acc(a, b, acc, TC: tl.constexpr, DT: tl.constexpr):
    """acc + a @ b for DT-valued fp32 tiles (DT bf16 or fp16: exact products, fp32 accumulation) on tensor cores,
    or in ieee fp32."""
    if TC:
        return tl.dot(a.to(DT), b.to(DT), acc=acc, out_dtype=tl.float32)
    else:
        return tl.dot(a, b, acc=acc, input_precision="ieee", out_dtype=tl.float32)


@triton.jit
def _flush_kernel(codes_ptr, sk_ptr, sv_ptr, u_ptr, q_ptr, kbuf_ptr, ubuf_ptr, gbuf_ptr, w_ptr, pcum_ptr, q0_ptr,
                  codes_out, sk_out, sv_out, u_out, q_out,
                  V: tl.constexpr, K: tl.constexpr, L: tl.constexpr, R: tl.constexpr, TC: tl.constexpr,
                  PF: tl.constexpr,
                  idx_ptr=None, count_ptr=None, scratch_ptr=None, num_slots=None,
                  POOL: tl.constexpr = False, H: tl.constexpr = 1, REGION: tl.constexpr = 0):
    tl.static_assert(L == 16)
    tl.static_assert(R == 4)
    pid = tl.program_id(0).to(tl.int64)
    if POOL:
        # deployment form (pool.py): program pid = (sequence, head); the checkpoint is read and written in place in
        # the region of (idx[sequence], head) of one flat buffer (codes_ptr ... q_ptr point at the fields of region
        # 0; H + 1 regions a slot, the last one spare; the u | q rows K + V apart); the window, pcum and fill
        # counter are dense [slots, H, ...]; a program whose slot is 0 (no sequence), out of range or not full
        # returns at once
        seq = pid // H
        head = pid % H
        slot = tl.load(idx_ptr + seq).to(tl.int64)
        valid = (slot > 0) & (slot < num_slots)
        count = tl.load(count_ptr + slot * H + head, mask=valid, other=0)
        if count != L:
            return
        prog = slot * H + head
        region = slot * (H + 1) + head
        US: tl.constexpr = K + V
        QS: tl.constexpr = K + V
        codes_h = codes_ptr + region * REGION
        sk_h = sk_ptr + region * (REGION // 4)
        sv_h = sv_ptr + region * (REGION // 4)
        u_h = u_ptr + region * (REGION // 2)
        q_h = q_ptr + region * (REGION // 2)
        codes_o = codes_h
        sk_o = sk_h
        sv_o = sv_h
        u_o = u_h
        q_o = q_h
        # the window rows' scratch may not be the codes region it still reads: a separate 16 KB per (slot, head)
        scratch = scratch_ptr + prog * (V * K)
    else:
        prog = pid
        US: tl.constexpr = K
        QS: tl.constexpr = V
        codes_h = codes_ptr + pid * (V * K)
        sk_h = sk_ptr + pid * K
        sv_h = sv_ptr + pid * V
        u_h = u_ptr + pid * (R * K)
        q_h = q_ptr + pid * (R * V)
        codes_o = codes_out + pid * (V * K)
        sk_o = sk_out + pid * K
        sv_o = sv_out + pid * V
        u_o = u_out + pid * (R * K)
        q_o = q_out + pid * (R * V)
        scratch = codes_o
    kbuf_h = kbuf_ptr + prog * (L * K)
    ubuf_h = ubuf_ptr + prog * (L * V)
    gbuf_h = gbuf_ptr + prog * (L * K)
    w_h = w_ptr + prog * L
    pcum_h = pcum_ptr + prog * K

    rv = tl.arange(0, V)
    rk = tl.arange(0, K)
    f = tl.arange(0, 32)
    c16 = tl.arange(0, 16)

    # ---- the window rows are read one after the other below, each behind a store the compiler cannot move it past
    # (it may alias): ask for their lines first, and for the codes' and ubuf's, read right after
    if TC:
        _prefetch(kbuf_h + tl.arange(0, (L * K * 2) // 128) * 64, 2)
        _prefetch(gbuf_h + tl.arange(0, (L * K * 2) // 128) * 64, 2)
        _prefetch(pcum_h + tl.arange(0, (K * 4) // 128) * 32, 2)
        _prefetch(codes_h + tl.arange(0, (V * K) // 128) * 128, PF)
        _prefetch(ubuf_h + tl.arange(0, (L * V * 2) // 128) * 64, PF)

    # ---- per-head vectors
    e = tl.exp(tl.load(pcum_h + rk))
    cs = tl.load(sk_h + rk) * (1.0 / 127.0) * e                                          # [K]
    sv = tl.load(sv_h + rv)                                                              # [V]

    # ---- B^T [K, 32]: window rows w_f kbuf_f D_f, D_f = prod_{i > f} g_i, one 1-D row at a time (a sequential
    # product in each thread instead of a block-wide scan) through the scratch (fp32 at bytes [8192, 16384) of the
    # head's codes_new region, written only at the very end), then u * exp(pcum) twice (against q's hi and lo)
    scr = scratch.to(tl.pointer_type(tl.float32)) + 2048
    d = tl.full([K], 1.0, dtype=tl.float32)
    for jj in tl.static_range(L):
        j = L - 1 - jj
        kbj = tl.load(kbuf_h + j * K + rk).to(tl.float32)
        tl.store(scr + j * K + rk, tl.load(w_h + j) * kbj * d)
        d = d * tl.load(gbuf_h + j * K + rk).to(tl.float32)
    tl.debug_barrier()
    kw = tl.load(scr + f[None, :] * K + rk[:, None], mask=f[None, :] < L, other=0.0)
    uu = tl.load(u_h + (f[None, :] % 4) * US + rk[:, None], mask=(f[None, :] >= 16) & (f[None, :] < 24),
                 other=0.0).to(tl.float32)
    bt = kw + uu * e[:, None]
    bt_hi = _bf(bt)
    bt_r = bt - bt_hi
    bt_mid = _bf(bt_r)
    bt_lo = _bf(bt_r - bt_mid)

    # ---- S^T [K, V] in registers: diag(cs) codes^T diag(s_v) + B^T A^T (A exact in bf16 against the three-way
    # split of B)
    at = _load_at(ubuf_h, q_h, f, rv, V, L, QS)
    cdt = tl.load(codes_h + rv[None, :] * K + rk[:, None]).to(tl.float32)
    st = (cdt * cs[:, None]) * sv[None, :]
    st = _mm_acc(bt_hi, at, st, TC, tl.bfloat16)
    st = _mm_acc(bt_mid, at, st, TC, tl.bfloat16)
    st = _mm_acc(bt_lo, at, st, TC, tl.bfloat16)

    # ---- 1. qk = MGS2(S^T q0)     (fp32 sums: the start vector's precision moves the hot-row heads, NOTES.md)
    a0 = tl.sum(st * tl.load(q0_ptr + rv * R + 0)[None, :], axis=1)
    a1 = tl.sum(st * tl.load(q0_ptr + rv * R + 1)[None, :], axis=1)
    a2 = tl.sum(st * tl.load(q0_ptr + rv * R + 2)[None, :], axis=1)
    a3 = tl.sum(st * tl.load(q0_ptr + rv * R + 3)[None, :], axis=1)
    k0, k1, k2, k3 = _mgs2(a0, a1, a2, a3)

    # ---- 2. qv = MGS2(S qk)
    b0 = tl.sum(st * k0[:, None], axis=0)
    b1 = tl.sum(st * k1[:, None], axis=0)
    b2 = tl.sum(st * k2[:, None], axis=0)
    b3 = tl.sum(st * k3[:, None], axis=0)
    v0, v1, v2, v3 = _mgs2(b0, b1, b2, b3)

    # ---- 3. u_new = S^T qv (fp32 qv, as the reference), q_new = qv, both rounded to fp16
    un0 = tl.sum(st * v0[None, :], axis=1).to(tl.float16)
    un1 = tl.sum(st * v1[None, :], axis=1).to(tl.float16)
    un2 = tl.sum(st * v2[None, :], axis=1).to(tl.float16)
    un3 = tl.sum(st * v3[None, :], axis=1).to(tl.float16)
    qn0 = v0.to(tl.float16)
    qn1 = v1.to(tl.float16)
    qn2 = v2.to(tl.float16)
    qn3 = v3.to(tl.float16)
    tl.store(q_o + 0 * QS + rv, qn0)
    tl.store(q_o + 1 * QS + rv, qn1)
    tl.store(q_o + 2 * QS + rv, qn2)
    tl.store(q_o + 3 * QS + rv, qn3)
    tl.store(u_o + 0 * US + rk, un0)
    tl.store(u_o + 1 * US + rk, un1)
    tl.store(u_o + 2 * US + rk, un2)
    tl.store(u_o + 3 * US + rk, un3)

    # ---- residual E^T = S^T - u_new^T q_new: one fp16 product (exact products, fp32 accumulation onto S^T), the
    # four tokens in the 16-wide contraction
    c = c16[None, :]
    un_t = tl.where(c == 0, un0.to(tl.float32)[:, None], tl.where(c == 1, un1.to(tl.float32)[:, None],
           tl.where(c == 2, un2.to(tl.float32)[:, None], tl.where(c == 3, un3.to(tl.float32)[:, None], 0.0))))
    r = c16[:, None]
    qn_t = tl.where(r == 0, qn0.to(tl.float32)[None, :], tl.where(r == 1, qn1.to(tl.float32)[None, :],
           tl.where(r == 2, qn2.to(tl.float32)[None, :], tl.where(r == 3, qn3.to(tl.float32)[None, :], 0.0))))
    et = _mm_acc(-un_t, qn_t, st, TC, tl.float16)

    # s_k = sqrt(mean_v |E|), s_v = max_k |E| / s_k, codes = round(127 E / (s_k s_v))
    sk_new = tl.maximum(tl.sqrt(tl.sum(tl.abs(et), axis=1) * (1.0 / V)), 1e-12)
    tl.store(sk_o + rk, sk_new)
    t = et * (1.0 / sk_new)[:, None]
    sv_new = tl.maximum(tl.max(tl.abs(t), axis=0), 1e-12)
    # |t| <= s_v, so |127 t / s_v| <= 127 (1 + 2^-23) rounds into [-127, 127]: no clamp.  Round half to even by
    # the 1.5 * 2^23 add (one FFMA); the int8 code is the low byte of the sum's bits
    ir = (t * (127.0 / sv_new)[None, :] + 12582912.0).to(tl.int32, bitcast=True)
    tl.debug_barrier()      # every thread's window-row loads from the scratch are long done: the codes go over them
    tl.store(codes_o + rv[None, :] * K + rk[:, None], ir.to(tl.int8))
    tl.store(sv_o + rv, sv_new)

    if POOL:
        # window reset (the counter stays L); every thread read the window before the barriers above
        tl.store(w_h + tl.arange(0, L), tl.zeros([L], dtype=tl.float32))
        tl.store(pcum_h + rk, tl.zeros([K], dtype=tl.float32))
        tl.store(gbuf_h + tl.arange(0, L)[:, None] * K + rk[None, :], tl.full([L, K], 1.0, dtype=tl.float16))


def on_gpu(device: torch.device) -> bool:
    """The tensor-core form only where the kernel really compiles for the GPU (not under TRITON_INTERPRET)."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1"


def launch(programs: int, pointers: tuple, V: int, K: int, L: int, R: int, **pool):
    """_flush_kernel over `programs` programs in the fixed config; `pointers`: its 16 tensor arguments, `pool`: the
    deployment form's extra arguments (pool.py)."""
    tc = on_gpu(pointers[0].device)
    extra = {"maxnreg": MAXNREG} if tc and MAXNREG else {}
    _flush_kernel[(programs,)](*pointers, V=V, K=K, L=L, R=R, TC=tc, PF=PF,
                               num_warps=NUM_WARPS, num_stages=NUM_STAGES, **extra, **pool)


def run(codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, q0):
    B, H, V, K = codes.shape
    R = u.shape[-2]
    L = kbuf.shape[-2]
    dev = codes.device
    ins = [t.contiguous() for t in (codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, q0)]
    codes_new = torch.empty((B, H, V, K), dtype=torch.int8, device=dev)
    s_k_new = torch.empty((B, H, K), dtype=torch.float32, device=dev)
    s_v_new = torch.empty((B, H, V), dtype=torch.float32, device=dev)
    u_new = torch.empty((B, H, R, K), dtype=torch.float16, device=dev)
    q_new = torch.empty((B, H, R, V), dtype=torch.float16, device=dev)
    if B * H > 0:
        launch(B * H, (*ins, codes_new, s_k_new, s_v_new, u_new, q_new), V, K, L, R)
    return codes_new, s_k_new, s_v_new, u_new, q_new
