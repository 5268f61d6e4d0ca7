"""CPU emulation of cuda_v2's subspace products, in the kernel's arithmetic, against fp64 products.

The kernel computes  S z = s_v o C (cs o z) + A (B z)  and  S^T x = cs o C^T (s_v o x) + B^T (A^T x)  from the inputs
(flush.cu, stage 2). The code part is emulated exactly as the kernel does it:
  - E = ceil(log2(max)) of the program's |cs| (S z), |s_v| (S^T qv) or |s_v| max_j |q0| (S^T q0), clamped to
    [-100, 100];
  - y = fp32(scale * x), r = y * 2^(6-E); five digits d = (r + 1.5 * 2^23) - 1.5 * 2^23 (round half to even), each
    followed by r = (r - d) * 128, all in fp32;
  - int32 sums over the whole reduction: H = 128 C d0 + C d1, L = 128 C d2 + C d3, I4 = C d4 (exact integers);
  - f = fp32(H) * 2^(E-13) + fma(fp32(I4), 2^(E-34), fp32(L) * 2^(E-27)), product = fma(scale, f, rank).
--pieces 4 gives the four-digit form (H + L only) for comparison.
The rank-24 part (rank) stands in as fp32 of its fp64 value: on the GPU it is bf16 tensor-core products of three-way
splits (about 2^-24 relative per operand), the same order as fp32 rounding.

Two measurements per family, both on the operator's own inputs (harness.ops.leapquant_kda_flush.make_inputs):
  1. product error: for S^T q0, S qk, S^T qv (qk, qv from the fp64 pipeline), max over entries of
     |product - fp64 product| / (|S| |x|) (the fp32 error scale of each entry), per head; the kernel's form against
     fp32 products of the fp32-rebuilt state (cuda_v1 computes S^T q0 in fp32 FMAs and the others in 3xTF32, which is
     not more accurate than fp32).
  2. with --judge: the whole flush (cuda_v1's Gram-Schmidt, fp16 tokens, quantization in fp32) with these products,
     judged per head by the harness's criterion against the reference, beside the same flush with fp32 products and
     with fp64 products of the exact state (a head's ratio that fp64 products share is the reference's luck).

    python solutions/cuda_v2/tools/emulate_products.py --batch-size 8 --seed 1 [--judge]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

MAGIC = 12582912.0          # 1.5 * 2^23
PRODUCTS = ("S^T q0", "S qk", "S^T qv")
DEPENDENT = 2.0 ** -12      # Gram-Schmidt as cuda_v1 / cuda_v2: a second pass leaving less than this: a zero column
THIRD_PASS = 1e-2           # a second pass leaving less than this: a third pass


def digit_exponent(bound: torch.Tensor) -> torch.Tensor:
    """Per program, the least E with bound <= 2^E (bound: non-negative fp32 [...]), clamped to [-100, 100]."""
    mant, ex = torch.frexp(bound.float())
    e = torch.where(mant == 0.5, ex - 1, ex).to(torch.int64)
    e = torch.where(bound > 0, e, torch.full_like(e, -100))
    return e.clamp(-100, 100)


PIECES = 5


def digits(y: torch.Tensor, e: torch.Tensor, pieces: int) -> list[torch.Tensor]:
    """The signed 7-bit digits of fp32 y [..., n, R] under 2^e [...] (int64 tensors), in the kernel's fp32 steps."""
    r = y.float() * torch.exp2((6 - e).float())[..., None, None]          # exact power-of-two scaling
    out = []
    for p in range(pieces):
        m = r + MAGIC                                                     # fp32 add: rounds half to even
        d = m - MAGIC
        assert bool((d.abs() <= 127).all()), "digit outside int8"
        out.append(d.to(torch.int64))
        r = (r - d) * 128.0                                               # exact
    return out


