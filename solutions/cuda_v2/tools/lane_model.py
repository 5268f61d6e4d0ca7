"""Lane-level model of cuda_v2's new fragment layouts (flush.cu, stage 2 and the rebuild's j 24-31), checked
against plain matrix products on the CPU: every index expression below is transcribed from flush.cu, and ldmatrix /
mma.sync move values as the PTX ISA defines their fragments. Values are small integers (exact in any float), so a
mismatch is a layout error, not rounding.

    python solutions/cuda_v2/tools/lane_model.py        # prints one line per check, exits 1 on a mismatch
"""
from __future__ import annotations

import sys

import numpy as np

V = K = 128
R = 4
SPLIT = K // 2 + 4
TROW = 24
rng = np.random.default_rng(7)


# ---- PTX fragment semantics (g = lane >> 2, t = lane & 3) ---------------------------------------------------------

def ldmatrix(rows: list, trans: bool) -> list:
    """rows[l] = the 8 16-bit elements of the row lane l addresses (matrix l >> 3, row l & 7); returns per lane the
    list over matrices of (element, element): row g, elements 2t, 2t + 1 (or, transposed, rows 2t, 2t + 1 of column
    g)."""
    n_mat = len(rows) // 8
    out = []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        regs = []
        for m in range(n_mat):
            mat = rows[8 * m: 8 * m + 8]
            regs.append((mat[2 * t][g], mat[2 * t + 1][g]) if trans else (mat[g][2 * t], mat[g][2 * t + 1]))
        out.append(regs)
    return out


