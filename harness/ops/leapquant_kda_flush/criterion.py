"""The decoded-state criterion of docs/operator.md: `judge` and the per-head errors it is built on."""
from __future__ import annotations

import functools
import math
from typing import Callable

import torch

from harness.ops import Verdict
from harness.ops.leapquant_kda_flush.exact import decode_checkpoint, exact_state, served_checkpoint, subspace_fp64
from harness.ops.leapquant_kda_flush.layout import CHECKPOINT, POOL_CALL_ARGS, QMAX
from harness.ops.leapquant_kda_flush.symmetries import apply_variant

RATIO_LIMIT = 1.01      # err_candidate <= RATIO_LIMIT * err_reference ...
EXACT_HEAD = 1e-4       # ... where err_reference >= EXACT_HEAD * mean|S|; below it the format captures the head
EXACT_CAP = 1e-3        # almost exactly, and the candidate's error is capped at EXACT_CAP * mean|S| instead
BROKEN_CAP = 1e-2       # where the reference's own checkpoint is invalid, the cap is BROKEN_CAP * mean|S|
UNIT_ROW = 1.01         # the reference's token rows q are unit or zero: a longer one is a breakdown


def _abs_error(outputs, state: torch.Tensor) -> torch.Tensor:
    """|decode(checkpoint) - S| elementwise, for outputs (codes, s_k, s_v, u, q) in definition order: the larger of
    the exact decode's error and that of the fp32 decode a consumer computes (served_checkpoint), so that a
    checkpoint is judged as it would serve."""
    exact = (decode_checkpoint(*outputs) - state).abs()
    return torch.maximum(exact, (served_checkpoint(*outputs).double() - state).abs(), out=exact)


def head_errors(outputs, state: torch.Tensor) -> torch.Tensor:
    """Per-head mean |decode(checkpoint) - S| [B, H]."""
    return _abs_error(outputs, state).mean((-2, -1))


# Equivalent orderings of the reference: edits (old, new) of the definition's reference code that compute the same
# math with other fp32 roundings, or more precisely. Its docstring says the order of operations is not part of the
# contract, and on rare heads one order's error is lucky by more than RATIO_LIMIT (docs/operator.md, section 5), so
# a head fails the ratio only when the candidate is worse than every one of them.
ORDERINGS = {
    "S^T q0 as (q0^T S)^T": [("qk = _mgs(x @ q0)",
                              "qk = _mgs((q0.transpose(-1, -2) @ x.transpose(-1, -2)).transpose(-1, -2))")],
    "S qk as (qk^T S^T)^T": [("qv = _mgs(x.transpose(-1, -2) @ qk)",
                              "qv = _mgs((qk.transpose(-1, -2) @ x).transpose(-1, -2))")],
    "u as (qv^T S)^T": [("uk = x @ qv", "uk = (qv.transpose(-1, -2) @ x.transpose(-1, -2)).transpose(-1, -2)")],
    "fp64 up to the fp16 tokens": [(".float()", ".double()"), ("x @ q0", "x @ q0.double()"),
                                   ('"bhj,bhjv,bhjk->bhvk", w,', '"bhj,bhjv,bhjk->bhvk", w.double(),'),
                                   ("torch.exp(pcum)", "torch.exp(pcum.double())")],
}
# In exact arithmetic a column of S^T q0 (or S qk) that depends on the earlier ones leaves a zero remainder, which the
# reference's clamped norm makes a zero token; in fp32 (and fp64) the remainder is rounding, normalised into a token
# along an arbitrary direction whose luck decides the error (a rank-5 state whose S^T q0 has rank 3: the reference
# in fp64 at 0.88 of its fp32 error, a kernel at 1.26). The same holds for a product that vanishes itself (a state
# whose values are orthogonal to q0: S^T q0 = 0 exactly, the reference's rounding normalised into four tokens that
# happen to capture a rank-4 state, where zero tokens leave it all to the int8 codes). This ordering is the exact
# arithmetic's: fp64, and a zero token where a column's remainder is below DEPENDENT_FP64 of its product's magnitude
# (the norm of |x| @ |z|, which bounds the column and its fp64 rounding, ~2^-53 of it; any remainder an fp32 flush
# can resolve is above 2^-24).
DEPENDENT_FP64 = 2.0 ** -40
ORDERINGS["exact: fp64, a dependent column a zero token"] = [*ORDERINGS["fp64 up to the fp16 tokens"], (
    "def _mgs(m):", "def _mgs(m, bound):"), (
    "qk = _mgs(x @ q0.double())", "qk = _mgs(x @ q0.double(), x.abs() @ q0.double().abs())"), (
    "qv = _mgs(x.transpose(-1, -2) @ qk)",
    "qv = _mgs(x.transpose(-1, -2) @ qk, x.transpose(-1, -2).abs() @ qk.abs())"), (
    "        v = m[..., j]\n"
    "        for _ in range(2):\n"
    "            for c in cols:\n"
    "                v = v - c * (c * v).sum(-1, keepdim=True)\n"
    "        cols.append(v / v.norm(dim=-1, keepdim=True).clamp_min(1e-30))",
    "        v = m[..., j]\n"
    "        for _ in range(2):\n"
    "            for c in cols:\n"
    "                v = v - c * (c * v).sum(-1, keepdim=True)\n"
    "        magnitude = bound[..., j].norm(dim=-1, keepdim=True)\n"
    f"        dependent = v.norm(dim=-1, keepdim=True) <= magnitude * {DEPENDENT_FP64!r}\n"
    "        cols.append(torch.where(dependent, 0.0, v / v.norm(dim=-1, keepdim=True).clamp_min(1e-30)))")]