def code_product(codes: torch.Tensor, y: torch.Tensor, e: torch.Tensor, pieces: int = PIECES) -> torch.Tensor:
    """codes [..., M, N] (int8) @ y [..., N, R] (fp32) as the kernel: exact integer sums of the digits, H, L and I4 to
    fp32 (H and L may round), scaled by powers of two and combined as the kernel does."""
    d = digits(y, e, pieces)
    c = codes.to(torch.int64)
    i = [c @ dp for dp in d]
    h, l = 128 * i[0] + i[1], 128 * i[2] + i[3]
    assert bool((h.abs() < 2 ** 31).all() and (l.abs() < 2 ** 31).all()), "int32 overflow"
    w_hi = torch.exp2((e - 13).float())[..., None, None]
    lo = l.float() * (w_hi * 2.0 ** -14)
    if pieces == 5:
        lo = fma32(i[4].float(), w_hi * 2.0 ** -21, lo)
    return h.float() * w_hi + lo


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fused multiply-add (one rounding of a*b + c; fp64 holds the fp32 product exactly)."""
    return (a.double() * b.double() + c.double()).float()


class Factors:
    """One batch's inputs in the kernel's factored form."""

    def __init__(self, x: dict, pieces: int = PIECES):
        self.pieces = pieces
        from harness.ops.leapquant_kda_flush.exact import decay_history
        self.codes = x["codes"]
        self.sv = x["s_v"].float()
        decay = torch.exp(x["pcum"].float())                               # fp32, as the kernel's expf
        self.cs = (x["s_k"].float() * (1.0 / 127.0)) * decay
        d = decay_history(x["gbuf"].float())
        # A [.., V, 20] and B [.., 20, K] of the rank part (the kernel's hi / lo rows of q add up to q exactly)
        self.a = torch.cat([(x["ubuf"].float()).transpose(-1, -2), x["q"].float().transpose(-1, -2)], -1).double()
        wk = x["w"].float()[..., None] * (x["kbuf"].float() * d)
        self.b = torch.cat([wk, x["u"].float() * decay[..., None, :]], -2).double()
        self.q0 = x["q0"].float()

    def s_times(self, z: torch.Tensor) -> torch.Tensor:
        """S z, z [.., K, R] fp32 with |z| <= 1 (Gram-Schmidt output)."""
        e = digit_exponent(self.cs.abs().amax(-1))
        part = code_product(self.codes, self.cs[..., :, None] * z, e, self.pieces)
        rank = (self.a @ (self.b @ z.double())).float()
        return fma32(self.sv[..., :, None], part, rank)

    def st_times(self, x: torch.Tensor, first: bool) -> torch.Tensor:
        """S^T x, x [.., V, R] fp32: q0 (first) or qv."""
        if first:
            bound = (self.sv.abs() * self.q0.abs().amax(-1)).amax(-1)     # fp32 products, as the kernel's maxima
        else:
            bound = self.sv.abs().amax(-1)
        e = digit_exponent(bound)
        part = code_product(self.codes.transpose(-1, -2), self.sv[..., :, None] * x, e, self.pieces)
        rank = (self.b.transpose(-1, -2) @ (self.a.transpose(-1, -2) @ x.double())).float()
        return fma32(self.cs[..., :, None], part, rank)


def gram_schmidt(m: torch.Tensor) -> torch.Tensor:
    """Columns of m [..., n, R] orthonormalised in order as the kernel does (classical, twice, a third time where the
    second pass leaves under 1%; a column the second pass finds dependent becomes zero)."""
    cols = []
    for j in range(m.shape[-1]):
        v, first = m[..., j], None
        for p in range(3 if cols else 0):
            q = torch.stack(cols, -1)
            projected = v - (q * (q * v[..., None]).sum(-2, keepdim=True)).sum(-1)
            if p == 0:
                v, first = projected, projected.norm(dim=-1, keepdim=True)
            elif p == 1:
                v = projected
                third = v.norm(dim=-1, keepdim=True) < THIRD_PASS * first
            else:
                v = torch.where(third, projected, v)
        norm = v.norm(dim=-1, keepdim=True)
        keep = norm > 1e-30 if first is None else (norm > 1e-30) & (norm >= DEPENDENT * first)
        cols.append(torch.where(keep, v / norm.clamp_min(1e-30), 0.0))
    return torch.stack(cols, -1)


def fp32_state(x: dict) -> torch.Tensor:
    """The state rebuilt in fp32 (what cuda_v1 holds in registers and takes its products from)."""
    from harness.ops.leapquant_kda_flush.exact import decay_history
    decay = torch.exp(x["pcum"].float())
    d = decay_history(x["gbuf"].float())
    return (torch.einsum("...rv,...rk->...vk", x["q"].float(), x["u"].float())
            + x["codes"].float() * (x["s_k"].float()[..., None, :] / 127.0) * x["s_v"].float()[..., :, None]) \
        * decay[..., None, :] + torch.einsum("...j,...jv,...jk->...vk", x["w"].float(), x["ubuf"].float(),
                                             x["kbuf"].float() * d)


def product_errors(x: dict, pieces: int = PIECES) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per head and product: (kernel-form error, fp32-from-the-state error), each the largest over the vectors of
    ||error|| / || |S| |x| ||."""
    from harness.ops.leapquant_kda_flush.exact import exact_state
    s64 = exact_state(x)
    s32 = fp32_state(x)
    f = Factors(x, pieces)
    q0 = x["q0"].float().expand(*s64.shape[:-2], *x["q0"].shape)
    qk = gram_schmidt(s64.transpose(-1, -2) @ q0.double()).float()
    qv = gram_schmidt(s64 @ qk.double()).float()
    cases = {
        "S^T q0": (s64.transpose(-1, -2), q0, lambda: f.st_times(q0, True)),
        "S qk": (s64, qk, lambda: f.s_times(qk)),
        "S^T qv": (s64.transpose(-1, -2), qv, lambda: f.st_times(qv, False)),
    }
    out = {}
    for name, (m64, vec, factored) in cases.items():
        exact = m64 @ vec.double()
        scale = (m64.abs() @ vec.double().abs()).norm(dim=-2).clamp_min(1e-300)
        m32 = s32.transpose(-1, -2) if name != "S qk" else s32
        err_k = ((factored().double() - exact).norm(dim=-2) / scale).amax(-1)
        err_32 = (((m32 @ vec).double() - exact).norm(dim=-2) / scale).amax(-1)
        out[name] = (err_k, err_32)
    return out


