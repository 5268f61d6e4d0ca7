"""scripts/factored_precision.py: the subspace products from the inputs, the code products in exact integer pieces.
The pieces' product is exact to its last digit, and the whole flush built on it passes the judge on every family."""
import importlib.util
from pathlib import Path

import pytest
import torch

from harness.ops.leapquant_kda_flush.families import FAMILIES

spec = importlib.util.spec_from_file_location("factored_precision",
                                              Path(__file__).parents[1] / "scripts" / "factored_precision.py")
factored_precision = importlib.util.module_from_spec(spec)
spec.loader.exec_module(factored_precision)


@pytest.mark.parametrize("pieces", [1, 2, 3, 4])
def test_the_pieces_product_errs_only_by_its_last_digit(pieces):
    gen = torch.Generator().manual_seed(pieces)
    codes = torch.randint(-127, 128, (3, 128, 128), generator=gen, dtype=torch.int8)
    y = (torch.rand(3, 128, 4, generator=gen) - 0.5) * torch.logspace(-6, 0, 4)     # columns across decades
    bound = y.abs().amax(-2, keepdim=True)
    exact = codes.double() @ y.double()
    error = (factored_precision.pieces_product(codes, y, pieces, bound).double() - exact).abs()
    # each element of y is cut at half a unit of its last digit, 2^-(6 + 7 (pieces - 1)) of the power-of-two scale
    # above bound (< 2 bound); fp32 sums add their rounding, 2^-24 of the largest sum
    last_digit = 2.0 * bound * 2.0 ** -(6 + 7 * (pieces - 1)) / 2 * 127 * 128
    assert (error <= last_digit + 2.0 ** -22 * exact.abs().amax(-2, keepdim=True)).all()
    if 1 < pieces < 4:  # and one digit fewer is measurably worse (at four, fp32 sums are the limit)
        coarser = factored_precision.pieces_product(codes, y, pieces - 1, bound).double()
        assert (coarser - exact).abs().max() > 8 * error.max()


def test_four_pieces_pass_the_judge_on_every_family(capsys):
    assert factored_precision.main(["--batch-size", "2", "--draws", "1", "--families", ",".join(FAMILIES),
                                    "--pieces", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    summaries = [line for line in lines if not line.startswith(" ")]
    assert len(summaries) == len(FAMILIES)
    assert all("0 of 1 failed | 4 pieces" in line and line.endswith("0 of 1 failed") for line in summaries), lines
