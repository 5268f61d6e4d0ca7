"""LeapQuant window flush of Kimi Delta Attention's int8 + rank-R checkpoint (op_type `leapquant_kda_flush`).

Everything specific to this operator: the four input families, the exact fp64 state, `decode_checkpoint` and the
decoded-state criterion of docs/operator.md. Shapes come from the workload's axes (batch_size, num_heads, value_dim,
key_dim, window, rank), so the package serves any size of the definition family. This module is the operator as the
harness sees it (harness.ops.Operator): the names below, gathered from its parts, and the words the harness's output
uses for its concepts (WORDING).

The families are bit-reproducible on any machine and device, because workload blobs are checked against recorded
sha256 hashes: every draw is a uniform fp64 from a seeded CPU generator (no normal sampler: its vectorised
transcendentals differ between CPUs), later arithmetic is correctly rounded (+ - * sqrt, and / between tensors only:
torch's CUDA division by a Python scalar multiplies by its reciprocal) with reductions summed in a fixed order, and
the one transcendental, exp, is evaluated from those operations alone (`draws.exact_exp`).
"""
from harness.ops import Wording
from harness.ops.leapquant_kda_flush.criterion import EXACT_CAP, EXACT_HEAD, RATIO_LIMIT, judge
from harness.ops.leapquant_kda_flush.drift import DRIFT_LIMIT, drift
from harness.ops.leapquant_kda_flush.exact import decay_history, decode_checkpoint, exact_state
from harness.ops.leapquant_kda_flush.families import (CALL_GRAMMAR, EDGE_KINDS, FAMILIES, FAMILY_BATCH_SIZES,
                                                      INDEPENDENT_PARTS_FAMILIES, PROGRAM_GRAMMAR, STRESS_FAMILY,
                                                      edge_kinds, make_inputs, parts_movable)
from harness.ops.leapquant_kda_flush.layout import (CHECKPOINT, DTYPES, DUE_EVERY, EPS, POOL_CALL_ARGS, PROGRAM_PARTS,
                                                    QMAX, WINDOW, WINDOW_RESET)
from harness.ops.leapquant_kda_flush.pool import (CHECKPOINT_BYTES, POOL_HEADER, POOL_OFFSETS, POOL_REGION,
                                                  POOL_REGIONS_PER_SLOT, Pool, check_idx)
from harness.ops.leapquant_kda_flush.symmetries import apply_variant, draw_variants

WORDING = Wording(
    score_key="worst_head_ratio",
    score_label="worst-head ratio",
    score_of="worst head",
    batch_unit="{num_heads} heads",
    stress_subject="degenerate heads (rank-deficient states, states orthogonal to q0, cancelling or empty windows, "
                   "scales across decades, total decay, exactly representable values)",
    drift_intro="Each flush's checkpoint fed back with a fresh trajectory window (`python -m harness.drift --record`); "
                "the worst window of each recorded run: its mean decoded error against the exactly propagated state, "
                "the reference pipeline's on the same windows, their ratio (limit in the last column) and the worst "
                "head's.",
    deployment_intro="The in-place pool call as a serving engine makes it (docs/operator.md, \"Deployment form\"), "
                     "one CUDA graph replayed L2-cold on a pool filled with a workload's inputs (`python -m harness "
                     "deploy`); x floor counts every byte of the flushed programs once, window reset included; "
                     "checked: after the last call the due checkpoints pass the criterion against the reference, "
                     "their windows are reset and every other program is unchanged; empty kernel: one graph of an "
                     "empty kernel timed the same way, what this timer reads for no work. These times are the "
                     "solution's worker's own (its CUDA events), not checked against the harness's clock as the "
                     "ranked ones are: a time below 0.9x the floor is refused, any other is taken as reported.",
)

__all__ = ["CALL_GRAMMAR", "CHECKPOINT", "CHECKPOINT_BYTES", "DRIFT_LIMIT", "DTYPES", "DUE_EVERY", "EDGE_KINDS", "EPS",
           "EXACT_CAP", "EXACT_HEAD", "FAMILIES", "FAMILY_BATCH_SIZES", "INDEPENDENT_PARTS_FAMILIES", "POOL_CALL_ARGS",
           "POOL_HEADER", "POOL_OFFSETS", "POOL_REGION", "POOL_REGIONS_PER_SLOT", "PROGRAM_GRAMMAR", "Pool", "QMAX",
           "RATIO_LIMIT", "STRESS_FAMILY", "WINDOW", "WINDOW_RESET", "WORDING", "apply_variant", "check_idx",
           "decay_history", "decode_checkpoint", "draw_variants", "drift", "edge_kinds", "exact_state", "judge",
           "make_inputs", "parts_movable"]