def mma(a: list, b: list, c: np.ndarray, kind: str) -> np.ndarray:
    """One warp's mma.sync: a[lane], b[lane] = the registers as lists of element lists; c [32, 4]. kind: 's8' (m16n8k32,
    4 elements a register), 'k16' (bf16 m16n8k16), 'k8' (bf16 m16n8k8)."""
    kk = {"s8": 32, "k16": 16, "k8": 8}[kind]
    A, B = np.zeros((16, kk)), np.zeros((kk, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        if kind == "s8":
            for r in range(4):
                row, col = g + 8 * (r & 1), 4 * t + 16 * (r >> 1)
                A[row, col:col + 4] = a[lane][r]
            for r in range(2):
                B[4 * t + 16 * r: 4 * t + 16 * r + 4, g] = b[lane][r]
        else:
            for r in range(len(a[lane])):
                row, col = g + 8 * (r & 1), 2 * t + 8 * (r >> 1)
                A[row, col:col + 2] = a[lane][r]
            for r in range(len(b[lane])):
                B[2 * t + 8 * r: 2 * t + 8 * r + 2, g] = b[lane][r]
    D = A @ B
    out = c.copy()
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        out[lane] += [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]
    return out


def byte_perm(x: list, y: list, sel: int) -> list:
    src = list(x) + list(y)
    return [src[(sel >> (4 * i)) & 7] for i in range(4)]


# ---- shared memory as element arrays ------------------------------------------------------------------------------

def bsm_chunk(k: int, c: int) -> int:
    return c ^ (((k >> 4) ^ (k >> 1)) & 3)


class Smem:
    def __init__(self):
        self.codes = np.zeros((V, 8, 16), np.int64)        # [v][physical chunk][byte]
        self.asm = np.zeros((32, 16, 8))                     # [j][physical chunk][element]
        self.bsm = np.zeros((3, K, 4, 8))                    # [split][k][physical chunk][element]
        self.dig = np.zeros((4, 3, 32, 8), np.int64)         # [k-step][n-tile][lane][byte]
        self.zsp = np.zeros((16, SPLIT, 2))                  # [row][word][half]
        self.tsp = np.zeros((16, TROW))
        self.red = np.full((R, K + 4), np.nan)

    def code_row(self, v, chunk):                            # 16 bytes as 8 16-bit elements (byte pairs)
        b = self.codes[v, chunk ^ (v & 7)]
        return [(b[2 * e], b[2 * e + 1]) for e in range(8)]

    def a_row(self, j, c):
        return list(self.asm[j, c ^ (j & 7)])

    def b_row(self, sp, k, c):
        return list(self.bsm[sp, k, bsm_chunk(k, c)])


def code_regs(pairs_regs):
    """ldmatrix of byte pairs -> 32-bit registers as 4 bytes."""
    return [[reg[0][0], reg[0][1], reg[1][0], reg[1][1]] for reg in pairs_regs]


# ---- the kernel's stages, transcribed -----------------------------------------------------------------------------

def stage_digits(sm: Smem, digits: np.ndarray, trans: bool):
    """digits [5][4 vectors][128] int: flush.cu's stage_digits placement (thread tid: vector tid >> 6, entries i,
    i + 1)."""
    for tid in range(256):
        n, i = tid >> 6, 2 * (tid & 63)
        s, half = i >> 5, (i >> 4) & 1
        t = (i & 7) >> 1 if trans else (i >> 2) & 3
        e0 = 2 * ((i >> 3) & 1) if trans else i & 3
        for p in range(5):
            off = 256 * (p & 1) + 128 * (p >> 1) if p < 4 else 512 + 128
            # byte offset from &dig[s][0][4n + t] + 4 half + e0
            base = ((s * 3 + 0) * 32 + 4 * n + t) * 8 + 4 * half + e0 + off
            for e in range(2):
                b = base + e
                sm.dig.reshape(-1)[b] = digits[p, n, i + e]


def digit_passes(sm: Smem, a: list):
    d = np.zeros((32, 4))
    for s in range(4):
        d = mma([a[l][s] for l in range(32)], [[sm.dig[s, 0, l, :4], sm.dig[s, 0, l, 4:]] for l in range(32)], d, "s8")
    d *= 128
    for s in range(4):
        d = mma([a[l][s] for l in range(32)], [[sm.dig[s, 1, l, :4], sm.dig[s, 1, l, 4:]] for l in range(32)], d, "s8")
    d4 = np.zeros((32, 4))
    for s in range(4):
        d4 = mma([a[l][s] for l in range(32)], [[sm.dig[s, 2, l, :4], sm.dig[s, 2, l, 4:]] for l in range(32)], d4,
                 "s8")
    return d, d4


def codes_times(sm: Smem, warp: int):
    a = [[None] * 4 for _ in range(32)]
    for s in range(4):
        rows = []
        for lane in range(32):
            v = 16 * warp + 8 * ((lane >> 3) & 1) + (lane & 7)
            rows.append(sm.code_row(v, 2 * s + (lane >> 4)))
        regs = code_regs_x4(ldmatrix(rows, False))
        for lane in range(32):
            a[lane][s] = regs[lane]
    return digit_passes(sm, a)


def code_regs_x4(per_lane):
    return [code_regs(regs) for regs in per_lane]


def codes_t_times(sm: Smem, warp: int):
    a = [[None] * 4 for _ in range(32)]
    for s in range(4):
        rows = []
        for lane in range(32):
            vr = 8 * (lane >> 3) + (lane & 7)
            rows.append(sm.code_row(32 * s + vr, warp))        # physical chunk warp ^ (lane & 7) inside code_row
        x = code_regs_x4(ldmatrix(rows, True))
        for lane in range(32):
            xl = x[lane]
            a[lane][s] = [byte_perm(xl[0], xl[1], 0x6420), byte_perm(xl[0], xl[1], 0x7531),
                          byte_perm(xl[2], xl[3], 0x6420), byte_perm(xl[2], xl[3], 0x7531)]
    return digit_passes(sm, a)


def store_contraction(sm: Smem, mt: int, e: np.ndarray):
    """e [2 n-tiles][32 lanes][4]: the splits' sum into tsp split 0 (the model keeps values whole)."""
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        if t >= 2:
            continue
        sh = e[0][lane + 2]
        for h in range(2):
            j = 16 * mt + 8 * h + g
            if j < 24:
                a = (e[1][lane][2 * h] + sh[2 * h]) + e[0][lane][2 * h]
                b = (e[1][lane][2 * h + 1] + sh[2 * h + 1]) + e[0][lane][2 * h + 1]
                sm.tsp[2 * t][j], sm.tsp[2 * t + 1][j] = a, b
                for sp in (1, 2):
                    sm.tsp[4 * sp + 2 * t][j] = sm.tsp[4 * sp + 2 * t + 1][j] = 0.0


def window_times(sm: Smem, mt: int):
    d = np.zeros((3, 2, 32, 4))
    for s in range(8):
        b = [[[list(sm.zsp[8 * nt + (l >> 2), 8 * s + (l & 3)]), list(sm.zsp[8 * nt + (l >> 2), 8 * s + 4 + (l & 3)])]
              for l in range(32)] for nt in range(2)]
        for sp in range(3):
            rows = []
            for lane in range(32):
                m = lane >> 3
                k = 16 * s + 8 * (m >> 1) + (lane & 7)
                rows.append(sm.b_row(sp, k, 2 * mt + (m & 1)))
            a = ldmatrix(rows, True)
            for nt in range(2):
                d[sp, nt] = mma(a, b[nt], d[sp, nt], "k16")
    e = (d[2] + d[1]) + d[0]
    store_contraction(sm, mt, e)


def factors_t_times(sm: Smem, xs: np.ndarray, mt: int):
    d = np.zeros((2, 32, 4))
    for s in range(8):
        rows = []
        for lane in range(32):
            m = lane >> 3
            j = 16 * mt + 8 * (m & 1) + (lane & 7)
            rows.append(sm.a_row(j, 2 * s + (m >> 1)))
        a = ldmatrix(rows, False)
        for nt in range(2):
            b = [[list(xs[8 * nt + (l >> 2), 8 * s + (l & 3)]), list(xs[8 * nt + (l >> 2), 8 * s + 4 + (l & 3)])]
                 for l in range(32)]
            d[nt] = mma(a, b, d[nt], "k16")
    store_contraction(sm, mt, d)


def tsp_word(sm, row, w):
    return [sm.tsp[row][2 * w], sm.tsp[row][2 * w + 1]]


def factors_times(sm: Smem, warp: int):
    rows4, rows2 = [], []
    for lane in range(32):
        m, r8 = (lane >> 3) & 3, lane & 7
        vc = 2 * warp + (m & 1)
        rows4.append(sm.a_row(r8 + 8 * (m >> 1), vc))
        rows2.append(sm.a_row(16 + r8, vc))
    a4, a2 = ldmatrix(rows4, True), ldmatrix(rows2[:16], True)
    r = np.zeros((2, 32, 4))
    for nt in range(2):
        b = [[tsp_word(sm, 8 * nt + (l >> 2), l & 3), tsp_word(sm, 8 * nt + (l >> 2), 4 + (l & 3))] for l in range(32)]
        r[nt] = mma(a4, b, r[nt], "k16")
        b2 = [[tsp_word(sm, 8 * nt + (l >> 2), 8 + (l & 3))] for l in range(32)]
        r[nt] = mma(a2, b2, r[nt], "k8")
    return r


def window_t_times(sm: Smem, warp: int):
    r = np.zeros((2, 32, 4))
    b = [[[tsp_word(sm, 8 * nt + (l >> 2), w * 4 + (l & 3)) for w in range(3)] for l in range(32)] for nt in range(2)]
    for sp in (2, 1, 0):
        rows4, rows2 = [], []
        for lane in range(32):
            m = lane >> 3
            k = 16 * warp + 2 * (lane & 7) + (m & 1)
            rows4.append(sm.b_row(sp, k, m >> 1))
            rows2.append(sm.b_row(sp, k, 2))
        a4, a2 = ldmatrix(rows4, False), ldmatrix(rows2[:16], False)
        for nt in range(2):
            r[nt] = mma(a4, [bl[:2] for bl in b[nt]], r[nt], "k16")
            r[nt] = mma(a2, [bl[2:] for bl in b[nt]], r[nt], "k8")
    return r


def store_product(sm: Smem, warp: int, trans: bool, d, d4, r, scale, w_hi=2.0 ** -7):
    """flush.cu's store_product with E = 6 (piece 0 weighs 1: w_hi = 2^-7)."""
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        if t >= 2:
            continue
        for i in range(4):
            f_own = d4[lane][i] * w_hi * 2.0 ** -21 + d[lane][i] * w_hi
            f_par = d4[lane + 2][i] * w_hi * 2.0 ** -21 + d[lane + 2][i] * w_hi * 2.0 ** -14
            sh = r[0][lane + 2][i]
            row = 16 * warp + 2 * g + (i >> 1) if trans else 16 * warp + 8 * (i >> 1) + g
            sm.red[2 * t + (i & 1)][row] = scale[row] * (f_own + f_par) + ((r[1][lane][i] + sh) + r[0][lane][i])


# ---- checks -------------------------------------------------------------------------------------------------------

def check(name: str, got: np.ndarray, want: np.ndarray) -> bool:
    ok = np.array_equal(got, want)
    print(f"{name}: {'ok' if ok else 'MISMATCH'}" + ("" if ok else f" (max diff {np.nanmax(np.abs(got - want))})"))
    return ok


def main() -> int:
    ok = True
    sm = Smem()
    C = rng.integers(-127, 128, (V, K))
    for v in range(V):
        for c in range(8):
            sm.codes[v, c ^ (v & 7)] = C[v, 16 * c: 16 * c + 16]
    digits = rng.integers(-64, 65, (5, R, 128))
    weights = [2.0 ** (-7 * p) for p in range(5)]             # piece p's weight relative to piece 0

    # C^T y: rows k of every warp, the digit sums H, L, I4 recombined
    stage_digits(sm, digits, True)
    want = sum(w * (C.T @ digits[p].T) for p, w in enumerate(weights))          # [K, R]
    got = np.full((K, R), np.nan)
    rank_zero = np.zeros((2, 32, 4))
    scale = np.ones(K)
    for warp in range(8):
        d, d4 = codes_t_times(sm, warp)
        store_product(sm, warp, True, d, d4, rank_zero, scale)
    got = sm.red[:, :K].T
    ok &= check("C^T y (int8 digits, ldmatrix.trans + byte permutes, rows k0 + 2g + h)", got, want)

    sm.red[:] = np.nan
    sm.dig[:] = 0
    stage_digits(sm, digits, False)
    want = sum(w * (C @ digits[p].T) for p, w in enumerate(weights))             # [V, R]
    for warp in range(8):
        d, d4 = codes_times(sm, warp)
        store_product(sm, warp, False, d, d4, rank_zero, np.ones(V))
    ok &= check("C z (int8 digits, ldmatrix)", sm.red[:, :V].T, want)

    # the rank part: A^T [32][V] (rows 24-31 garbage), B [3 splits][32][K] (chunk 3 garbage)
    A = rng.integers(-8, 9, (32, V)).astype(float)
    Bs = rng.integers(-8, 9, (3, 32, K)).astype(float)
    A[24:] = np.nan
    Bs[:, 24:] = np.nan
    for j in range(32):
        for c in range(16):
            sm.asm[j, c ^ (j & 7)] = A[j, 8 * c: 8 * c + 8]
    for sp in range(3):
        for k in range(K):
            for c in range(4):
                sm.bsm[sp, k, bsm_chunk(k, c)] = Bs[sp, 8 * c: 8 * c + 8, k]
    Bsum = Bs.sum(0)

    # t = B z (warps 0, 1), then A t (every warp)
    z = rng.integers(-8, 9, (3, R, K)).astype(float)          # three splits of z
    sm.zsp[:] = np.nan
    for sp in range(3):
        for n in range(R):
            sm.zsp[4 * sp + n, :K // 2] = z[sp, n].reshape(-1, 2)
    sm.tsp[:] = np.nan
    for mt in range(2):
        window_times(sm, mt)
    tz = Bsum[:24] @ z.sum(0).T                                # [24, R]
    ok &= check("B z (ldmatrix.trans of B, z splits; tsp)", sm.tsp[:R, :24].T, tz)
    want = A[:24].T @ tz                                       # [V, R]
    got = np.zeros((V, R))
    for warp in range(8):
        r = factors_times(sm, warp)
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            if t < 2:
                for i in range(4):
                    row = 16 * warp + 8 * (i >> 1) + g
                    got[row, 2 * t + (i & 1)] = (r[1][lane][i] + r[0][lane + 2][i]) + r[0][lane][i]
    ok &= check("A t (ldmatrix.trans of A^T, tsp)", got, want)

    # t' = A^T x, then B^T t'
    x = rng.integers(-8, 9, (3, R, V)).astype(float)
    xs = np.full((16, SPLIT, 2), np.nan)
    for sp in range(3):
        for n in range(R):
            xs[4 * sp + n, :V // 2] = x[sp, n].reshape(-1, 2)
    sm.tsp[:] = np.nan
    for mt in range(2):
        factors_t_times(sm, xs, mt)
    tx = A[:24] @ x.sum(0).T                                   # [24, R]
    ok &= check("A^T x (ldmatrix of A^T, x splits; tsp)", sm.tsp[:R, :24].T, tx)
    want = Bsum[:24].T @ tx                                    # [K, R]
    got = np.zeros((K, R))
    for warp in range(8):
        r = window_t_times(sm, warp)
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            if t < 2:
                for i in range(4):
                    row = 16 * warp + 2 * g + (i >> 1)
                    got[row, 2 * t + (i & 1)] = (r[1][lane][i] + r[0][lane + 2][i]) + r[0][lane][i]
    ok &= check("B^T t' (ldmatrix of B, rows k0 + 2g + h; tsp)", got, want)

    # the rebuild with the new tokens' factors (j 24-31 written as store_tokens does) against A B over j < 32
    qn = rng.integers(-8, 9, (R, V)).astype(float)             # hi(q_new) and lo(q_new) stand in as qn and qn / 2
    un = rng.integers(-8, 9, (R, K)).astype(float)
    for tx_ in range(256):
        k, hf = tx_ >> 1, tx_ & 1
        jp = 2 * hf
        c3 = bsm_chunk(k, 3)
        for sp, val in ((0, -un), (1, -un / 4), (2, 0 * un)):
            for w, jj in ((hf, 24 + jp), (2 + hf, 28 + jp)):
                sm.bsm[sp, k, c3, 2 * w], sm.bsm[sp, k, c3, 2 * w + 1] = val[jp][k], val[jp + 1][k]
        v = k
        for j, val in ((24 + jp, qn[jp][v]), (25 + jp, qn[jp + 1][v]), (28 + jp, qn[jp][v] / 2),
                       (29 + jp, qn[jp + 1][v] / 2)):
            sm.asm[j, (v >> 3) ^ (j & 7), v & 7] = val
    A2 = A.copy()
    A2[24:28], A2[28:] = qn, qn / 2
    B2 = Bs.copy()
    B2[0, 24:28] = B2[0, 28:] = -un
    B2[1, 24:28] = B2[1, 28:] = -un / 4
    B2[2, 24:] = 0
    want = A2.T @ B2.sum(0)                                    # [V, K]
    got = np.full((V, K), np.nan)
    for warp in range(8):
        wr, wc = warp >> 1, warp & 1
        for mt in range(2):
            rows_a, rows_b = [], []
            for lane in range(32):
                m, r8 = (lane >> 3) & 3, lane & 7
                vc = (32 * wr + 16 * mt) // 8 + (m & 1)
                rows_a.append((sm.a_row(r8 + 8 * (m >> 1), vc), sm.a_row(16 + r8 + 8 * (m >> 1), vc)))
            afr_lo = ldmatrix([ra[0] for ra in rows_a], True)
            afr_hi = ldmatrix([ra[1] for ra in rows_a], True)
            for nt in range(8):
                acc = np.zeros((32, 4))
                for sp in (2, 1, 0):
                    rows = []
                    for lane in range(32):
                        m, r8 = (lane >> 3) & 3, lane & 7
                        k = 64 * wc + 16 * (r8 >> 1) + 2 * nt + (r8 & 1)
                        rows.append(sm.b_row(sp, k, m))
                    b = ldmatrix(rows, False)
                    acc = mma(afr_lo, [[bl[0], bl[1]] for bl in b], acc, "k16")
                    acc = mma(afr_hi, [[bl[2], bl[3]] for bl in b], acc, "k16")
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    for c in range(4):
                        v = 32 * wr + 16 * mt + 8 * (c >> 1) + g
                        col = 2 * t + (c & 1)                  # accumulator column -> k (the file header's order)
                        k = 64 * wc + 16 * (col >> 1) + 2 * nt + (col & 1)
                        got[v, k] = acc[lane][c]
    ok &= check("rebuild A B over j < 32 (new tokens in A^T rows 24-31, B chunk 3)", got, want)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
