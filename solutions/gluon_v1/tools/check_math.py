# SPDX-License-Identifier: Apache-2.0
"""CPU checks, in plain torch, of the arithmetic kernel.py relies on, where it can be checked without a GPU:

1. the three-way bf16 split of fp32 (hi + mid + lo, round to nearest even) and the exact two-way split of fp16;
2. the window decay D_j = prod_{i > j} g_i built from the top, bit-identical to the reference's flipped cumprod;
3. CGS2 as _cgs2_column computes it (fp32, the same formulas and branches) against the reference's MGS2 in fp64:
   orthonormality, the same span, dependent columns zero, on random, rank-deficient, zero, hot-row and tiny inputs;
4. round half to even by the 1.5 * 2^23 add: the low byte of the sum's bits is torch.round over [-127, 127].

    python solutions/gluon_v1/tools/check_math.py      (prints one line per check, exits 1 on a failure)"""
import sys

import torch

FAILURES = []


def check(name, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}")
    if not ok:
        FAILURES.append(name)


def split3(x):
    hi = x.to(torch.bfloat16)
    r = x - hi.float()
    mid = r.to(torch.bfloat16)
    lo = (r - mid.float()).to(torch.bfloat16)
    return hi, mid, lo


def check_splits(gen):
    x = torch.randn(1 << 20, generator=gen) * torch.exp2(torch.randint(-60, 60, (1 << 20,), generator=gen).float())
    hi, mid, lo = split3(x)
    err = ((hi.double() + mid.double() + lo.double()) - x.double()).abs() / x.double().abs()
    check("split3 relative error <= 2^-24", float(err.max()) <= 2.0 ** -24, f"(max {float(err.max()):.3e})")
    h = (torch.randn(1 << 20, generator=gen) * 100).half()
    xf = h.float()
    xh = xf.to(torch.bfloat16)
    xl = (xf - xh.float()).to(torch.bfloat16)
    check("fp16 = bf16 hi + lo exactly", bool(((xh.float() + xl.float()) == xf).all()))


def check_decay(gen):
    g = torch.rand(64, 16, 128, generator=gen).half().float().clamp_min(1e-3)
    after = torch.flip(torch.cumprod(torch.flip(g, [-2]), -2), [-2])
    ref = torch.cat([after[..., 1:, :], torch.ones_like(after[..., :1, :])], -2)
    d = torch.ones_like(g)
    dj = torch.ones_like(g[..., 0, :])
    for jj in range(15):
        dj = dj * g[..., 15 - jj, :]
        d[..., 14 - jj, :] = dj
    # torch's CPU cumprod may associate differently; the kernel multiplies in sequence from the top
    rel = float(((d.double() - ref.double()).abs() / ref.double()).max())
    check("D_j from the top == the reference's cumprod (within the rounding of 15 products)", rel <= 16 * 2.0 ** -24,
          f"(max relative difference {rel:.2e})")


def mgs2_ref(m):
    cols = []
    for j in range(m.shape[-1]):
        v = m[..., j]
        for _ in range(2):
            for c in cols:
                v = v - c * (c * v).sum(-1, keepdim=True)
        cols.append(v / v.norm(dim=-1, keepdim=True).clamp_min(1e-30))
    return torch.stack(cols, -1)


def rsqrt_ftz(x):
    """rsqrt.approx.ftz.f32, gl.rsqrt's instruction: a subnormal input reads as 0 (its approximation error aside)."""
    return torch.rsqrt(torch.where(x.abs() < 2.0 ** -126, torch.zeros_like(x), x))


def inv_norm(v, nn):
    """kernel.py's _inv_norm."""
    inv = rsqrt_ftz(nn)
    if bool(nn < 2.0 ** -64):
        w = v * 2.0 ** 64
        ww = (w * w).sum()
        inv = rsqrt_ftz(ww) * 2.0 ** 64 if bool(ww > 0) else torch.tensor(0.0)
    return inv


