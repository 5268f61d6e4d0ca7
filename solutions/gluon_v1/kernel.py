# SPDX-License-Identifier: Apache-2.0
"""gluon_v1: the LeapQuant KDA flush (leapquant_kda_flush_r4_int8_h32_v128_k128) in Triton's Gluon dialect.

One program (a CTA of 8 warps) per (sequence, head); <= 128 registers a thread, so 2 programs an SM. The whole
128 x 128 fp32 state S lives in registers in the mma.sync (m16n8) accumulator layout `MMA` (warps 4 x 2, 64 values a
thread) from the rebuild to the codes:
 1. Rebuild: S = diag(s_v) codes diag(cs) + A_w B_w + A_t B_t, cs = s_k / 127 * exp(pcum). The codes come in as
    16-byte rows and move to the accumulator layout as int8; the codes term is elementwise fp32. The window
    (A_w[v, j] = ubuf_j[v], B_w[j, k] = w_j kbuf_j[k] D_j[k], D_j = prod_{i > j} gbuf_i) and the old tokens
    (A_t = [bf16 hi of q | bf16 lo of q | 0], B_t = [u exp(pcum) | u exp(pcum) | 0]) go onto it on bf16 tensor
    cores (mma_v2, fp32 accumulation); A is exact in bf16, B goes in as a three-way bf16 split (24 bits).
 2. Subspace iteration from the registers, fp32 on CUDA cores: S^T q0 (column sums), CGS2, S qk (row sums), CGS2,
    u = S^T qv. CGS2 runs redundantly in every warp on vectors that each warp holds whole (`GS`), so its dot
    products are warp shuffles with no barrier. u_new, q_new rounded to fp16 and stored.
 3. Residual E = S - q_new^T u_new by one fp16 mma (exact fp16 products onto the fp32 state); s_k = sqrt(mean_v |E|),
    s_v = max_k |E| / s_k (both >= 1e-12); codes = round-half-even(127 E / (s_k s_v)) by the 1.5 * 2^23 add in one
    FMA (|value| <= 127 by construction: no clamp), moved back to 16-byte rows and stored.
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

NUM_WARPS = 8
MAXNREG = 128           # 2 programs of 8 warps an SM

# The accumulator layout of the state: warp (wr, wc) of 4 x 2, lane (g, t); 2 m-tiles x 8 n-tiles of m16n8 a warp
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 2], instr_shape=[16, 8]))
ROW = gl.constexpr(gl.SliceLayout(1, MMA))                  # vectors over V as the state's rows hold them
COL = gl.constexpr(gl.SliceLayout(0, MMA))                  # vectors over K as the state's columns hold them
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
B_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2))
# int8 [V, K] as 16-byte pieces of rows (the codes' global reads and writes)
IO = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [8, 1], [1, 0]))
# [16, K] with the 16 rows j in one thread (the decay's product over j stays in registers); warps 4-7 repeat 0-3
WIN = gl.constexpr(gl.BlockedLayout([16, 1], [1, 32], [1, 8], [0, 1]))
# [V, 16], 8 contiguous v a thread (16-byte reads of ubuf and q rows)
AT = gl.constexpr(gl.BlockedLayout([8, 1], [16, 2], [1, 8], [0, 1]))
# a [128] vector held whole by every warp (4 a thread): CGS2's dot products are shuffles within the warp
GS = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[[1], [2]], lane_bases=[[4], [8], [16], [32], [64]],
                                             warp_bases=[[0], [0], [0]], block_bases=[], shape=[128]))
# [4, 8, 128] column partials (wr, g, k), the 32 of a column in one thread (warps 4-7 repeat 0-3)
RED = gl.constexpr(gl.BlockedLayout([4, 8, 1], [1, 1, 32], [1, 1, 8], [1, 0, 2]))
DEPENDENT_NORM2 = gl.constexpr(2.0 ** -24)     # (2^-12)^2: the squared share of a column a dependent one keeps
THIRD_PASS_NORM2 = gl.constexpr(1e-4)          # (1%)^2: below it a third projection pass restores orthogonality


@gluon.jit
def _split3(x):
    """fp32 x = hi + mid + lo, each bf16 (round to nearest even; the remainders are exact in fp32)."""
    hi = x.to(gl.bfloat16)
    r = x - hi.to(gl.float32)
    mid = r.to(gl.bfloat16)
    lo = (r - mid.to(gl.float32)).to(gl.bfloat16)
    return hi, mid, lo


@gluon.jit
def _mma3(acc, a, b):
    """acc + a b for bf16 a and an fp32 b split three ways, smallest part first."""
    b_h, b_m, b_l = _split3(b)
    acc = mma_v2(a, gl.convert_layout(b_l, B_OP), acc)
    acc = mma_v2(a, gl.convert_layout(b_m, B_OP), acc)
    return mma_v2(a, gl.convert_layout(b_h, B_OP), acc)


@gluon.jit
def _rebuild(p_codes, p_sk, p_sv, p_u, p_q, p_kbuf, p_ubuf, p_gbuf, p_w, p_pcum,
             V: gl.constexpr, K: gl.constexpr, L: gl.constexpr, R: gl.constexpr,
             US: gl.constexpr, QS: gl.constexpr):
    """Stage 1: the state S [V, K] in the accumulator layout."""
    # window: B_w[j, k] = w_j (kbuf_j[k] D_j[k]), D_j = prod_{i > j} g_i built from the top in the reference's
    # order, row by row in each thread (row j of the tile is register j: the selects fold away)
    rj = gl.arange(0, L, layout=gl.SliceLayout(1, WIN))
    rkw = gl.arange(0, K, layout=gl.SliceLayout(0, WIN))
    b_d = gl.full([L, K], 1.0, gl.float32, layout=WIN)
    b_dj = gl.full([K], 1.0, gl.float32, layout=gl.SliceLayout(0, WIN))
    for jj in gl.static_range(L - 1):
        b_dj = b_dj * gl.load(p_gbuf + (L - 1 - jj) * K + rkw).to(gl.float32)
        b_d = gl.where(rj[:, None] == L - 2 - jj, b_dj[None, :], b_d)
    b_kb = gl.load(p_kbuf + rj[:, None] * K + rkw[None, :]).to(gl.float32)
    b_bw = gl.load(p_w + rj)[:, None] * (b_kb * b_d)
    # old tokens: B_t rows j < 2R = u_{j mod R} exp(pcum), against A_t's hi (j < R) and lo (R <= j < 2R) of q
    m_t = (rj[:, None] < 2 * R) & (rkw[None, :] < K)
    b_bt = gl.load(p_u + (rj[:, None] % R) * US + rkw[None, :], mask=m_t, other=0.0).to(gl.float32) \
        * gl.exp(gl.load(p_pcum + rkw))[None, :]

    rva = gl.arange(0, V, layout=gl.SliceLayout(1, AT))
    rja = gl.arange(0, L, layout=gl.SliceLayout(0, AT))
    b_aw = gl.load(p_ubuf + rja[None, :] * V + rva[:, None])                            # [V, L] bf16 = ubuf^T
    m_q = (rva[:, None] < V) & (rja[None, :] < 2 * R)
    b_x = gl.load(p_q + (rja[None, :] % R) * QS + rva[:, None], mask=m_q, other=0.0).to(gl.float32)
    b_xh = b_x.to(gl.bfloat16)
    b_xl = (b_x - b_xh.to(gl.float32)).to(gl.bfloat16)      # an fp16 value is exactly hi + lo
    b_at = gl.where(rja[None, :] < R, b_xh, b_xl)            # columns >= 2R: q masked to 0

    # the codes term first (the mma's accumulator input): int8 rows in 16-byte pieces, moved to the accumulator
    # layout as int8 (a quarter of fp32's bytes)
    rv_io = gl.arange(0, V, layout=gl.SliceLayout(1, IO))
    rk_io = gl.arange(0, K, layout=gl.SliceLayout(0, IO))
    b_cd = gl.convert_layout(gl.load(p_codes + rv_io[:, None] * K + rk_io[None, :]), MMA)
    rk = gl.arange(0, K, layout=COL)
    rv = gl.arange(0, V, layout=ROW)
    b_cs = gl.load(p_sk + rk) * (1.0 / 127.0) * gl.exp(gl.load(p_pcum + rk))
    acc = (b_cd.to(gl.float32) * b_cs[None, :]) * gl.load(p_sv + rv)[:, None]
    acc = _mma3(acc, gl.convert_layout(b_aw, A_OP), b_bw)
    return _mma3(acc, gl.convert_layout(b_at, A_OP), b_bt)


@gluon.jit
def _wdot(x, y):
    return gl.sum(x * y, axis=0)


@gluon.jit
def _inv_norm(v, nn):
    """1 / ||v|| from nn ~ ||v||^2, 0 for a zero column. gl.rsqrt is rsqrt.approx.ftz, which reads a subnormal nn as
    0 (a column whose remainder is ~1e-21, a near-zero row of the state met by a one-hot q0, would then be scaled by
    the reference's 1e30 clamp and overflow the tokens), and a subnormal sum of squares keeps few bits: below 2^-64
    the norm is measured again on the column scaled by 2^64 (exact). Uniform: every thread holds the same sums."""
    inv = gl.rsqrt(nn)
    if nn < 5.421010862427522e-20:                           # 2^-64
        w = v * 18446744073709551616.0
        ww = _wdot(w, w)
        inv = gl.where(ww > 0, gl.rsqrt(ww) * 18446744073709551616.0, 0.0)
    return inv


@gluon.jit
def _cgs2_column(a, r, J: gl.constexpr):
    """Column J of CGS2 on the tuple a of 4 GS vectors (columns < J final); r[p] = c_p . a_J for p < J. One round of
    warp sums holds the second-pass dots d_p = c_p . v of the first-pass vector v, its squared norm, and e = v . a_J+1,
    f_p = c_p . a_J+1, which give column J + 1's first-pass coefficients once c_J is known. Returns (a with c_J, the
    coefficients of column J + 1)."""
    NEXT: gl.constexpr = J + 1 < 4
    v = a[J]
    for p in gl.static_range(J):
        v = v - a[p] * r[p]
    s0 = _wdot(v, v)
    d = ()
    for p in gl.static_range(J):
        d = d + (_wdot(a[p], v),)
    if NEXT:
        e = _wdot(v, a[J + 1])
        f = ()
        for p in gl.static_range(J):
            f = f + (_wdot(a[p], a[J + 1]),)
    nn = s0
    for p in gl.static_range(J):
        v = v - a[p] * d[p]
        nn = nn - d[p] * d[p]
    inv = _inv_norm(v, nn)
    if J > 0:
        # The second pass left under 1% of the column: nearly inside the span of the earlier columns, where the
        # projections' own rounding can still lie along them; a third pass restores orthogonality (a hot-row rank-1
        # head's noise token otherwise carries ~1e-3 of the state into the residual). Its norm is measured directly,
        # since ||v||^2 - sum d_p^2 cancels here. Uniform: every thread holds the same sums.
        if ~(nn > THIRD_PASS_NORM2 * s0):
            t0 = _wdot(v, v)
            t = ()
            for p in gl.static_range(J):
                t = t + (_wdot(a[p], v),)
            nn = t0
            for p in gl.static_range(J):
                v = v - a[p] * t[p]
                nn = nn - t[p] * t[p]
                if NEXT:
                    e = e - t[p] * f[p]            # keeps e = c_J . a_J+1 (times the norm)
        # A second pass that leaves under 2^-12 of the column found rounding inside the span (a rank-deficient
        # state): the column becomes zero, a zero token, rather than normalised rounding (whose direction can lie
        # along an earlier column and whose squared norm can flush to zero)
        dependent = ~(nn > DEPENDENT_NORM2 * s0)
        inv = gl.where(dependent, 0.0, _inv_norm(v, nn))
    c = v * inv
    if J == 0:
        a = (c, a[1], a[2], a[3])
    elif J == 1:
        a = (a[0], c, a[2], a[3])
    elif J == 2:
        a = (a[0], a[1], c, a[3])
    else:
        a = (a[0], a[1], a[2], c)
    if NEXT:
        for p in gl.static_range(J):
            e = e - d[p] * f[p]
        r = f + (e * inv,)
    return a, r


@gluon.jit
def _cgs2(a0, a1, a2, a3):
    """Orthonormal columns of [a0 .. a3] (GS vectors): classical Gram-Schmidt with one reorthogonalisation (as
    accurate as the reference's MGS2), a third pass where the second leaves under 1%, dependent columns zero, the
    norm of a tiny column measured on it scaled up (_inv_norm). Four rounds of warp sums instead of MGS2's
    sixteen."""
    a = (a0, a1, a2, a3)
    a, r = _cgs2_column(a, (), 0)
    a, r = _cgs2_column(a, r, 1)
    a, r = _cgs2_column(a, r, 2)
    a, r = _cgs2_column(a, r, 3)
    return a[0], a[1], a[2], a[3]


@gluon.jit
def _column_sums(x):
    """Column sums of x [128, 128] (accumulator layout) as a GS vector: the 4 rows of a thread summed in registers
    (row v = 64 mt + 16 wr + 8 h + g), then the 32 partials of a column (wr, g) moved into one thread through shared
    memory and summed there, instead of a butterfly over the 8 lanes g of every column."""
    b_p = gl.sum(gl.sum(gl.reshape(x, [2, 4, 2, 8, 128]), axis=2), axis=0)          # [4, 8, 128]
    b_p = gl.convert_layout(b_p, RED)
    return gl.convert_layout(gl.sum(gl.sum(b_p, axis=0), axis=0), GS)


@gluon.jit
def _st_product(acc, x0, x1, x2, x3):
    """S^T x_j for ROW vectors x_j: column sums in fp32, GS vectors."""
    return (_column_sums(acc * x0[:, None]), _column_sums(acc * x1[:, None]),
            _column_sums(acc * x2[:, None]), _column_sums(acc * x3[:, None]))


@gluon.jit
def _s_product(acc, z0, z1, z2, z3):
    """S z_j for COL vectors z_j: row sums in fp32, ROW vectors."""
    return (gl.sum(acc * z0[None, :], axis=1), gl.sum(acc * z1[None, :], axis=1),
            gl.sum(acc * z2[None, :], axis=1), gl.sum(acc * z3[None, :], axis=1))


@gluon.jit
def _subspace(acc, p_q0, p_u_o, p_q_o, V: gl.constexpr, K: gl.constexpr, R: gl.constexpr,
              US: gl.constexpr, QS: gl.constexpr):
    """Stage 2: qk = CGS2(S^T q0), qv = CGS2(S qk), u = S^T qv; q_new = fp16(qv) and u_new = fp16(u) stored, and
    returned as the residual's mma operands: q_new^T in columns 0-3 of a [V, 16] tile, -u_new in rows 0-3 of a
    [16, K] tile (the rest zero)."""
    rv = gl.arange(0, V, layout=ROW)
    b_y0, b_y1, b_y2, b_y3 = _st_product(acc, gl.load(p_q0 + rv * R), gl.load(p_q0 + rv * R + 1),
                                         gl.load(p_q0 + rv * R + 2), gl.load(p_q0 + rv * R + 3))
    b_k0, b_k1, b_k2, b_k3 = _cgs2(b_y0, b_y1, b_y2, b_y3)
    b_z0, b_z1, b_z2, b_z3 = _s_product(acc, gl.convert_layout(b_k0, COL), gl.convert_layout(b_k1, COL),
                                        gl.convert_layout(b_k2, COL), gl.convert_layout(b_k3, COL))
    b_v = _cgs2(gl.convert_layout(b_z0, GS), gl.convert_layout(b_z1, GS),
                gl.convert_layout(b_z2, GS), gl.convert_layout(b_z3, GS))
    rg = gl.arange(0, V, layout=GS)
    c16 = gl.arange(0, 16, layout=gl.SliceLayout(0, AT))[None, :]
    r16 = gl.arange(0, 16, layout=gl.SliceLayout(1, WIN))[:, None]
    b_qa = gl.zeros([V, 16], gl.float16, layout=AT)
    b_ub = gl.zeros([16, K], gl.float16, layout=WIN)
    # one vector at a time, so that only one product's partials are live beside the state
    for j in gl.static_range(R):
        b_qj = b_v[j].to(gl.float16)
        gl.store(p_q_o + j * QS + rg, b_qj)
        b_qa = gl.where(c16 == j, gl.convert_layout(b_qj, gl.SliceLayout(1, AT))[:, None], b_qa)
        b_uj = _column_sums(acc * gl.convert_layout(b_v[j], ROW)[:, None]).to(gl.float16)
        gl.store(p_u_o + j * US + rg, b_uj)
        b_ub = gl.where(r16 == j, gl.convert_layout(-b_uj, gl.SliceLayout(0, WIN))[None, :], b_ub)
    return b_qa, b_ub


@gluon.jit
def _subtract_tokens(acc, b_qa, b_ub):
    """E = S - q_new^T u_new by one fp16 mma over a 16-wide index (4 live): the fp16 products are exact in fp32."""
    return mma_v2(gl.convert_layout(b_qa, A_OP), gl.convert_layout(b_ub, B_OP), acc)


@gluon.jit
def _quantize(acc, p_codes_o, p_sk_o, p_sv_o, V: gl.constexpr, K: gl.constexpr):
    """Stage 3 on E (the accumulators): s_k, s_v, codes stored."""
    rk = gl.arange(0, K, layout=COL)
    rv = gl.arange(0, V, layout=ROW)
    b_sk = gl.maximum(gl.sqrt(gl.sum(gl.abs(acc), axis=0) * (1.0 / V)), 1e-12)
    gl.store(p_sk_o + rk, b_sk)
    b_t = acc * (1.0 / b_sk)[None, :]
    b_sv = gl.maximum(gl.max(gl.abs(b_t), axis=1), 1e-12)
    gl.store(p_sv_o + rv, b_sv)
    # |t| <= s_v, so |127 t / s_v| <= 127 (1 + 2^-23) rounds into [-127, 127]. Round half to even by the 1.5 * 2^23
    # add in one FMA; the code is the low byte of the sum's bits
    b_step = gl.broadcast(b_t, (127.0 / b_sv)[:, None])[1]
    b_y = gl.fma(b_t, b_step, gl.full_like(b_t, 12582912.0))
    b_cd = gl.convert_layout(b_y.to(gl.int32, bitcast=True).to(gl.int8), IO)
    rv_io = gl.arange(0, V, layout=gl.SliceLayout(1, IO))
    rk_io = gl.arange(0, K, layout=gl.SliceLayout(0, IO))
    gl.store(p_codes_o + rv_io[:, None] * K + rk_io[None, :], b_cd)


@gluon.jit
def _flush_kernel(p_codes_in, p_sk_in, p_sv_in, p_u_in, p_q_in, p_kbuf_in, p_ubuf_in, p_gbuf_in, p_w_in, p_pcum_in,
                  p_q0, p_codes_out, p_sk_out, p_sv_out, p_u_out, p_q_out,
                  V: gl.constexpr, K: gl.constexpr, L: gl.constexpr, R: gl.constexpr,
                  p_idx=None, p_count=None, num_slots=None,
                  POOL: gl.constexpr = False, H: gl.constexpr = 1, REGION: gl.constexpr = 0):
    gl.static_assert(V == 128)
    gl.static_assert(K == 128)
    gl.static_assert(L == 16)
    gl.static_assert(R == 4)
    pid = gl.program_id(0).to(gl.int64)
    # Each stage forms the addresses it uses from the kernel's arguments and a record index (rec: the checkpoint's,
    # win: the window's) rather than keeping 64-bit pointers live across the whole program (they spilled)
    if POOL:
        # deployment form (pool.py): program pid = (sequence, head); the checkpoint read and written in place in the
        # region of (idx[sequence], head) of one flat buffer (p_codes_in ... p_q_in point at region 0's fields; H + 1
        # regions a slot, the last one spare; the u | q rows K + V apart); the window, pcum and fill counter dense
        # [slots, H, ...]; a program whose slot is 0 (no sequence), out of range or not full returns at once
        seq = pid // H
        head = pid % H
        slot = gl.load(p_idx + seq).to(gl.int64)
        m_slot = (slot > 0) & (slot < num_slots)
        count = gl.load(p_count + slot * H + head, mask=m_slot, other=0)
        if count != L:
            return
        win = slot * H + head
        rec = slot * (H + 1) + head
        # element strides between records: codes, fp32 fields, fp16 fields; rows of u and of q
        CS: gl.constexpr = REGION
        FS: gl.constexpr = REGION // 4
        HS: gl.constexpr = REGION // 2
        US: gl.constexpr = K + V
        QS: gl.constexpr = K + V
        # in place: every input is read into registers by stage 1, before the barriers of stage 2's reductions;
        # the outputs are written after them
        acc = _rebuild(p_codes_in + rec * CS, p_sk_in + rec * FS, p_sv_in + rec * FS, p_u_in + rec * HS,
                       p_q_in + rec * HS, p_kbuf_in + win * (L * K), p_ubuf_in + win * (L * V),
                       p_gbuf_in + win * (L * K), p_w_in + win * L, p_pcum_in + win * K, V, K, L, R, US, QS)
        b_qa, b_ub = _subspace(acc, p_q0, p_u_in + rec * HS, p_q_in + rec * HS, V, K, R, US, QS)
        acc = _subtract_tokens(acc, b_qa, b_ub)
        _quantize(acc, p_codes_in + rec * CS, p_sk_in + rec * FS, p_sv_in + rec * FS, V, K)
        # window reset (the counter stays L)
        rj = gl.arange(0, L, layout=gl.SliceLayout(1, WIN))
        rkw = gl.arange(0, K, layout=gl.SliceLayout(0, WIN))
        gl.store(p_w_in + win * L + rj, gl.zeros([L], gl.float32, layout=gl.SliceLayout(1, WIN)))
        gl.store(p_pcum_in + win * K + rkw, gl.zeros([K], gl.float32, layout=gl.SliceLayout(0, WIN)))
        gl.store(p_gbuf_in + win * (L * K) + rj[:, None] * K + rkw[None, :],
                 gl.full([L, K], 1.0, gl.float16, layout=WIN))
    else:
        acc = _rebuild(p_codes_in + pid * (V * K), p_sk_in + pid * K, p_sv_in + pid * V, p_u_in + pid * (R * K),
                       p_q_in + pid * (R * V), p_kbuf_in + pid * (L * K), p_ubuf_in + pid * (L * V),
                       p_gbuf_in + pid * (L * K), p_w_in + pid * L, p_pcum_in + pid * K, V, K, L, R, K, V)
        b_qa, b_ub = _subspace(acc, p_q0, p_u_out + pid * (R * K), p_q_out + pid * (R * V), V, K, R, K, V)
        acc = _subtract_tokens(acc, b_qa, b_ub)
        _quantize(acc, p_codes_out + pid * (V * K), p_sk_out + pid * K, p_sv_out + pid * V, V, K)


def launch(programs: int, pointers: tuple, V: int, K: int, L: int, R: int, **pool):
    """_flush_kernel over `programs` programs; `pointers`: its 16 tensor arguments, `pool`: the deployment form's
    extra arguments (pool.py)."""
    _flush_kernel[(programs,)](*pointers, V=V, K=K, L=L, R=R, num_warps=NUM_WARPS, maxnreg=MAXNREG, **pool)


def run(codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, q0):
    if not codes.is_cuda:
        raise RuntimeError(f"gluon_v1 runs on CUDA tensors only (Gluon has no CPU interpreter); got {codes.device}")
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
