"""Precision study of the subspace products computed from the inputs rather than from the rebuilt state (a design
for a faster CUDA kernel): S z = s_v o C (cs o z) + A (B z) and S^T x = cs o C^T (s_v o x) + B^T (A^T x), with C the
int8 codes, cs = s_k / 127 exp(pcum), A = [q^T | w o ubuf^T] and B = [u o exp(pcum); kbuf o D] the rank-20 part.
The code products are exact on integer tensor cores when the fp32 vector is split into signed 7-bit pieces under one
power-of-two scale per vector (a bound known before the vector is: |z| <= 1 after Gram-Schmidt), so the only new
error is the pieces' truncation; everything else here is fp32 (the rank-20 part stands for a three-way bf16 split).
Gram-Schmidt as cuda_v1's (a third pass where the second leaves under 1% of a column, a column the second pass finds
dependent a zero token). Each variant's checkpoint is judged per head by the harness's own criterion on fresh draws
of each family, beside the same pipeline with the products taken from the rebuilt fp32 state.

    python scripts/factored_precision.py --batch-size 64 --draws 3 --families edge,second_window,stress --pieces 3,4
"""
from __future__ import annotations

import argparse

import torch

from harness import cli
from harness.definition import project_definition
from harness.ops.leapquant_kda_flush.criterion import judge
from harness.ops.leapquant_kda_flush.exact import decay_history
from harness.ops.leapquant_kda_flush.layout import EPS, QMAX
from harness.solutions import load_entry, reference_solution
from harness.workloads import generate_tensors

DEPENDENT = 2.0 ** -12      # a second pass leaving less than this of the first pass's norm: a zero token
THIRD_PASS = 1e-2           # a second pass leaving less than this: project a third time


def gram_schmidt(m: torch.Tensor) -> torch.Tensor:
    """Columns of m [..., n, R] orthonormalised in order as cuda_v1 does (classical, twice or three times)."""
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


def pieces_product(codes: torch.Tensor, y: torch.Tensor, pieces: int, bound: torch.Tensor) -> torch.Tensor:
    """codes [..., M, N] (int8) @ y [..., N, R] (fp32), y split into `pieces` signed 7-bit digits under the power of
    two at or above `bound` [..., 1, R]: each digit's product exact (integers), the products combined in fp32."""
    scale = torch.ceil(torch.log2(bound.double().clamp_min(1e-300)))
    rest = y.double() / torch.exp2(scale) * 64.0                    # |rest| <= 64: a digit fits int8
    out = torch.zeros(codes.shape[:-1] + (y.shape[-1],), dtype=torch.float32)
    for i in range(pieces):
        digit = torch.round(rest)
        rest = (rest - digit) * 128.0
        out = out + (codes.double() @ digit).float() * torch.exp2(scale - 6 - 7 * i).float()
    return out


def flush(codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, q0, pieces: int | None):
    """The flush with the products from the rebuilt fp32 state (pieces None) or from the inputs (`pieces` digits)."""
    decay = torch.exp(pcum)
    d = decay_history(gbuf.float())
    state = (torch.einsum("...rv,...rk->...vk", q.float(), u.float())
             + codes.float() * (s_k[..., None, :] / QMAX) * s_v[..., :, None]) * decay[..., None, :] \
        + torch.einsum("...j,...jv,...jk->...vk", w, ubuf.float(), kbuf.float() * d)
    if pieces is None:
        qk = gram_schmidt(state.transpose(-1, -2) @ q0)
        qv = gram_schmidt(state @ qk)
        uk = state.transpose(-1, -2) @ qv
    else:
        cs = s_k / QMAX * decay
        a = torch.cat([q.float().transpose(-1, -2), (w[..., None] * ubuf.float()).transpose(-1, -2)], -1)
        b = torch.cat([u.float() * decay[..., None, :], kbuf.float() * d], -2)
        ones = torch.ones(q0.shape[-1])
        cs_bound = cs.abs().amax(-1)[..., None, None] * ones
        sv_bound = s_v.abs().amax(-1)[..., None, None] * ones

        def s_times(z):                      # |z| <= 1
            return s_v[..., :, None] * pieces_product(codes, cs[..., :, None] * z, pieces, cs_bound) + a @ (b @ z)

        def st_times(x, bound):
            return cs[..., :, None] * pieces_product(codes.transpose(-1, -2), s_v[..., :, None] * x, pieces, bound) \
                + b.transpose(-1, -2) @ (a.transpose(-1, -2) @ x)
        qk = gram_schmidt(st_times(q0.expand(*state.shape[:-2], *q0.shape), sv_bound * q0.abs().amax(0)))
        qv = gram_schmidt(s_times(qk))
        uk = st_times(qv, sv_bound)
    u_new, q_new = uk.transpose(-1, -2).half(), qv.transpose(-1, -2).half()
    e = state - torch.einsum("...rv,...rk->...vk", q_new.float(), u_new.float())
    sk = e.abs().mean(-2).sqrt().clamp_min(EPS)
    sv = (e.abs() / sk[..., None, :]).amax(-1).clamp_min(EPS)
    c = torch.round(e / (sk[..., None, :] * sv[..., :, None]) * QMAX).clamp(-QMAX, QMAX).to(torch.int8)
    return c, sk, sv, u_new, q_new


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=cli.description(__doc__), formatter_class=argparse.RawTextHelpFormatter)
    cli.add_project(p)
    cli.add_batch_size(p, 16)
    cli.add_families(p, ("edge", "second_window", "random", "stress"))
    p.add_argument("--draws", type=cli.positive_int, default=2, help="fresh draws per family (default 2)")
    p.add_argument("--pieces", type=cli.comma_list(int, "count", positive=True), default=(3, 4),
                   help="the digit counts to study (default 3,4)")
    args = p.parse_args(argv)
    defn = project_definition(cli.project_of(args))
    axes = defn.resolve_axes({"batch_size": args.batch_size})
    reference = load_entry(reference_solution(defn), defn)
    variants = [("from the state", None)] + [(f"{n} pieces", n) for n in args.pieces]
    for family in args.families:
        worst, failed = {name: 0.0 for name, _ in variants}, {name: 0 for name, _ in variants}
        for k in range(args.draws):
            seed = 7919 * (k + 1) + sum(map(ord, family))
            x = generate_tensors(defn, family, {"batch_size": args.batch_size}, seed)
            x = {name: x[name] for name in defn.inputs}
            expected = reference(x, axes)
            for name, pieces in variants:
                verdict = judge(x, flush(**x, pieces=pieces), expected, defn.reference)
                worst[name] = max(worst[name], verdict.score or 0.0)
                failed[name] += not verdict.passed
                if not verdict.passed:
                    print(f"  {family} seed {seed}, {name}: {verdict.reason}")
        print(f"{family}: " + " | ".join(f"{name}: worst {worst[name]:.4f}, {failed[name]} of {args.draws} failed"
                                         for name, _ in variants), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
