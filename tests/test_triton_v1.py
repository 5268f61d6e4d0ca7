"""triton_v1 on heads whose state is exactly rank-deficient, through the interpreter: a fresh sequence (empty
checkpoint) whose window holds a single live entry, a state of rank 1. Its Gram-Schmidt once normalised a remainder
below fp32 rounding (non-finite u and q) or left it along the first column (a head over the cap)."""
import pytest
import torch

from harness.ops import leapquant_kda_flush as op
from harness.solutions import load_entry, load_solution


def _fresh_sequence_one_entry(defn, seed: int) -> dict:
    axes = defn.resolve_axes({"batch_size": 1})
    x = op.make_inputs("random", axes, seed)
    x["codes"].zero_()
    x["u"].zero_()
    x["q"].zero_()
    x["s_k"].fill_(op.EPS)
    x["s_v"].fill_(op.EPS)
    x["w"][..., 1:] = 0.0
    x["gbuf"].fill_(1.0)
    x["pcum"].zero_()
    return x


@pytest.mark.parametrize("seed", [11, 12])
def test_rank_one_state_of_a_fresh_sequence(defn, seed):
    run = load_entry(load_solution("triton_v1", defn), defn)
    x = _fresh_sequence_one_entry(defn, seed)
    outputs = run(x, defn.resolve_axes({"batch_size": 1}))
    assert all(torch.isfinite(t.float()).all() for t in outputs)
    verdict = op.judge(x, outputs, defn.reference_run()(**x))
    assert verdict.passed, verdict.reason
