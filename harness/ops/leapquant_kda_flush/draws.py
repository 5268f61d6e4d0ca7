"""Bit-reproducible arithmetic for the input families: seeded fp64 draws, reductions in a fixed order and an exp
built from correctly rounded operations (see the package docstring for why)."""
from __future__ import annotations

import math

import torch


class Draws:
    """Seeded fp64 draws that give the same bits on every machine and torch version."""

    def __init__(self, seed: int, device: torch.device):
        self.generator = torch.Generator().manual_seed(seed)
        self.device = device

    def uniform(self, shape, lo=0.0, hi=1.0) -> torch.Tensor:
        x = torch.rand(shape, generator=self.generator, dtype=torch.float64).to(self.device)
        return x * (hi - lo) + lo

    def normal(self, shape) -> torch.Tensor:
        """Irwin-Hall approximation of N(0, 1): four uniforms, exact arithmetic only."""
        s = self.uniform(shape) + self.uniform(shape) + self.uniform(shape) + self.uniform(shape)
        return (s - 2.0) * math.sqrt(3.0)

    def integers(self, shape, lo: int, hi: int) -> torch.Tensor:
        """Uniform integers in [lo, hi] as fp64."""
        return torch.floor(self.uniform(shape) * (hi - lo + 1)) + lo


def ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum along `dim` in index order: the same bits on every device, unlike torch's reductions."""
    x = x.movedim(dim, 0)
    acc = x[0].clone()
    for i in range(1, x.shape[0]):
        acc += x[i]
    return acc


def ordered_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., m, n] @ b [..., n, p] with the n-sum in index order."""
    a_cols = a.movedim(-1, 0).contiguous()     # contiguous slices: strided ones are several times slower
    b_rows = b.movedim(-2, 0).contiguous()
    acc = a_cols[0][..., :, None] * b_rows[0][..., None, :]
    for i in range(1, a_cols.shape[0]):
        acc += a_cols[i][..., :, None] * b_rows[i][..., None, :]
    return acc


def exact_exp(x: torch.Tensor) -> torch.Tensor:
    """exp of an fp64 tensor from correctly rounded operations only, so every device gives the same bits (libm and
    vectorised exps differ in the last bit): 2^n * exp(r), r = x - n ln2 with ln2 split in two (Cody-Waite) and a
    degree-20 Taylor polynomial on |r| <= ln2 / 2."""
    x = x.clamp(-800.0, 700.0)                      # exp(-800) underflows to 0 as it should
    n = torch.round(x * (1.0 / math.log(2.0)))
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = torch.ones_like(r)
    for k in range(20, 0, -1):
        p = p * (r * (1.0 / k)) + 1.0
    half = torch.floor(n * 0.5)                     # two factors keep each 2^m inside the normal exponent range
    for m in (half, n - half):
        p = p * ((m.to(torch.int64) + 1023) << 52).view(torch.float64)
    return p


_LN2_HI = 0.693147180369123816490                  # ln2's leading 32 bits: n * _LN2_HI is exact
_LN2_LO = 1.90821492927058770002e-10

