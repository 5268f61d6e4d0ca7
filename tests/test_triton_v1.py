"""triton_v1: heads whose state is exactly rank-deficient, through the interpreter, and the GPU path compiled for
sm_90a offline.

Rank-deficient heads: a fresh sequence (empty checkpoint) whose window holds a single live entry, a state of rank 1,
and the stress heads a search found on the GPU. The kernel's Gram-Schmidt once normalised a remainder below fp32
rounding (non-finite u and q), or left a dependent column along the first one (a head over the cap)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import PROJECT
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
    run = load_entry(load_solution("triton_v1", defn, PROJECT.solutions), defn)
    x = _fresh_sequence_one_entry(defn, seed)
    outputs = run(x, defn.resolve_axes({"batch_size": 1}))
    assert all(torch.isfinite(t.float()).all() for t in outputs)
    verdict = op.judge(x, outputs, defn.reference_run()(**x))
    assert verdict.passed, verdict.reason


HOT_ROW_RANK_ONE = {"checkpoint": "zero", "window": "one", "rank": 1, "scale": "hot_row", "values": "exact"}


@pytest.mark.parametrize("params, seed", [
    ({"programs": [{}, {}, {}, {}, {"keys": "cancel", "rank": 1, "decay": "none"}], "call": {}}, 1),  # cancelling
    ({"programs": [{}, {}, {}, {}, {"window": "one", "rank": 1, "scale": "deep", "values": "exact"}], "call": {}},
     22),                                                                                   # a rank-1 state at 2^-32
    ({"programs": [HOT_ROW_RANK_ONE] * 32, "call": {"q0": "one_hot"}}, 1),                 # rank 1, hot value row
])
def test_degenerate_heads_found_on_the_gpu(defn, params, seed):
    """Heads that the GPU found wrong (the degenerate-head search, python -m harness.stress, and the judge of every
    timed call), at their seeds: a column inside the span of the first, whose projections' rounding lay along that
    column, became a second copy of it (the first two); a nearly dependent column of a hot-row rank-1 head, which two
    passes left ~1e-3 of with an overlap on the first column, needs the third pass (test_torch_v1 has the seed at
    which two passes went over the cap)."""
    axes = defn.resolve_axes({"batch_size": 1})
    x = op.make_inputs("stress", axes, seed, params=params)
    run = load_entry(load_solution("triton_v1", defn, PROJECT.solutions), defn)
    outputs = run(x, axes)
    verdict = op.judge(x, outputs, defn.reference_run()(**x))
    assert verdict.passed, verdict.reason


TOOL = Path(__file__).resolve().parents[1] / "solutions" / "triton_v1" / "tools" / "compile_sm90.py"
# NOTES.md records 112-144 B of stack for the current version (triton 3.8; 120-152 B under 3.9); the variants it
# rejected for their spills reached 544 B to 3 KB. Above this, a change (or a Triton release) has pushed the kernel off
# that cliff.
STACK_BYTES_MAX = 512


def test_gpu_path_compiles_for_sm90a_within_its_register_budget():
    """The interpreter never compiles the GPU path (tensor-core dots, prefetch, the register cap): compile it here
    for sm_90a, without a device, in both modes."""
    import triton
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton's NVIDIA backend (its bundled ptxas) is not installed")
    res = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "0"})
    assert res.returncode == 0, res.stderr[-3000:]
    reports = {r["mode"]: r for r in map(json.loads, res.stdout.splitlines())}
    assert set(reports) == {"run", "pool"}, res.stdout
    for mode, r in reports.items():
        assert r["registers"] <= 128, r                      # 4 programs of 4 warps per SM
        assert r["stack_bytes"] <= STACK_BYTES_MAX, r
        assert r["sass_instructions"] > 1000, r