def cgs2_kernel(a):
    """kernel.py's _cgs2 on one [128, 4] fp32 matrix (scalars as 0-d tensors, fp32 throughout)."""
    a = [a[:, j].clone() for j in range(4)]
    dot = lambda x, y: (x * y).sum()                                           # noqa: E731
    r = []
    for J in range(4):
        nxt = J + 1 < 4
        v = a[J]
        for p in range(J):
            v = v - a[p] * r[p]
        s0 = dot(v, v)
        d = [dot(a[p], v) for p in range(J)]
        if nxt:
            e = dot(v, a[J + 1])
            f = [dot(a[p], a[J + 1]) for p in range(J)]
        nn = s0
        for p in range(J):
            v = v - a[p] * d[p]
            nn = nn - d[p] * d[p]
        inv = inv_norm(v, nn)
        if J > 0:
            if not bool(nn > 1e-4 * s0):
                t0 = dot(v, v)
                t = [dot(a[p], v) for p in range(J)]
                nn = t0
                for p in range(J):
                    v = v - a[p] * t[p]
                    nn = nn - t[p] * t[p]
                    if nxt:
                        e = e - t[p] * f[p]
            dependent = not bool(nn > 2.0 ** -24 * s0)
            inv = torch.tensor(0.0) if dependent else inv_norm(v, nn)
        a[J] = v * inv
        if nxt:
            for p in range(J):
                e = e - d[p] * f[p]
            r = f + [e * inv]
    return torch.stack(a, -1)


def check_cgs2(gen):
    # name -> (input, its rank in exact arithmetic)
    cases = {"random": torch.randn(128, 4, generator=gen),
             "tiny 1e-4": torch.randn(128, 4, generator=gen) * 1e-4,
             "huge 1e4": torch.randn(128, 4, generator=gen) * 1e4,
             "zero": torch.zeros(128, 4)}
    x = torch.randn(128, generator=gen)
    cases["rank 1"] = x[:, None] * torch.randn(1, 4, generator=gen)
    cases["rank 2"] = torch.randn(128, 2, generator=gen) @ torch.randn(2, 4, generator=gen)
    hot = torch.randn(128, 4, generator=gen) * 1e-3
    hot[7] = 1e3 * torch.randn(4, generator=gen)
    cases["hot row"] = hot
    cases["rank 1, hot row"] = (x * torch.where(torch.arange(128) == 7, 1e3, 1.0))[:, None] \
        * torch.randn(1, 4, generator=gen)
    # a column whose squares are subnormal beside normal ones (a near-zero row of the state met by a one-hot q0)
    subnormal = torch.randn(128, 4, generator=gen) * 1e-6
    subnormal[:, 1] = torch.randn(128, generator=gen) * 1e-21
    cases["a column at 1e-21"] = subnormal
    exact_rank = {"zero": 0, "rank 1": 1, "rank 2": 2, "rank 1, hot row": 1}
    for name, m in cases.items():
        c = cgs2_kernel(m.float())
        ref = mgs2_ref(m.double())
        rank = exact_rank.get(name, 4)
        live = c.norm(dim=0) > 0.5
        gram = c.double().T @ c.double()
        orth = float((gram - torch.diag(live.double())).abs().max())
        ref32 = mgs2_ref(m.float()).double()
        orth32 = float((ref32.T @ ref32 - torch.eye(4, dtype=torch.float64)).abs().max())
        # the first `rank` columns span what the reference's first `rank` columns span (the rest, where the input is
        # rank-deficient, is rounding: zero or any unit vector orthogonal to the first ones)
        rc, cc = ref[:, :rank], c.double()[:, :rank]
        span = float((rc @ (rc.T @ cc) - cc).abs().max()) if rank else 0.0
        finite = bool(torch.isfinite(c).all())
        # beyond the rank, a rounding column whose second pass removed most of it keeps the cancellation of
        # ||v||^2 - sum d_p^2 in its norm (CGS2 as cuda_v1 runs it; the reference's fp32 MGS2 beside it)
        ok = finite and orth < (1e-5 if rank == 4 else 1e-4) and span < 1e-4 and bool(live[:rank].all())
        check(f"CGS2 {name}", ok, f"(rank {rank}, live {int(live.sum())}, |C^T C - I| {orth:.1e}, "
                                  f"off-span {span:.1e}; reference MGS2 in fp32: |C^T C - I| {orth32:.1e})")


def check_rounding():
    x = torch.linspace(-127.0, 127.0, 2_000_001)
    x = torch.cat([x, torch.arange(-127, 128).float() + 0.5, torch.arange(-127, 127).float() - 0.5,
                   torch.tensor([127.00002, -127.00002])])
    x = x[x.abs() <= 127.00002]
    y = torch.addcmul(torch.full_like(x, 12582912.0), x, torch.ones_like(x))    # one rounding, as the FMA
    code = y.view(torch.int32).to(torch.int8)
    ref = torch.round(x).clamp(-127, 127).to(torch.int8)
    check("1.5 * 2^23 add, low byte == torch.round (half to even)", bool((code == ref).all()))


def main() -> int:
    gen = torch.Generator().manual_seed(7)
    check_splits(gen)
    check_decay(gen)
    check_cgs2(gen)
    check_rounding()
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
