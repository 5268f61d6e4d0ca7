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


NUM_WARPS = 4
NUM_STAGES = 1
MAXNREG = 128    # register cap (ptxas): 4 programs per SM instead of 2, at the cost of a few spills
VC = 32          # rows per residual chunk
PC = 32          # rows (columns) of V (K) per chunk of the subspace products
PF = 1           # prefetch the codes and ubuf at the start: 0 no, 1 to L2, 2 to L1


@triton.jit
def _bf(x):
    """x rounded to a bf16 value, kept as fp32."""
    return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _mm(a, b, TC: tl.constexpr):
    """a @ b for bf16-valued fp32 tiles: bf16 tensor cores (exact products, fp32 accumulation) or ieee fp32."""
    if TC:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), out_dtype=tl.float32)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)


@triton.jit
def _split3(t, c16):
    """[N, 16] tile whose columns 0-11 hold copies of four vectors (x_{c % 4}): the bf16 parts of a three-way split
    x = hi + mid + lo (24 bits) in the columns 0-3, 4-7, 8-11; columns 12-15 zero."""
    h = _bf(t)
    r = t - h
    m = _bf(r)
    lo = _bf(r - m)
    return tl.where(c16[None, :] < 4, h, tl.where(c16[None, :] < 8, m, lo))


@triton.jit
def _assemble(x0, x1, x2, x3, c16):
    """[N, 16] fp32 tile: column c holds x_{c % 4} for c < 12, zero beyond."""
    cm = c16[None, :] % 4
    t = tl.where(cm == 0, x0[:, None], tl.where(cm == 1, x1[:, None], tl.where(cm == 2, x2[:, None], x3[:, None])))
    return tl.where(c16[None, :] < 12, t, 0.0)


@triton.jit
def _col(t, c16, j: tl.constexpr):
    """Result column j of a [N, 16] product tile: the sum of its hi, mid and lo columns."""
    sel = (c16[None, :] == j) | (c16[None, :] == j + 4) | (c16[None, :] == j + 8)
    return tl.sum(tl.where(sel, t, 0.0), axis=1)


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
    # scaled by the largest entry first: a Gram-Schmidt remainder of a rank-deficient state can be ~1e-20, whose
    # squares flush to zero in fp32 and left v / 1e-30 ~ 1e10, an overflowing "unit" column; a zero column stays zero
    m = tl.max(tl.abs(v), axis=0)
    t = v / tl.maximum(m, 1e-30)
    return t / tl.maximum(tl.sqrt(tl.sum(t * t, axis=0)), 1e-30)


@triton.jit
def _proj(v, c):
    return v - c * tl.sum(c * v, axis=0)


@triton.jit
def _mgs2(a0, a1, a2, a3):
    """Modified Gram-Schmidt with the projections applied twice, as the reference's _mgs, then once more after
    normalising: a column inside the span of the earlier ones to working precision (a rank-deficient state) leaves
    only the second pass's rounding, which the normalisation blows up to a unit vector up to 0.98 along c0; one
    projection of the unit vector removes that."""
    c0 = _normalize(a0)
    v = a1
    v = _proj(v, c0)
    v = _proj(v, c0)
    v = _normalize(v)
    c1 = _normalize(_proj(v, c0))
    v = a2
    v = _proj(v, c0)
    v = _proj(v, c1)
    v = _proj(v, c0)
    v = _proj(v, c1)
    v = _normalize(v)
    c2 = _normalize(_proj(_proj(v, c0), c1))
    v = a3
    v = _proj(v, c0)
    v = _proj(v, c1)
    v = _proj(v, c2)
    v = _proj(v, c0)
    v = _proj(v, c1)
    v = _proj(v, c2)
    v = _normalize(v)
    c3 = _normalize(_proj(_proj(_proj(v, c0), c1), c2))
    return c0, c1, c2, c3


@triton.jit
def _load_a(ubuf_h, q_h, rv, f, V: tl.constexpr, L: tl.constexpr, QS: tl.constexpr):
    """A [V, 32]: ubuf in the columns 0-15, the exact bf16 hi / lo parts of q (rows QS apart) in 16-19 / 20-23,
    zero beyond."""
    ub = tl.load(ubuf_h + f[None, :] * V + rv[:, None], mask=f[None, :] < L, other=0.0).to(tl.float32)
    qa = tl.load(q_h + (f[None, :] % 4) * QS + rv[:, None], mask=(f[None, :] >= 16) & (f[None, :] < 24),
                 other=0.0).to(tl.float32)
    qhi = _bf(qa)
    return ub + tl.where(f[None, :] >= 20, qa - qhi, qhi)


