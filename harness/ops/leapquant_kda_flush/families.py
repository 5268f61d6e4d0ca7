"""The input families (edge, second_window, random, trajectory) and the stress grammar, and `make_inputs`, which
draws any of them as a pure function of its arguments."""
from __future__ import annotations

import torch

from harness.ops.leapquant_kda_flush.draws import Draws, exact_exp, ordered_matmul, ordered_sum
from harness.ops.leapquant_kda_flush.exact import decay_history, exact_state, flush_fp64, mgs2
from harness.ops.leapquant_kda_flush.layout import CHECKPOINT, DTYPES, EPS, WINDOW, WINDOW_RESET, cast, dims

FAMILIES = ("edge", "second_window", "random", "trajectory", "stress")
FAMILY_BATCH_SIZES = {"stress": (1, 16, 64, 256)}
# families whose checkpoint and window are drawn apart, each inside the domain, so that any checkpoint and any window
# of the family make one of its programs. The others draw them together: an edge head's kind and a stress head's
# degeneracies span both, and a stress head is scaled into the domain as a whole (_within_format), so a stress
# checkpoint with another head's window can leave it (states below 2^-20, on which the reference's own Gram-Schmidt
# returns non-finite tokens), as an edge one can pass |S| = 1e4; one program's parts under two symmetries keep their
# scales, and so the domain, unless built at its edge (the timer moves them apart in every family, parts_movable)
INDEPENDENT_PARTS_FAMILIES = frozenset({"random", "trajectory"})
EDGE_KINDS = ("generic", "rank1", "rank2", "zero", "tiny", "tinier", "huge", "hot_row", "decayed", "no_decay",
              "split_decades")
TRAJECTORY_WINDOWS = 4  # windows streamed through the flush before the one the workload holds


def _random_checkpoint(d: Draws, B, H, V, K, R) -> dict:
    return {
        "codes": d.integers((B, H, V, K), -127, 127),
        "s_k": d.uniform((B, H, K), 0.05, 1.0),
        "s_v": d.uniform((B, H, V), 0.05, 1.0),
        "u": d.uniform((B, H, R, K), -2.0, 2.0),
        "q": d.uniform((B, H, R, V), -1.0, 1.0),
    }


def _random_window(d: Draws, B, H, V, K, L, pcum_min=-20.0) -> dict:
    return {
        "kbuf": d.uniform((B, H, L, K), -1.0, 1.0),
        "ubuf": d.uniform((B, H, L, V), -1.0, 1.0),
        "gbuf": 1.0 - d.uniform((B, H, L, K)) * (1.0 - 2.0 ** -10),     # (0, 1], never rounds to 0 in fp16
        "w": d.uniform((B, H, L)),
        "pcum": d.uniform((B, H, K), pcum_min, 0.0),
    }


def draw_q0(d: Draws, V, R) -> torch.Tensor:
    return d.uniform((V, R), -1.0, 1.0)


def edge_kinds(B, H, device) -> torch.Tensor:
    """Kind index of every (sequence, head): each sequence holds every kind, shifted by its index."""
    b = torch.arange(B, device=device)[:, None]
    h = torch.arange(H, device=device)[None, :]
    return (b + h) % len(EDGE_KINDS)


def _where_kind(kinds, kind, t, value):
    """t with `value` on the heads of `kind` (kinds [B, H] broadcast over t's trailing dims)."""
    mask = (kinds == EDGE_KINDS.index(kind)).reshape(kinds.shape + (1,) * (t.dim() - 2))
    return torch.where(mask, value, t)