# Token rounding: the reference rounds its fp32 tokens to the nearest fp16. Another order of the same math holds
# slightly other fp32 values, and where one lies near the midpoint of two fp16 neighbours it rounds the other way: on
# heads whose residual is small against the tokens' fp16 spacing (a leading singular value ~1e3 above the tail), one
# such entry of a leading token moves the error by percents, a lottery no ordering reproduces. So a head over the
# ratio is also measured against the reference rounding as the candidate did wherever the candidate took the other
# neighbour of an fp32 value whose distance from their midpoint is within what an fp32 computation of that entry in
# any order can be off: twice the spread of the orderings' own fp32 tokens, plus the probabilistic error bound of an
# fp32 dot product of length n, TOKEN_LAMBDA sqrt(n) 2^-24 sum_i |x_i y_i| (Higham and Mary, SIAM J. Sci. Comput.
# 41 (2019); it holds for all but ~1e-8 of entries at lambda = 6), taken on the exact state and tokens (_token_bound).
# The orderings alone agree within a few fp32 units, while summing in another order moves an entry by ~2^-20 of it.
TOKEN_ROUNDING = [("u_new = uk.transpose(-1, -2).to(torch.float16)",
                   'u_new = _round_tokens("u_new", uk.transpose(-1, -2))'),
                  ("q_new = qv.transpose(-1, -2).to(torch.float16)",
                   'q_new = _round_tokens("q_new", qv.transpose(-1, -2))')]
TOKEN_OUTPUTS = {"u_new": 3, "q_new": 4}
TOKEN_LAMBDA = 6.0


def ordering_run(code: str, edits: list[tuple[str, str]], name: str, tokens: Callable | None = None) -> Callable:
    """The reference's `run` with `edits` applied to its code string; ValueError when an edit does not apply (the
    definition changed). With `tokens`, its fp32 tokens are rounded to fp16 by tokens(name, value) instead
    (TOKEN_ROUNDING)."""
    if tokens is not None:
        edits = [*edits, *TOKEN_ROUNDING]
    for old, new in edits:
        if old not in code:
            raise ValueError(f"ordering {name!r}: {old!r} is not in the reference code")
        code = code.replace(old, new)
    namespace = {"__name__": f"reference_ordering_{name}", "_round_tokens": tokens}
    exec(compile(code, f"<ordering {name}>", "exec"), namespace)
    return namespace["run"]


@functools.lru_cache(maxsize=4)
def orderings(code: str) -> tuple[str, ...]:
    """The names of the ORDERINGS whose edits apply to this reference code (checked once per code)."""
    names = []
    for name, edits in ORDERINGS.items():
        try:
            ordering_run(code, edits, name)
        except ValueError:
            continue
        names.append(name)
    return tuple(names)


# Orderings by symmetry: the reference on inputs whose value and key axes are permuted (q0's rows with the value
# axis) and its outputs permuted back. The flush is equivariant under these permutations, so each is the same math
# with every sum over either axis taken in another order. On a head whose trailing singular values lie close together
# the tokens are ill-determined and the error is a draw over such orders: a stress head (singular values 1927, 10.8,
# 9.0, 4.4) comes out at 0.989 to 1.017 of the reference's error over 12 permutations, where ORDERINGS span 0.994 to
# 1.0003; on a well-determined head they agree within 0.1%. The reversed axes first, then draws from PERMUTED_SEED.
PERMUTED_ORDERINGS = 8
PERMUTED_SEED = 0