def flush(x: dict, products: str, pieces: int = PIECES):
    """The flush with the kernel's products ("kernel"), fp32 products of the fp32 state ("fp32") or fp64 products of
    the exact state rounded to fp32 ("fp64"); the rest in fp32 as the kernel (Gram-Schmidt, fp16 tokens, residual,
    scales, codes)."""
    from harness.ops.leapquant_kda_flush.exact import exact_state
    from harness.ops.leapquant_kda_flush.layout import EPS, QMAX
    s = fp32_state(x)
    q0 = x["q0"].float().expand(*s.shape[:-2], *x["q0"].shape)
    if products == "kernel":
        f = Factors(x, pieces)
        qk = gram_schmidt(f.st_times(q0, True))
        qv = gram_schmidt(f.s_times(qk))
        uk = f.st_times(qv, False)
    elif products == "fp64":
        s64 = exact_state(x)
        qk = gram_schmidt((s64.transpose(-1, -2) @ q0.double()).float())
        qv = gram_schmidt((s64 @ qk.double()).float())
        uk = (s64.transpose(-1, -2) @ qv.double()).float()
    else:
        qk = gram_schmidt(s.transpose(-1, -2) @ q0)
        qv = gram_schmidt(s @ qk)
        uk = s.transpose(-1, -2) @ qv
    u_new, q_new = uk.transpose(-1, -2).half(), qv.transpose(-1, -2).half()
    e = s - torch.einsum("...rv,...rk->...vk", q_new.float(), u_new.float())
    sk = e.abs().mean(-2).sqrt().clamp_min(EPS)
    sv = (e.abs() / sk[..., None, :]).amax(-1).clamp_min(EPS)
    c = torch.round(e / (sk[..., None, :] * sv[..., :, None]) * QMAX).clamp(-QMAX, QMAX).to(torch.int8)
    return c, sk, sv, u_new, q_new


ROOT = Path(__file__).resolve().parents[3]          # the repository (solutions/cuda_v2/tools/ is three below)


def definition():
    from harness.definition import project_definition
    from harness.project import Project
    return project_definition(Project.at(ROOT))


def inputs(family: str, batch_size: int, seed: int) -> dict:
    from harness.ops.leapquant_kda_flush import make_inputs
    return make_inputs(family, definition().resolve_axes({"batch_size": batch_size}), seed)


def main(argv=None) -> int:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from harness.ops.leapquant_kda_flush import FAMILIES
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--pieces", type=int, choices=(4, 5), default=PIECES, help="digits per entry (the kernel: 5)")
    p.add_argument("--judge", action="store_true", help="also judge whole flushes by the harness's criterion")
    args = p.parse_args(argv)
    for family in args.families.split(","):
        x = inputs(family, args.batch_size, args.seed)
        errs = product_errors(x, args.pieces)
        cells = [f"{name}: {float(k.max()):.2e} vs fp32 {float(e.max()):.2e} (median {float(k.median()):.1e} vs "
                 f"{float(e.median()):.1e})" for name, (k, e) in errs.items()]
        print(f"{family}: " + " | ".join(cells), flush=True)
        if args.judge:
            from harness.ops.leapquant_kda_flush.criterion import judge
            from harness.solutions import load_entry, reference_solution
            defn = definition()
            axes = defn.resolve_axes({"batch_size": args.batch_size})
            expected = load_entry(reference_solution(defn), defn)({k: x[k] for k in defn.inputs}, axes)
            for label, products in (("kernel products", "kernel"), ("fp32 products", "fp32"),
                                    ("fp64 products", "fp64")):
                v = judge(x, flush(x, products, args.pieces), expected, defn.reference)
                print(f"  {label}: {'PASSED' if v.passed else 'FAILED'}, worst-head ratio {v.score or 0.0:.4f}"
                      + ("" if v.passed else f" ({v.reason})"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