def _edge_checkpoint(x: dict, kinds) -> dict:
    """Shape the checkpoint of each head to its kind (scales stay > 0, as in the domain)."""
    x = dict(x)
    K, R = x["s_k"].shape[-1], x["q"].shape[-2]
    rank = torch.arange(R, device=kinds.device)[:, None]
    half = torch.arange(K, device=kinds.device) >= K // 2
    for kind, r in (("rank1", 1), ("rank2", 2)):
        # q rows exact in bf16, so a window built from them (ubuf is bf16) stays inside their span
        low = torch.where(rank < r, x["q"].to(torch.bfloat16).double(), 0.0)
        x["q"] = _where_kind(kinds, kind, x["q"], low)
        x["u"] = _where_kind(kinds, kind, x["u"], torch.where(rank < r, x["u"], 0.0))
    for kind in ("rank1", "rank2", "zero"):
        x["codes"] = _where_kind(kinds, kind, x["codes"], 0.0)
    for name in ("u", "q"):
        x[name] = _where_kind(kinds, "zero", x[name], 0.0)
    for kind, f in (("tiny", 1e-4), ("tinier", 1e-7)):
        x["s_v"] = _where_kind(kinds, kind, x["s_v"], x["s_v"] * f)
        x["u"] = _where_kind(kinds, kind, x["u"], x["u"] * f)
    x["s_v"] = _where_kind(kinds, "huge", x["s_v"], x["s_v"] * 5e3)
    for name in ("u", "q"):
        x[name] = _where_kind(kinds, "huge", x[name], x[name] * 40.0)
    hot = torch.zeros_like(x["s_v"][0, 0], dtype=torch.bool)
    hot[7] = True
    x["s_v"] = _where_kind(kinds, "hot_row", x["s_v"], torch.where(hot, x["s_v"] * 1e3, x["s_v"]))
    x["q"] = _where_kind(kinds, "hot_row", x["q"], torch.where(hot, x["q"] * 1e3, x["q"]))
    x["s_k"] = _where_kind(kinds, "split_decades", x["s_k"], torch.where(half, x["s_k"] * 1e-6, x["s_k"]))
    x["u"] = _where_kind(kinds, "split_decades", x["u"], torch.where(half, x["u"] * 1e-6, x["u"]))
    return x


def _edge_window(x: dict, q: torch.Tensor, kinds, deep_decay: torch.Tensor) -> dict:
    """Shape the window of each head to its kind; rank-r heads append updates inside the span of q's first r rows."""
    x = dict(x)
    L, K = x["kbuf"].shape[-2:]
    half = torch.arange(K, device=kinds.device) >= K // 2
    for kind, r in (("rank1", 1), ("rank2", 2)):
        rows = torch.arange(L, device=kinds.device) % r
        x["ubuf"] = _where_kind(kinds, kind, x["ubuf"], q.double()[..., rows, :])
    x["w"] = _where_kind(kinds, "zero", x["w"], 0.0)
    x["ubuf"] = _where_kind(kinds, "zero", x["ubuf"], 0.0)
    for kind, f in (("tiny", 1e-4), ("tinier", 1e-7)):
        x["ubuf"] = _where_kind(kinds, kind, x["ubuf"], x["ubuf"] * f)
    x["ubuf"] = _where_kind(kinds, "huge", x["ubuf"], x["ubuf"] * 30.0)
    x["kbuf"] = _where_kind(kinds, "huge", x["kbuf"], x["kbuf"] * 10.0)
    hot = torch.zeros(x["ubuf"].shape[-1], dtype=torch.bool, device=kinds.device)
    hot[7] = True
    x["ubuf"] = _where_kind(kinds, "hot_row", x["ubuf"], torch.where(hot, x["ubuf"] * 1e3, x["ubuf"]))
    x["pcum"] = _where_kind(kinds, "decayed", x["pcum"], deep_decay)
    x["gbuf"] = _where_kind(kinds, "no_decay", x["gbuf"], 1.0)
    x["pcum"] = _where_kind(kinds, "no_decay", x["pcum"], 0.0)
    x["kbuf"] = _where_kind(kinds, "split_decades", x["kbuf"], torch.where(half, x["kbuf"] * 1e-6, x["kbuf"]))
    return x


def _edge(d: Draws, B, H, V, K, L, R) -> tuple[dict, dict, torch.Tensor]:
    kinds = edge_kinds(B, H, d.device)
    checkpoint = cast(_edge_checkpoint(_random_checkpoint(d, B, H, V, K, R), kinds))
    window = _random_window(d, B, H, V, K, L)
    window = cast(_edge_window(window, checkpoint["q"], kinds, d.uniform((B, H, K), -1000.0, -200.0)))
    return checkpoint, window, draw_q0(d, V, R)