@triton.jit
def _store_qn(ascr, v, rv, j: tl.constexpr):
    """A's columns 24 + j / 28 + j: the exact bf16 hi / lo parts of the fp16-rounded q_new_j."""
    qn = v.to(tl.float16).to(tl.float32)
    hi = _bf(qn)
    tl.store(ascr + rv * 32 + 24 + j, hi.to(tl.bfloat16))
    tl.store(ascr + rv * 32 + 28 + j, (qn - hi).to(tl.bfloat16))


@triton.jit
def _st_product(x_ptr, sxv, sxj, ascr, codes_h, sv_h, bf, cs, c16, f, rk,
                V: tl.constexpr, K: tl.constexpr, L: tl.constexpr, PC: tl.constexpr, TC: tl.constexpr):
    """S^T x_j (j < 4) for vectors x_j[v] at x_ptr + v * sxv + j * sxj, in chunks of PC rows of V:
    S^T x = B^T (A^T x) + cs * codes^T (s_v x)."""
    g = tl.zeros([32, 16], dtype=tl.float32)
    rc = tl.zeros([K, 16], dtype=tl.float32)
    for v0 in range(0, V, PC):
        rv = v0 + tl.arange(0, PC)
        xt = tl.load(x_ptr + rv[:, None] * sxv + (c16[None, :] % 4) * sxj, mask=c16[None, :] < 12, other=0.0)
        svc = tl.load(sv_h + rv)
        a_c = tl.load(ascr + rv[:, None] * 32 + f[None, :])                        # [PC, 32] bf16
        g += _mm(tl.trans(a_c), _split3(xt, c16), TC)                            # [32, 16]  A^T X (A exact)
        cd = tl.load(codes_h + rv[:, None] * K + rk[None, :])                    # [PC, K] int8
        rc += _mm(tl.trans(cd), _split3(svc[:, None] * xt, c16), TC)             # [K, 16]  codes^T (s_v X)
    o0 = cs * _col(rc, c16, 0) + tl.sum(bf * _col(g, c16, 0)[:, None], axis=0)
    o1 = cs * _col(rc, c16, 1) + tl.sum(bf * _col(g, c16, 1)[:, None], axis=0)
    o2 = cs * _col(rc, c16, 2) + tl.sum(bf * _col(g, c16, 2)[:, None], axis=0)
    o3 = cs * _col(rc, c16, 3) + tl.sum(bf * _col(g, c16, 3)[:, None], axis=0)
    return o0, o1, o2, o3


@triton.jit
def _s_product(z_ptr, z0, z1, z2, z3, ascr, codes_h, bf, sv, c16, f, rv,
               V: tl.constexpr, K: tl.constexpr, L: tl.constexpr, PC: tl.constexpr, TC: tl.constexpr):
    """S z_j for the vectors z_j over K (in registers; cs * z_j also at z_ptr + j * K + k), in chunks of PC
    columns of K:  S z = A (B z) + s_v * codes (cs z)."""
    h0 = tl.sum(bf * z0[None, :], axis=1)                                        # [32]  B z_j  (fp32)
    h1 = tl.sum(bf * z1[None, :], axis=1)
    h2 = tl.sum(bf * z2[None, :], axis=1)
    h3 = tl.sum(bf * z3[None, :], axis=1)
    t = _mm(tl.load(ascr + rv[:, None] * 32 + f[None, :]), _split3(_assemble(h0, h1, h2, h3, c16), c16), TC)   # [V, 16]
    rc = tl.zeros([V, 16], dtype=tl.float32)
    for k0 in range(0, K, PC):
        rkc = k0 + tl.arange(0, PC)
        zt = tl.load(z_ptr + rkc[:, None] + (c16[None, :] % 4) * K, mask=c16[None, :] < 12, other=0.0)
        cd = tl.load(codes_h + rv[:, None] * K + rkc[None, :])                   # [V, PC] int8
        rc += _mm(cd, _split3(zt, c16), TC)                                      # [V, 16]  codes (cs Z)
    o0 = sv * _col(rc, c16, 0) + _col(t, c16, 0)
    o1 = sv * _col(rc, c16, 1) + _col(t, c16, 1)
    o2 = sv * _col(rc, c16, 2) + _col(t, c16, 2)
    o3 = sv * _col(rc, c16, 3) + _col(t, c16, 3)
    return o0, o1, o2, o3


