"""The decoded-state criterion of docs/operator.md: `judge` and the per-head errors it is built on."""
from __future__ import annotations

import math

import torch

from harness.ops import Verdict
from harness.ops.leapquant_kda_flush.exact import decode_checkpoint, exact_state
from harness.ops.leapquant_kda_flush.layout import QMAX

RATIO_LIMIT = 1.01      # err_candidate <= RATIO_LIMIT * err_reference ...
EXACT_HEAD = 1e-4       # ... where err_reference >= EXACT_HEAD * mean|S|; below it the format captures the head
EXACT_CAP = 1e-3        # almost exactly, and the candidate's error is capped at EXACT_CAP * mean|S| instead


def _abs_error(outputs, state: torch.Tensor) -> torch.Tensor:
    """|decode(checkpoint) - S| elementwise, for outputs (codes, s_k, s_v, u, q) in definition order."""
    return (decode_checkpoint(*outputs) - state).abs()


def head_errors(outputs, state: torch.Tensor) -> torch.Tensor:
    """Per-head mean |decode(checkpoint) - S| [B, H]."""
    return _abs_error(outputs, state).mean((-2, -1))


def _first_head(bad: torch.Tensor) -> tuple[int, int]:
    """(batch, head) of the first head with a True element in bad [B, H, ...]."""
    b, h = bad.flatten(2).any(-1).nonzero()[0].tolist()
    return b, h


def judge(inputs: dict, outputs, reference_outputs) -> Verdict:
    """docs/operator.md's criterion on the decoded state; outputs are in definition order, shapes and dtypes checked. A
    failed verdict names the first failing head in its reason and the kind of failure in extra["failure"]."""
    names = ("codes_new", "s_k_new", "s_v_new", "u_new", "q_new")
    for name, t in zip(names, outputs):
        if t.is_floating_point() and not torch.isfinite(t).all():
            b, h = _first_head(~torch.isfinite(t))
            return Verdict(False, f"non-finite values in {name} at (batch {b}, head {h})", None, math.inf, math.inf,
                           {"failure": f"non-finite {name}"})
    out_of_range = (outputs[0] < -QMAX) | (outputs[0] > QMAX)
    if out_of_range.any():
        b, h = _first_head(out_of_range)
        return Verdict(False, f"code {int(outputs[0][b, h].min())} out of range [-127, 127] in codes_new at "
                              f"(batch {b}, head {h})", None, math.inf, math.inf, {"failure": "code out of range"})
    state = exact_state(inputs)
    scale = state.abs().mean((-2, -1))
    abs_error = _abs_error(outputs, state)
    err, max_abs = abs_error.mean((-2, -1)), float(abs_error.max())
    del abs_error
    err_ref = head_errors(reference_outputs, state)
    # a head the reference itself gets non-finite (its fp32 Gram-Schmidt fails on some exactly rank-deficient
    # states) has no reference error to be measured against: it is held to the cap, not passed by any finite output
    judged = torch.isfinite(err_ref) & (err_ref >= EXACT_HEAD * scale) & (err_ref > 0)
    ratio = torch.where(judged, err / torch.where(judged, err_ref, 1.0), 0.0)
    # how much of the cap each exactly-captured head uses (0 for a zero head decoded exactly)
    cap_use = torch.where(judged, 0.0, err / (EXACT_CAP * scale).clamp_min(1e-300))
    worst = float(ratio.max()) if judged.any() else None
    rel = torch.where(scale > 0, err / scale.clamp_min(1e-300), err)
    extra = {"worst_head_ratio": worst, "exact_heads": int((~judged).sum()), "max_cap_use": float(cap_use.max()),
             "mean_head_ratio": float(ratio[judged].mean()) if judged.any() else None}
    verdict = Verdict(True, "", worst, max_abs, float(rel.max()), extra)
    if worst is not None and worst > RATIO_LIMIT:
        b, h = divmod(int(ratio.argmax()), ratio.shape[1])
        verdict.passed, verdict.reason = False, f"worst-head ratio {worst:.4f} > {RATIO_LIMIT} at (batch {b}, head {h})"
        verdict.extra["failure"] = "worst-head ratio"
    elif float(cap_use.max()) > 1.0:
        b, h = divmod(int(cap_use.argmax()), cap_use.shape[1])
        verdict.passed = False
        verdict.reason = (f"head (batch {b}, head {h}) error {float(err[b, h]):.3g} exceeds the cap "
                          f"{EXACT_CAP:g} x mean|S| = {float(EXACT_CAP * scale[b, h]):.3g}")
        verdict.extra["failure"] = "over the cap"
    return verdict