def _second_window(seed: int, d: Draws, B, H, V, K, L, R) -> tuple[dict, dict, torch.Tensor]:
    """The checkpoint flushed from the edge inputs of the same seed, with a fresh window of the edge kinds."""
    checkpoint, window, q0 = _edge(Draws(seed, d.device), B, H, V, K, L, R)
    checkpoint = flush_fp64({**checkpoint, **window}, q0)
    kinds = edge_kinds(B, H, d.device)
    window = _random_window(d, B, H, V, K, L)
    window = cast(_edge_window(window, checkpoint["q"], kinds, d.uniform((B, H, K), -1000.0, -200.0)))
    return checkpoint, window, q0


def kda_window(d: Draws, B, H, V, K, L) -> dict:
    """One window of a KDA-like stream: L2-normalised keys, values ~ N(0, 1/4), write strengths in [0.1, 0.9] and
    per-channel log-gates (mostly slow, a few fast channels) on a 2^-16 grid, so pcum is their exact sum."""
    k = d.normal((B, H, L, K))
    k = k / torch.sqrt(ordered_sum(k * k, -1))[..., None]
    rate = d.uniform((B, H, 1, K))
    rate = rate * rate * rate * 0.5
    log_gate = torch.round(-rate * d.uniform((B, H, L, K), 0.5, 1.5) * 2.0 ** 16) / 2.0 ** 16
    return {
        "kbuf": k,
        "ubuf": d.normal((B, H, L, V)) * 0.5,
        "gbuf": exact_exp(log_gate),
        "w": d.uniform((B, H, L), 0.1, 0.9),
        "pcum": ordered_sum(log_gate, -2),
    }


def empty_checkpoint(B, H, V, K, R, device) -> dict:
    zeros = lambda *shape: torch.zeros(shape, dtype=torch.float64, device=device)  # noqa: E731
    return cast({"codes": zeros(B, H, V, K), "s_k": zeros(B, H, K) + EPS, "s_v": zeros(B, H, V) + EPS,
                  "u": zeros(B, H, R, K), "q": zeros(B, H, R, V)})


def _trajectory(d: Draws, B, H, V, K, L, R) -> tuple[dict, dict, torch.Tensor]:
    """Start from an empty checkpoint and stream TRAJECTORY_WINDOWS windows through the flush, feeding each
    checkpoint back; the workload is the last checkpoint with one more window."""
    q0 = draw_q0(d, V, R)
    checkpoint = empty_checkpoint(B, H, V, K, R, d.device)
    for _ in range(TRAJECTORY_WINDOWS):
        checkpoint = flush_fp64({**checkpoint, **cast(kda_window(d, B, H, V, K, L))}, q0)
    return checkpoint, cast(kda_window(d, B, H, V, K, L)), q0


# ----------------------------------------------------------------------------------------------- stress: a grammar
# The `stress` family and `python -m harness.stress` draw every head (program) from independent named choices, each
# option list ordered from the plainest to the most degenerate, so that a search shrinks a failing head towards the
# plain one and a reproducer names only the choices that matter. Every value is built from exact operations on
# values exact in the input dtypes, so an exactly rank-deficient state or a projection onto q0 that vanishes is
# exactly that in the inputs, not approximately.
PROGRAM_GRAMMAR = {
    "checkpoint": ("both", "tokens", "codes", "zero"),      # which parts of the old checkpoint hold anything
    "tokens_rank": (4, 3, 2, 1),                           # rank of its token part q^T u
    "window": ("full", "few", "one", "empty"),              # live entries: 16, 4, 1, 0 (the rest as reset leaves them)
    "keys": ("random", "repeated", "collinear", "cancel"),  # cancel: entry pairs with equal keys, opposite values
    "rank": ("full", 0, 1, 2, 3, 4, 5),                    # the state's exact rank (codes zero, values in a span)
    "overlap": ("generic", "orthogonal_q0"),                # every value vector orthogonal to q0's columns
    "scale": ("unit", "tiny", "huge", "split", "hot_row", "hot_column", "deep"),
    "decay": ("random", "none", "total", "split"),          # split: half the key channels total, half none
    "values": ("random", "exact"),                          # exact: dyadic values, so products are exact
}
CALL_GRAMMAR = {"q0": ("dense", "half", "one_hot")}         # half / one_hot: zero on part of the value axis
STRESS_FAMILY = "stress"
FEW_ENTRIES = 4
HOT = 7                                                     # the hot row / column
SCALES = {"tiny": 2.0 ** -20, "huge_sv": 2.0 ** 12, "huge_u": 2.0 ** 5, "huge_q": 4.0, "huge_ubuf": 2.0 ** 5,
          "huge_kbuf": 4.0, "hot": 2.0 ** 10, "split": 2.0 ** -20, "deep": 2.0 ** -32}