@triton.jit
def _residual_chunk(v0, codes_h, sv_h, ascr, bh, bm, bl, cs, rk,
                    V: tl.constexpr, K: tl.constexpr, VC: tl.constexpr, TC: tl.constexpr):
    """E rows [v0, v0 + VC) = A_c B + diag(s_v) codes diag(cs), A (with q_new in its columns 24-31) read from the
    scratch as bf16 rows."""
    rv = v0 + tl.arange(0, VC)
    f = tl.arange(0, 32)
    a_c = tl.load(ascr + rv[:, None] * 32 + f[None, :])
    acc = _mm(a_c, bh, TC)
    acc += _mm(a_c, bm, TC)
    acc += _mm(a_c, bl, TC)
    cd = tl.load(codes_h + rv[:, None] * K + rk[None, :]).to(tl.float32)
    svc = tl.load(sv_h + rv)
    return acc + (cd * svc[:, None]) * cs[None, :]


@triton.jit
def _flush_kernel(codes_ptr, sk_ptr, sv_ptr, u_ptr, q_ptr, kbuf_ptr, ubuf_ptr, gbuf_ptr, w_ptr, pcum_ptr, q0_ptr,
                  codes_out, sk_out, sv_out, u_out, q_out,
                  V: tl.constexpr, K: tl.constexpr, L: tl.constexpr, R: tl.constexpr, VC: tl.constexpr,
                  PC: tl.constexpr, TC: tl.constexpr, PF: tl.constexpr,
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
        # the kernel's scratch may not be the codes region it still reads: a separate 16 KB per (slot, head)
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
    fr = f % 4
    c16 = tl.arange(0, 16)

    # ---- the codes (16 KB) and ubuf (4 KB) are first read chunk by chunk: ask for all their lines now. The window
    # rows are read one after the other below, each behind a store the compiler cannot move it past (it may alias):
    # without their lines in L1 first, that is 16 HBM round trips in a row (12% of the stall samples, ncu)
    if TC:
        _prefetch(codes_h + tl.arange(0, (V * K) // 128) * 128, PF)
        _prefetch(ubuf_h + tl.arange(0, (L * V * 2) // 128) * 64, PF)
        _prefetch(kbuf_h + tl.arange(0, (L * K * 2) // 128) * 64, 2)
        _prefetch(gbuf_h + tl.arange(0, (L * K * 2) // 128) * 64, 2)
        _prefetch(pcum_h + tl.arange(0, (K * 4) // 128) * 32, 2)

    # ---- per-head vectors
    e = tl.exp(tl.load(pcum_h + rk))
    cs = tl.load(sk_h + rk) * (1.0 / 127.0) * e                                          # [K]
    sv = tl.load(sv_h + rv)                                                              # [V]

    # ---- B [32, K] (rows 24-31 zero while rebuilding S)
    # scratch (16 KB; the head's codes_new region, written only by the last pass, outside the pool), as fp32:
    # [0, 512) cs * qk_j over K, [512, 1024) qv_j over V, [2048, 4096) the window rows of B
    scr = scratch.to(tl.pointer_type(tl.float32))
    # window rows w_f kbuf_f D_f, D_f = prod_{i > f} g_i, one 1-D row at a time (a sequential product in each
    # thread instead of a block-wide scan), through the scratch into the [32, K] tile
    d = tl.full([K], 1.0, dtype=tl.float32)
    for jj in tl.static_range(L):
        j = L - 1 - jj
        kbj = tl.load(kbuf_h + j * K + rk).to(tl.float32)
        tl.store(scr + 2048 + j * K + rk, tl.load(w_h + j) * kbj * d)
        d = d * tl.load(gbuf_h + j * K + rk).to(tl.float32)
    tl.debug_barrier()
    kw = tl.load(scr + 2048 + f[:, None] * K + rk[None, :], mask=f[:, None] < L, other=0.0)
    uu = tl.load(u_h + fr[:, None] * US + rk[None, :], mask=(f[:, None] >= 16) & (f[:, None] < 24),
                 other=0.0).to(tl.float32)
    b = kw + uu * e[None, :]
    # A [V, 32] as bf16 rows in the scratch bytes [8192, 16384) (over the window rows, now in registers; the
    # residual's codes stores of a chunk never reach the A rows of a later chunk): ubuf, hi / lo of q, zero in
    # the columns 24-31 until q_new is known
    ascr = (scratch + 8192).to(tl.pointer_type(tl.bfloat16))
    tl.debug_barrier()
    tl.store(ascr + rv[:, None] * 32 + f[None, :], _load_a(ubuf_h, q_h, rv, f, V, L, QS).to(tl.bfloat16))
    tl.debug_barrier()

    # ---- 1. qk = MGS2(S^T q0)
    a0, a1, a2, a3 = _st_product(q0_ptr, R, 1, ascr, codes_h, sv_h, b, cs, c16, f, rk, V, K, L, PC, TC)
    k0, k1, k2, k3 = _mgs2(a0, a1, a2, a3)

    # ---- 2. qv = MGS2(S qk)
    tl.store(scr + 0 * K + rk, cs * k0)
    tl.store(scr + 1 * K + rk, cs * k1)
    tl.store(scr + 2 * K + rk, cs * k2)
    tl.store(scr + 3 * K + rk, cs * k3)
    tl.debug_barrier()
    b0, b1, b2, b3 = _s_product(scr, k0, k1, k2, k3, ascr, codes_h, b, sv, c16, f, rv, V, K, L, PC, TC)
    v0, v1, v2, v3 = _mgs2(b0, b1, b2, b3)

    # ---- 3. uk = S^T qv
    tl.store(scr + 512 + 0 * V + rv, v0)
    tl.store(scr + 512 + 1 * V + rv, v1)
    tl.store(scr + 512 + 2 * V + rv, v2)
    tl.store(scr + 512 + 3 * V + rv, v3)
    tl.debug_barrier()
    u0, u1, u2, u3 = _st_product(scr + 512, 1, V, ascr, codes_h, sv_h, b, cs, c16, f, rk, V, K, L, PC, TC)

    tl.store(q_o + 0 * QS + rv, v0.to(tl.float16))
    tl.store(q_o + 1 * QS + rv, v1.to(tl.float16))
    tl.store(q_o + 2 * QS + rv, v2.to(tl.float16))
    tl.store(q_o + 3 * QS + rv, v3.to(tl.float16))
    tl.store(u_o + 0 * US + rk, u0.to(tl.float16))
    tl.store(u_o + 1 * US + rk, u1.to(tl.float16))
    tl.store(u_o + 2 * US + rk, u2.to(tl.float16))
    tl.store(u_o + 3 * US + rk, u3.to(tl.float16))
    tl.debug_barrier()      # every thread's A loads of the last product are done before A's columns 24-31 change
    _store_qn(ascr, v0, rv, 0)
    _store_qn(ascr, v1, rv, 1)
    _store_qn(ascr, v2, rv, 2)
    _store_qn(ascr, v3, rv, 3)
    tl.debug_barrier()

    # ---- residual: B rows 24-31 = -u_new (fp16, hi + lo exact)
    un = tl.load(u_o + fr[:, None] * US + rk[None, :], mask=f[:, None] >= 24, other=0.0).to(tl.float32)
    b = b - un
    bh = _bf(b)
    br = b - bh
    bm = _bf(br)
    bl = _bf(br - bm)

    # pass 1: s_k = sqrt(mean_v |E|)
    absacc = tl.zeros([VC, K], dtype=tl.float32)
    for v0c in range(0, V, VC):
        ec = _residual_chunk(v0c, codes_h, sv_h, ascr, bh, bm, bl, cs, rk, V, K, VC, TC)
        absacc += tl.abs(ec)
    colsum = tl.sum(absacc, axis=0)
    sk_new = tl.sqrt(colsum * (1.0 / V))
    sk_new = tl.maximum(sk_new, 1e-12)
    tl.store(sk_o + rk, sk_new)
    inv_sk = 1.0 / sk_new

    # pass 2: s_v = max_k |E| / s_k, codes = round(127 E / (s_k s_v))
    for v0c in range(0, V, VC):
        ec = _residual_chunk(v0c, codes_h, sv_h, ascr, bh, bm, bl, cs, rk, V, K, VC, TC)
        tl.debug_barrier()
        t = ec * inv_sk[None, :]
        svn = tl.maximum(tl.max(tl.abs(t), axis=1), 1e-12)
        # |t| <= svn, so |127 t / svn| <= 127 (1 + 2^-23) rounds into [-127, 127]: no clamp.  Round half to even
        # by the 1.5 * 2^23 add (one FFMA); the int8 code is the low byte of the sum's bits
        ir = (t * (127.0 / svn)[:, None] + 12582912.0).to(tl.int32, bitcast=True)
        rvc = v0c + tl.arange(0, VC)
        tl.store(codes_o + rvc[:, None] * K + rk[None, :], ir.to(tl.int8))
        tl.store(sv_o + rvc, svn)

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
    extra = {"maxnreg": MAXNREG} if tc else {}
    _flush_kernel[(programs,)](*pointers, V=V, K=K, L=L, R=R, VC=VC, PC=PC, TC=tc, PF=PF,
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
