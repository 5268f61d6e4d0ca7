"""The drift stream: each flush's checkpoint fed back with a fresh window, against the exactly propagated state."""
from __future__ import annotations

import torch

from harness.ops.leapquant_kda_flush.criterion import EXACT_HEAD, head_errors
from harness.ops.leapquant_kda_flush.draws import Draws
from harness.ops.leapquant_kda_flush.exact import advance
from harness.ops.leapquant_kda_flush.families import empty_checkpoint, kda_window, draw_q0
from harness.ops.leapquant_kda_flush.layout import CHECKPOINT, DTYPES, cast, dims

DRIFT_LIMIT = 1.01       # a window's mean error may be at most this times the reference pipeline's


def drift(flush, reference, axes: dict, windows: int, seed: int, device="cpu"):
    """Stream `windows` trajectory-family windows through two pipelines that feed their checkpoints back, the
    candidate `flush` and `reference` (each called with the 11 inputs, returning the 5 outputs), from an empty
    checkpoint. Yields per window the mean decoded error of each against the exactly propagated fp64 state, their
    ratio and the worst per-head ratio (heads the format captures almost exactly, as in the criterion, left out)."""
    B, H, V, K, L, R = dims(axes)
    d = Draws(seed, torch.device(device))
    q0 = draw_q0(d, V, R).to(DTYPES["q0"])
    candidate = reference_checkpoint = empty_checkpoint(B, H, V, K, R, d.device)
    state = torch.zeros((B, H, V, K), dtype=torch.float64, device=d.device)
    for t in range(windows):
        window = cast(kda_window(d, B, H, V, K, L))
        state = advance(state, window)
        candidate = dict(zip(CHECKPOINT, flush(**candidate, **window, q0=q0)))
        reference_checkpoint = dict(zip(CHECKPOINT, reference(**reference_checkpoint, **window, q0=q0)))
        err = head_errors([candidate[k] for k in CHECKPOINT], state)
        err_ref = head_errors([reference_checkpoint[k] for k in CHECKPOINT], state)
        judged = err_ref >= EXACT_HEAD * state.abs().mean((-2, -1))
        worst = float((err / err_ref)[judged].max()) if judged.any() else None
        yield {"window": t, "error": float(err.mean()), "reference_error": float(err_ref.mean()),
               "ratio": float(err.mean() / err_ref.mean()) if err_ref.mean() > 0 else 1.0,
               "worst_head_ratio": worst}