STATE_MAX = 2.0 ** 13                                       # the domain's |S| < 1e4
STATE_MIN = 2.0 ** -20                                      # the domain's smallest max |S| of a state that is not 0
COLUMN_NORM_MAX = 2.0 ** 15                                 # bounds |u| = |S^T q| below fp16's 65504
TOTAL_DECAY_PCUM = -2000.0
TOTAL_DECAY_GATE = 2.0 ** -24                               # fp16's smallest positive value: gbuf stays in (0, 1]


def parts_movable(x: dict) -> torch.Tensor:
    """Per program (x's leading dims), whether its checkpoint and window stay in the domain however the timer moves
    them apart (symmetries.draw_variants: each part's value axis under a permutation of its own): bounds on each
    part's largest entry and largest column 2-norm, summed, below STATE_MAX and COLUMN_NORM_MAX. Where not (heads
    built near the domain's edge, which a new relative position of the parts can carry past it), both parts move
    together. Elementwise products, maxima
    and short sums in fp64: the same answer in the worker and the harness on one device."""
    decay = torch.exp(x["pcum"].double())
    s_k = x["s_k"].double() * decay
    q, u = x["q"].double().abs(), x["u"].double().abs() * decay[..., None, :]
    ubuf = x["ubuf"].double().abs()
    kd = x["kbuf"].double().abs() * decay_history(x["gbuf"].double()) * x["w"].double().abs()[..., None]
    entry = (x["s_v"].double().amax(-1) * s_k.amax(-1) + (q.amax(-1) * u.amax(-1)).sum(-1)
             + (ubuf.amax(-1) * kd.amax(-1)).sum(-1))
    column = (x["s_v"].double().norm(dim=-1) * s_k.amax(-1) + (q.norm(dim=-1) * u.amax(-1)).sum(-1)
              + (ubuf.norm(dim=-1) * kd.amax(-1)).sum(-1))
    return (entry < STATE_MAX) & (column < COLUMN_NORM_MAX)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent (integral fp64 in the normal range), built from its bits: exact on every device."""
    return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)


def _dyadic(x: torch.Tensor) -> torch.Tensor:
    """x on the grid k / 8: exact in fp16 and bf16 for |x| <= 32."""
    return torch.round(x * 8.0) * 0.125


def _within_format(x: dict) -> dict:
    """Heads scaled by a power of 2 into the domain. Down where their state leaves it (|S| < 1e4) or the new tokens
    could not hold it: u = S^T q with unit rows q, so a column of S whose 2-norm exceeds fp16's range (65504) would
    make u infinite in any flush, the reference's included (a hot column summed over a window of repeated keys does).
    Up where a state that is not zero lies wholly below 2^-20: there fp16 tokens hold nothing (u_new underflows) and
    the reference's fp32 Gram-Schmidt squares a rank-deficient head's residual columns to zero, clamps their norm and
    returns tokens of any size, finite or not (a `deep` head of rank 1 at 5e-9 did). s_v, u and ubuf scale together,
    so S scales with them, exactly."""
    state = exact_state(cast(x))
    column_norm = ordered_sum(state * state, -2).amax(-1).sqrt()
    largest = state.abs().amax((-2, -1))
    over = torch.maximum(largest / STATE_MAX, column_norm / COLUMN_NORM_MAX)
    down = torch.frexp(over)[1].clamp_min(0)                            # 2^-down with 2^down > over
    up = torch.where(largest > 0, 1 - torch.frexp(largest / STATE_MIN)[1], 0).clamp_min(0)   # 2^up * largest >= min
    factor = _pow2((up - down).double())
    return {**x, "s_v": x["s_v"] * factor[..., None], "u": x["u"] * factor[..., None, None],
            "ubuf": x["ubuf"] * factor[..., None, None]}


def stress_choices(d: Draws, B, H, params: dict) -> tuple[dict, dict]:
    """Option index of every grammar axis per program [B, H] and per call: drawn from the seed; when params name
    programs, the first len(params["programs"]) programs (batch-major) as given and the others plain (the first
    option of every axis); the call's axes named in params as given."""
    programs = {a: d.integers((B, H), 0, len(opts) - 1).long() for a, opts in PROGRAM_GRAMMAR.items()}
    call = {a: int(d.integers((), 0, len(opts) - 1)) for a, opts in CALL_GRAMMAR.items()}
    unknown = set(params) - {"programs", "call"}
    if unknown:
        raise ValueError(f"unknown stress parameters {sorted(unknown)} (known: programs, call)")
    named = params.get("programs", [])
    if not isinstance(named, list) or len(named) > B * H:
        raise ValueError(f"stress parameter 'programs' must be a list of at most {B * H} programs")
    for grammar, chosen, given in [(PROGRAM_GRAMMAR, None, p) for p in named] + [(CALL_GRAMMAR, call,
                                                                                  params.get("call", {}))]:
        if not isinstance(given, dict) or set(given) - set(grammar):
            raise ValueError(f"a stress choice must be an object with keys among {sorted(grammar)}, got {given!r}")
        for axis, option in given.items():
            if option not in grammar[axis]:
                raise ValueError(f"stress axis {axis!r} has no option {option!r} (options: {grammar[axis]})")
    if "programs" in params:
        programs = {axis: torch.zeros_like(index) for axis, index in programs.items()}
    for i, given in enumerate(named):
        for axis in PROGRAM_GRAMMAR:        # an axis left out takes its plainest option
            programs[axis].view(-1)[i] = PROGRAM_GRAMMAR[axis].index(given.get(axis, PROGRAM_GRAMMAR[axis][0]))
    for axis, option in params.get("call", {}).items():
        call[axis] = CALL_GRAMMAR[axis].index(option)
    return programs, call