def _axis_permutations(V: int, K: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The PERMUTED_ORDERINGS (value, key) axis permutations, the same on every call."""
    generator = torch.Generator().manual_seed(PERMUTED_SEED)
    perms = [(torch.arange(V - 1, -1, -1), torch.arange(K - 1, -1, -1))]
    perms += [(torch.randperm(V, generator=generator), torch.randperm(K, generator=generator))
              for _ in range(PERMUTED_ORDERINGS - 1)]
    return [(v.to(device), k.to(device)) for v, k in perms]


def _permuted(x: dict, perm_v: torch.Tensor, perm_k: torch.Tensor) -> dict:
    """Inputs (or outputs under their input names) with the value and key axes permuted, q0's rows with the first."""
    ones = torch.ones(len(perm_v), dtype=torch.int8, device=perm_v.device)
    moved = apply_variant(x, {"perm_v": perm_v, "perm_k": perm_k, "sign_v": ones, "sign_k": ones[:len(perm_k)]})
    return {**moved, "q0": x["q0"].index_select(0, perm_v)} if "q0" in x else moved


def _ordering_runs(inputs: dict, code: str) -> list[tuple[tuple, dict]]:
    """(outputs, fp32 tokens by output name) of the reference, of every ordering that applies and of the orderings
    by symmetry, the reference's first: each rounds its tokens to the nearest fp16 as the reference does, and keeps
    them unrounded too."""
    def run(name: str, edits: list, x: dict) -> tuple[tuple, dict]:
        fp32 = {}

        def nearest(token: str, value: torch.Tensor) -> torch.Tensor:
            fp32[token] = value.float()
            return value.to(torch.float16)
        return ordering_run(code, edits, name, nearest)(**x), fp32

    runs = [run(name, ORDERINGS.get(name, []), inputs) for name in ("reference", *orderings(code))]
    V, K = inputs["codes"].shape[-2:]
    for i, (perm_v, perm_k) in enumerate(_axis_permutations(V, K, inputs["codes"].device)):
        out, fp32 = run(f"permuted {i}", [], _permuted(inputs, perm_v, perm_k))
        back_v, back_k = torch.argsort(perm_v), torch.argsort(perm_k)
        out = _permuted(dict(zip(CHECKPOINT, out)), back_v, back_k)
        tokens = _permuted({"u": fp32["u_new"], "q": fp32["q_new"]}, back_v, back_k)
        runs.append((tuple(out[k] for k in CHECKPOINT), {"u_new": tokens["u"], "q_new": tokens["q"]}))
    return runs


def _most_lenient(inputs: dict, state: torch.Tensor, err_ref: torch.Tensor, rows: torch.Tensor, code: str,
                  dtypes: list, outputs) -> torch.Tensor:
    """err_ref of the batch elements `rows` [n, H]: the largest error over the reference, its equivalent orderings
    and the reference rounding its tokens as the candidate's `outputs` did (TOKEN_ROUNDING), on each head where that
    checkpoint is valid."""
    sub = {k: (v if k in POOL_CALL_ARGS else v[rows]) for k, v in inputs.items()}
    worst = err_ref[rows]
    runs = _ordering_runs(sub, code)
    candidate = {k: outputs[i][rows] for k, i in TOKEN_OUTPUTS.items()}
    bound = _token_bound(state[rows], inputs["q0"])
    rounded = _rounded_as(code, candidate, [tokens for _, tokens in runs], bound)(**sub)
    for out in [*(out for out, _ in runs[1:]), rounded]:
        out = tuple(t.to(dt) for t, dt in zip(out, dtypes))
        err = head_errors(out, state[rows])
        usable = ~invalid_heads(out) & torch.isfinite(err)
        worst = torch.where(usable, torch.maximum(worst, err), worst)
    return worst


def _token_bound(state: torch.Tensor, q0: torch.Tensor) -> dict:
    """How far an fp32 computation of each token entry, in any order, may be from another (TOKEN_ROUNDING), by output
    name, from the exact state [.., V, K] and its fp64 subspace iteration: u_new[r, k] = sum_v S[v, k] qv[v, r] is a
    dot product of length V; q_new[r, v] = qv[v, r] is the Gram-Schmidt remainder of z = S qk, a dot product of length
    K, divided by the remainder's norm (zero where the column is dependent)."""
    x = state.transpose(-1, -2)
    qk, z, qv = subspace_fp64(state, q0)
    remainder = (qv * z).sum(-2).abs()                                  # |R_rr| of z = qv R
    unit = TOKEN_LAMBDA * 2.0 ** -24
    u = unit * math.sqrt(state.shape[-2]) * (x.abs() @ qv.abs())
    q = unit * math.sqrt(state.shape[-1]) * (state.abs() @ qk.abs())
    q = q / torch.where(remainder > 0, remainder, math.inf)[..., None, :]
    return {"u_new": u.transpose(-1, -2).float(), "q_new": q.transpose(-1, -2).float()}


def _rounded_as(code: str, candidate: dict, fp32: list[dict], bound: dict) -> Callable:
    """The reference's run that rounds each token entry as `candidate` (fp16 tokens by output name) did where that
    is the other fp16 neighbour of the reference's fp32 value and the value lies within twice the orderings' spread
    plus `bound` (_token_bound) of their midpoint (TOKEN_ROUNDING), to the nearest elsewhere. fp32: the unrounded
    tokens of the reference and of its orderings (_ordering_runs), the reference's first."""
    spread = {k: torch.stack([torch.nan_to_num((o[k] - fp32[0][k]).abs(), nan=0.0) for o in fp32]).amax(0)
              for k in candidate}

    def round_tokens(name: str, value: torch.Tensor) -> torch.Tensor:
        device, value = value.device, value.float().cpu()        # on the CPU: nextafter of fp16 everywhere
        nearest, theirs = value.half(), candidate[name].cpu()
        below = torch.where(nearest.float() > value, torch.nextafter(nearest, nearest.new_tensor(-math.inf)), nearest)
        above = torch.where(nearest.float() < value, torch.nextafter(nearest, nearest.new_tensor(math.inf)), nearest)
        neighbour = ((theirs == below) | (theirs == above)) & (theirs != nearest)
        midpoint = (nearest.float() + theirs.float()) / 2
        near = (value - midpoint).abs() <= 2 * spread[name].cpu() + bound[name].cpu()
        return torch.where(neighbour & near, theirs, nearest).to(device)
    return ordering_run(code, [], "rounded as the candidate", round_tokens)


def invalid_heads(outputs) -> torch.Tensor:
    """[B, H]: heads whose checkpoint breaks what the reference's construction guarantees: a non-finite value, or a
    token row of q longer than UNIT_ROW (its rows are orthonormal, or zero where a column is dependent). The
    reference's fp32 Gram-Schmidt breaks so on rare rank-deficient heads, when a residual column's squares underflow
    and its clamped norm blows the column up: its error there is no yardstick (it can even come out near zero, the
    tokens' fp16 then holding what unit rows could not)."""
    finite = torch.stack([torch.isfinite(t).flatten(2).all(-1) for t in outputs if t.is_floating_point()]).all(0)
    rows = outputs[4].double().pow(2).sum(-1)
    return ~finite | (torch.nan_to_num(rows, nan=math.inf) > UNIT_ROW ** 2).any(-1)


def _first_head(bad: torch.Tensor) -> tuple[int, int]:
    """(batch, head) of the first head with a True element in bad [B, H, ...]."""
    b, h = bad.flatten(2).any(-1).nonzero()[0].tolist()
    return b, h


def judge(inputs: dict, outputs, reference_outputs, reference_code: str | None = None, *,
          yardstick: bool = False) -> Verdict:
    """docs/operator.md's criterion on the decoded state; outputs are in definition order, shapes and dtypes checked. A
    failed verdict names the first failing head in its reason, the kind of failure in extra["failure"] and the
    head's index over the program axes in extra["program"]. With the definition's `reference_code`, a head over the
    ratio is measured again against the most lenient of the reference's equivalent orderings (ORDERINGS) and of the
    reference rounding its tokens as the candidate did (TOKEN_ROUNDING) before it fails. yardstick: the outputs are
    the definition's reference's own (its code run as a solution, for its times): on heads where the reference, run
    here, breaks (invalid_heads) it has no yardstick, so they are counted (reference_broken_heads), not failed; a
    candidate's output is held to BROKEN_CAP there instead."""
    names = ("codes_new", "s_k_new", "s_v_new", "u_new", "q_new")
    broken = invalid_heads(reference_outputs)
    exempt = broken if yardstick else torch.zeros_like(broken)
    for name, t in zip(names, outputs):
        nonfinite = ~torch.isfinite(t) & ~exempt.view(*exempt.shape, *(1,) * (t.dim() - 2))
        if t.is_floating_point() and nonfinite.any():
            b, h = _first_head(nonfinite)
            return Verdict(False, f"non-finite values in {name} at (batch {b}, head {h})", None, math.inf, math.inf,
                           {"failure": f"non-finite {name}", "program": [b, h]})
    out_of_range = (outputs[0] < -QMAX) | (outputs[0] > QMAX)
    if out_of_range.any():
        b, h = _first_head(out_of_range)
        return Verdict(False, f"code {int(outputs[0][b, h].min())} out of range [-127, 127] in codes_new at "
                              f"(batch {b}, head {h})", None, math.inf, math.inf,
                       {"failure": "code out of range", "program": [b, h]})
    state = exact_state(inputs)
    scale = state.abs().mean((-2, -1))
    abs_error = _abs_error(outputs, state).masked_fill_(exempt[..., None, None], 0.0)
    unserved = ~torch.isfinite(abs_error)       # finite outputs decode finitely in fp64: only the fp32 decode can fail
    if unserved.any():
        b, h = _first_head(unserved)
        return Verdict(False, f"the checkpoint decodes to non-finite values in fp32 at (batch {b}, head {h})", None,
                       math.inf, math.inf, {"failure": "non-finite fp32 decode", "program": [b, h]})
    err, max_abs = abs_error.mean((-2, -1)), float(abs_error.max())
    del abs_error
    err_ref = head_errors(reference_outputs, state)
    # a head whose reference checkpoint is invalid has no reference error to be measured against: it is held to the
    # looser cap, not passed by any finite output
    judged = ~broken & (err_ref >= EXACT_HEAD * scale) & (err_ref > 0)
    ratio = torch.where(judged, err / torch.where(judged, err_ref, 1.0), 0.0)
    cap = torch.where(broken, BROKEN_CAP, EXACT_CAP)
    # a head over the ratio, or captured exactly by the reference and over its cap, is measured again against the
    # most lenient ordering; where one of them does not capture it exactly (the reference's luck), it is judged by
    # the ratio to that ordering instead of the cap
    over = (ratio > RATIO_LIMIT) | (~judged & ~broken & (err > cap * scale))
    rechecked = int(over.sum()) if reference_code else 0
    if rechecked:
        rows = over.any(-1).nonzero().flatten()
        lenient = _most_lenient(inputs, state, err_ref, rows, reference_code, [t.dtype for t in reference_outputs],
                                outputs)
        judged[rows] |= ~broken[rows] & (lenient >= EXACT_HEAD * scale[rows]) & (lenient > 0)
        ratio[rows] = torch.where(judged[rows], err[rows] / torch.where(judged[rows], lenient, 1.0), 0.0)
    # how much of its cap each exactly-captured (or broken-reference) head uses (0 for a zero head decoded exactly)
    cap_use = torch.where(judged, 0.0, err / (cap * scale).clamp_min(1e-300))
    worst = float(ratio.max()) if judged.any() else None
    rel = torch.where(scale > 0, err / scale.clamp_min(1e-300), err)
    extra = {"worst_head_ratio": worst, "exact_heads": int((~judged & ~broken).sum()),
             "reference_broken_heads": int(broken.sum()), "ratio_rechecked_heads": rechecked,
             "max_cap_use": float(cap_use.max()),
             "mean_head_ratio": float(ratio[judged].mean()) if judged.any() else None}
    verdict = Verdict(True, "", worst, max_abs, float(rel.max()), extra)
    if worst is not None and worst > RATIO_LIMIT:
        b, h = divmod(int(ratio.argmax()), ratio.shape[1])
        verdict.passed = False
        verdict.reason = (f"worst-head ratio {worst:.4f} > {RATIO_LIMIT} at (batch {b}, head {h})"
                          + (" against the most lenient equivalent ordering of the reference" if reference_code
                             else ""))
        verdict.extra["failure"] = "worst-head ratio"
        verdict.extra["program"] = [b, h]
    elif float(cap_use.max()) > 1.0:
        b, h = divmod(int(cap_use.argmax()), cap_use.shape[1])
        verdict.passed = False
        verdict.reason = (f"head (batch {b}, head {h}) error {float(err[b, h]):.3g} exceeds the cap "
                          f"{float(cap[b, h]):g} x mean|S| = {float(cap[b, h] * scale[b, h]):.3g}"
                          + (" (the reference's own checkpoint there is invalid)" if bool(broken[b, h]) else ""))
        verdict.extra["failure"] = "over the cap"
        verdict.extra["program"] = [b, h]
    return verdict