def _stress(d: Draws, B, H, V, K, L, R, params: dict) -> tuple[dict, dict, torch.Tensor]:
    choices, call = stress_choices(d, B, H, params)

    def where(axis, option, t, value):
        mask = choices[axis] == PROGRAM_GRAMMAR[axis].index(option)
        return torch.where(mask.reshape(B, H, *(1,) * (t.dim() - 2)), value, t)

    x = {**_random_checkpoint(d, B, H, V, K, R), **_random_window(d, B, H, V, K, L)}
    directions = d.integers((B, H, 5, V), -8, 8) * 0.125     # the value-side basis of a rank-r state
    q0 = draw_q0(d, V, R)
    # dyadic values
    scales_exact = {k: _pow2(torch.frexp(x[k])[1].double() - 1.0) for k in ("s_k", "s_v")}
    exact = {**scales_exact, **{k: _dyadic(x[k]) for k in ("u", "q", "kbuf", "ubuf")},
             "w": torch.where(x["w"] > 0.5, 1.0, 0.5), "gbuf": torch.where(x["gbuf"] > 0.75, 1.0, 0.5),
             "pcum": torch.zeros_like(x["pcum"])}
    x = {k: where("values", "exact", v, exact[k]) if k in exact else v for k, v in x.items()}
    # q0 zero on part of the value axis; `free` marks the coordinates where q0 is zero
    v_index = torch.arange(V, device=d.device)
    q0_kind = CALL_GRAMMAR["q0"][call["q0"]]
    if q0_kind == "half":
        q0 = torch.where((v_index < V // 2)[:, None], q0, 0.0)
    elif q0_kind == "one_hot":
        q0 = (v_index[:, None] == torch.arange(R, device=d.device)[None, :]).double()
    free = (q0 == 0).all(-1)
    # scales of single rows and columns, before the value vectors are made orthogonal to q0
    hot_v = torch.where(v_index == HOT, SCALES["hot"], 1.0)
    k_index = torch.arange(K, device=d.device)
    hot_k = torch.where(k_index == HOT, SCALES["hot"], 1.0)
    split_k = torch.where(k_index >= K // 2, SCALES["split"], 1.0)
    for option, name, factor in (("hot_row", "s_v", hot_v), ("hot_row", "q", hot_v), ("hot_row", "ubuf", hot_v),
                                 ("hot_column", "s_k", hot_k), ("hot_column", "u", hot_k),
                                 ("hot_column", "kbuf", hot_k), ("split", "s_k", split_k), ("split", "u", split_k),
                                 ("split", "kbuf", split_k)):
        x[name] = where("scale", option, x[name], x[name] * factor)
    directions = where("scale", "hot_row", directions, directions * hot_v)
    # value vectors orthogonal to q0: exactly where q0 has zero coordinates, else projected out in fp64 and rounded
    # (to bf16 for the basis, whose values then are exact in fp16 too)
    if free.any():
        def orthogonal(t):
            return t * free
    else:
        basis = mgs2(q0)

        def orthogonal(t):
            return t - ordered_matmul(ordered_matmul(t, basis), basis.transpose(-1, -2))
    flat = orthogonal(directions)
    if not free.any():
        flat = flat.to(torch.bfloat16).double()
        flat = torch.where(flat.abs() < 2.0 ** -16, 0.0, flat)
    directions = where("overlap", "orthogonal_q0", directions, flat)
    for name in ("q", "ubuf"):
        x[name] = where("overlap", "orthogonal_q0", x[name], orthogonal(x[name]))
    # exact rank r: no codes, every value vector one of the first r directions (r = 5 needs the window's)
    r_index = torch.arange(R, device=d.device)[:, None]
    l_index = torch.arange(L, device=d.device)[:, None]
    for r in range(6):
        rows_q = directions[..., r_index[:, 0] % max(r, 1), :] if r else torch.zeros_like(x["q"])
        rows_u = directions[..., l_index[:, 0] % max(r, 1), :] if r else torch.zeros_like(x["ubuf"])
        x["q"] = where("rank", r, x["q"], rows_q)
        x["ubuf"] = where("rank", r, x["ubuf"], rows_u)
        x["codes"] = where("rank", r, x["codes"], 0.0)
    # the old checkpoint's parts
    for t in range(1, R):
        x["q"] = where("tokens_rank", t, x["q"], torch.where(r_index < t, x["q"], 0.0))
        x["u"] = where("tokens_rank", t, x["u"], torch.where(r_index < t, x["u"], 0.0))
    for option in ("tokens", "zero"):
        x["codes"] = where("checkpoint", option, x["codes"], 0.0)
    for option in ("codes", "zero"):
        x["q"] = where("checkpoint", option, x["q"], 0.0)
        x["u"] = where("checkpoint", option, x["u"], 0.0)
    for name in ("s_k", "s_v"):
        x[name] = where("checkpoint", "zero", x[name], torch.full_like(x[name], EPS))
    # decay
    total = {"pcum": torch.full_like(x["pcum"], TOTAL_DECAY_PCUM), "gbuf": torch.full_like(x["gbuf"],
                                                                                           TOTAL_DECAY_GATE)}
    half = k_index >= K // 2
    for name, none in (("gbuf", 1.0), ("pcum", 0.0)):
        x[name] = where("decay", "none", x[name], none)
        x[name] = where("decay", "total", x[name], total[name])
        x[name] = where("decay", "split", x[name], torch.where(half, total[name], none))
    # keys: one repeated, multiples of one by +-2^-m, or pairs that cancel (equal keys and weights, opposite values,
    # no decay between them)
    first = x["kbuf"][..., :1, :]
    x["kbuf"] = where("keys", "repeated", x["kbuf"], first.expand_as(x["kbuf"]))
    multiple = torch.where(l_index % 2 == 0, 1.0, -1.0) * _pow2(-(l_index % 3).double())
    x["kbuf"] = where("keys", "collinear", x["kbuf"], first * multiple)
    second = (l_index[:, 0] % 2 == 0) & (l_index[:, 0] > 0)     # pairs (1, 2), (3, 4), ...: entry 0 and the
    pair = l_index[:, 0] - second.long()                         # last stay, so the window never sums to zero
    cancel = {"kbuf": x["kbuf"][..., pair, :],
              "ubuf": x["ubuf"][..., pair, :] * torch.where(second, -1.0, 1.0)[:, None],
              "w": x["w"][..., pair], "gbuf": torch.where(second[:, None], 1.0, x["gbuf"])}
    for name, value in cancel.items():
        x[name] = where("keys", "cancel", x[name], value)
    # live entries first; the others as the deployment form's reset leaves them (stale keys and values)
    for option, live in (("few", FEW_ENTRIES), ("one", 1), ("empty", 0)):
        dead = l_index[:, 0] >= live
        x["w"] = where("window", option, x["w"], torch.where(dead, WINDOW_RESET["w"], x["w"]))
        x["gbuf"] = where("window", option, x["gbuf"], torch.where(dead[:, None], WINDOW_RESET["gbuf"], x["gbuf"]))
    # magnitudes of whole heads
    for name, factor in (("s_v", "tiny"), ("u", "tiny"), ("ubuf", "tiny")):
        x[name] = where("scale", "tiny", x[name], x[name] * SCALES[factor])
    for name in ("s_v", "u", "q", "ubuf", "kbuf"):
        key = "huge_sv" if name == "s_v" else f"huge_{name}"
        x[name] = where("scale", "huge", x[name], x[name] * SCALES[key])
    for name in ("s_v", "ubuf"):
        x[name] = where("scale", "deep", x[name], x[name] * SCALES["deep"])
    x["u"] = where("scale", "deep", x["u"], 0.0)
    x = _within_format(x)
    checkpoint = cast({k: x[k] for k in CHECKPOINT})
    return checkpoint, cast({k: x[k] for k in WINDOW}), q0


def make_inputs(family: str, axes: dict, seed: int, device="cpu", params: dict | None = None
                ) -> dict[str, torch.Tensor]:
    """The inputs of one workload: a pure function of (family, axes, seed, params) whose bits do not depend on
    `device`. Only the stress family takes params: {"programs": [choices, ...], "call": choices}, each choices an
    object of PROGRAM_GRAMMAR (CALL_GRAMMAR) axes and options; anything else raises ValueError."""
    B, H, V, K, L, R = dims(axes)
    d = Draws(seed, torch.device(device))
    if params and family != STRESS_FAMILY:
        raise ValueError(f"family {family!r} takes no parameters")
    if family == STRESS_FAMILY:
        checkpoint, window, q0 = _stress(d, B, H, V, K, L, R, params or {})
    elif family == "random":
        checkpoint = cast(_random_checkpoint(d, B, H, V, K, R))
        window, q0 = cast(_random_window(d, B, H, V, K, L)), draw_q0(d, V, R)
    elif family == "edge":
        checkpoint, window, q0 = _edge(d, B, H, V, K, L, R)
    elif family == "second_window":
        checkpoint, window, q0 = _second_window(seed, Draws(seed + 1, d.device), B, H, V, K, L, R)
    elif family == "trajectory":
        checkpoint, window, q0 = _trajectory(d, B, H, V, K, L, R)
    else:
        raise ValueError(f"unknown input family {family!r} (known: {', '.join(FAMILIES)})")
    return {k: v.contiguous() for k, v in {**checkpoint, **window, "q0": q0.to(DTYPES["q0"])}.items()}

