"""LeapQuant window flush of Kimi Delta Attention's int8 + rank-R checkpoint (op_type `leapquant_kda_flush`).

Everything specific to this operator: the four input families, the exact fp64 state, `decode_checkpoint` and the
decoded-state criterion of docs/operator.md. Shapes come from the workload's axes (batch_size, num_heads, value_dim,
key_dim, window, rank), so the module serves any size of the definition family.

The families are bit-reproducible on any machine and device, because workload blobs are checked against recorded
sha256 hashes: every draw is a uniform fp64 from a seeded CPU generator (no normal sampler: its vectorised
transcendentals differ between CPUs), later arithmetic is correctly rounded (+ - * sqrt, and / between tensors only:
torch's CUDA division by a Python scalar multiplies by its reciprocal) with reductions summed in a fixed order, and
the one transcendental, exp, is evaluated from those operations alone (`_exp`).
"""
from __future__ import annotations

import math

import torch

from harness.ops import Verdict

QMAX = 127.0
EPS = 1e-12
RATIO_LIMIT = 1.01      # err_candidate <= RATIO_LIMIT * err_reference ...
EXACT_HEAD = 1e-4       # ... where err_reference >= EXACT_HEAD * mean|S|; below it the format captures the head
EXACT_CAP = 1e-3        # almost exactly, and the candidate's error is capped at EXACT_CAP * mean|S| instead

FAMILIES = ("edge", "second_window", "random", "trajectory", "stress")
FAMILY_BATCH_SIZES = {"stress": (1, 16, 64, 256)}
EDGE_KINDS = ("generic", "rank1", "rank2", "zero", "tiny", "tinier", "huge", "hot_row", "decayed", "no_decay",
              "split_decades")
TRAJECTORY_WINDOWS = 4  # windows streamed through the flush before the one the workload holds
DEPENDENT_COLUMN = 1e-9  # generator's Gram-Schmidt: a remainder below this fraction of column 0 is noise
CHECKPOINT = ("codes", "s_k", "s_v", "u", "q")
WINDOW = ("kbuf", "ubuf", "gbuf", "w", "pcum")
WINDOW_RESET = {"w": 0.0, "pcum": 0.0, "gbuf": 1.0}    # what the deployment form writes after a flush
DTYPES = {"codes": torch.int8, "s_k": torch.float32, "s_v": torch.float32, "u": torch.float16, "q": torch.float16,
          "kbuf": torch.bfloat16, "ubuf": torch.bfloat16, "gbuf": torch.float16, "w": torch.float32,
          "pcum": torch.float32, "q0": torch.float32}


# ----------------------------------------------------------------------------------------------- reproducible draws
class _Draws:
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


def _ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum along `dim` in index order: the same bits on every device, unlike torch's reductions."""
    x = x.movedim(dim, 0)
    acc = x[0].clone()
    for i in range(1, x.shape[0]):
        acc += x[i]
    return acc


def _ordered_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., m, n] @ b [..., n, p] with the n-sum in index order."""
    a_cols = a.movedim(-1, 0).contiguous()     # contiguous slices: strided ones are several times slower
    b_rows = b.movedim(-2, 0).contiguous()
    acc = a_cols[0][..., :, None] * b_rows[0][..., None, :]
    for i in range(1, a_cols.shape[0]):
        acc += a_cols[i][..., :, None] * b_rows[i][..., None, :]
    return acc


def _exp(x: torch.Tensor) -> torch.Tensor:
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


def _decay_history(gbuf: torch.Tensor) -> torch.Tensor:
    """D_j = prod_{i > j} gbuf_i over the window axis (-2), multiplied from the end in a fixed order."""
    d = torch.ones_like(gbuf)
    for j in range(gbuf.shape[-2] - 2, -1, -1):
        d[..., j, :] = d[..., j + 1, :] * gbuf[..., j + 1, :]
    return d


# ----------------------------------------------------------------------------------------------- the math in fp64
def decode_checkpoint(codes, s_k, s_v, u, q) -> torch.Tensor:
    """The state a checkpoint stands for, in fp64: q^T u + codes * s_k / 127 * s_v."""
    low_rank = torch.einsum("...rv,...rk->...vk", q.double(), u.double())
    return low_rank + codes.double() * (s_k.double() / QMAX)[..., None, :] * s_v.double()[..., :, None]


def exact_state(inputs: dict) -> torch.Tensor:
    """The state the flush must quantize, rebuilt in fp64 from the inputs."""
    return _advance(decode_checkpoint(*(inputs[k] for k in CHECKPOINT)), inputs)


def _advance(state: torch.Tensor, window: dict) -> torch.Tensor:
    """An fp64 state decayed over one window and given its updates: S exp(pcum) + sum_j w_j ubuf_j (kbuf_j D_j)^T."""
    x = {k: window[k].double() for k in WINDOW}
    kd = x["kbuf"] * _decay_history(x["gbuf"])
    updates = torch.einsum("...j,...jv,...jk->...vk", x["w"], x["ubuf"], kd)
    return state * torch.exp(x["pcum"])[..., None, :] + updates


def _mgs2(m: torch.Tensor) -> torch.Tensor:
    """Modified Gram-Schmidt on the columns of m [..., n, R], projections applied twice (the reference's `_mgs`),
    except that a column left with less than DEPENDENT_COLUMN of the first column's norm becomes zero instead of
    being normalised: the direction of such a remainder is rounding noise, and noise would make the generated
    checkpoint of a rank-deficient head depend on the last bit of every operation before it."""
    cols, first = [], None
    for j in range(m.shape[-1]):
        v = m[..., j]
        for _ in range(2):
            for c in cols:
                v = v - c * _ordered_sum(c * v, -1)[..., None]
        norm = torch.sqrt(_ordered_sum(v * v, -1))
        first = norm if first is None else first
        keep = norm > DEPENDENT_COLUMN * first
        cols.append(torch.where(keep[..., None], v / norm.clamp_min(1e-30)[..., None], 0.0))
    return torch.stack(cols, -1)


def _flush_fp64(inputs: dict, q0: torch.Tensor) -> dict:
    """The reference's flush evaluated in fp64 in a fixed order: the checkpoint feedback of the `second_window` and
    `trajectory` families."""
    x = {k: inputs[k].double() for k in CHECKPOINT + WINDOW}
    low_rank = _ordered_matmul(x["q"].transpose(-1, -2), x["u"])
    old = low_rank + x["codes"] * (x["s_k"] * (1.0 / QMAX))[..., None, :] * x["s_v"][..., :, None]
    decay = _exp(x["pcum"])
    kd = (x["kbuf"] * _decay_history(x["gbuf"])).transpose(-1, -2)          # [.., K, L]
    uw = (x["ubuf"] * x["w"][..., None]).transpose(-1, -2)                  # [.., V, L]
    s = old * decay[..., None, :] + _ordered_matmul(uw, kd.transpose(-1, -2))
    st = s.transpose(-1, -2)
    qk = _mgs2(_ordered_matmul(st, q0.double()))
    qv = _mgs2(_ordered_matmul(s, qk))
    uk = _ordered_matmul(st, qv)
    u_new, q_new = uk.transpose(-1, -2).half(), qv.transpose(-1, -2).half()
    e = s - _ordered_matmul(q_new.double().transpose(-1, -2), u_new.double())
    s_k = torch.sqrt(_ordered_sum(e.abs(), -2) * (1.0 / s.shape[-2])).clamp_min(EPS)      # 1/V: a power of 2
    s_v = (e.abs() / s_k[..., None, :]).amax(-1).clamp_min(EPS)
    codes = torch.round(e / (s_k[..., None, :] * s_v[..., :, None]) * QMAX).clamp(-QMAX, QMAX)
    return {"codes": codes.to(torch.int8), "s_k": s_k.float(), "s_v": s_v.float(), "u": u_new, "q": q_new}


# ----------------------------------------------------------------------------------------------- input families
def _dims(axes: dict) -> tuple[int, int, int, int, int, int]:
    return (axes["batch_size"], axes["num_heads"], axes["value_dim"], axes["key_dim"], axes["window"], axes["rank"])


def _random_checkpoint(d: _Draws, B, H, V, K, R) -> dict:
    return {
        "codes": d.integers((B, H, V, K), -127, 127),
        "s_k": d.uniform((B, H, K), 0.05, 1.0),
        "s_v": d.uniform((B, H, V), 0.05, 1.0),
        "u": d.uniform((B, H, R, K), -2.0, 2.0),
        "q": d.uniform((B, H, R, V), -1.0, 1.0),
    }


def _random_window(d: _Draws, B, H, V, K, L, pcum_min=-20.0) -> dict:
    return {
        "kbuf": d.uniform((B, H, L, K), -1.0, 1.0),
        "ubuf": d.uniform((B, H, L, V), -1.0, 1.0),
        "gbuf": 1.0 - d.uniform((B, H, L, K)) * (1.0 - 2.0 ** -10),     # (0, 1], never rounds to 0 in fp16
        "w": d.uniform((B, H, L)),
        "pcum": d.uniform((B, H, K), pcum_min, 0.0),
    }


def _cast(x: dict) -> dict:
    """Round each tensor to its definition dtype (codes are integral already)."""
    return {k: v.to(DTYPES[k]) for k, v in x.items()}


def _q0(d: _Draws, V, R) -> torch.Tensor:
    return d.uniform((V, R), -1.0, 1.0)


def _edge_kinds(B, H, device) -> torch.Tensor:
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


def _edge(d: _Draws, B, H, V, K, L, R) -> tuple[dict, dict, torch.Tensor]:
    kinds = _edge_kinds(B, H, d.device)
    checkpoint = _cast(_edge_checkpoint(_random_checkpoint(d, B, H, V, K, R), kinds))
    window = _random_window(d, B, H, V, K, L)
    window = _cast(_edge_window(window, checkpoint["q"], kinds, d.uniform((B, H, K), -1000.0, -200.0)))
    return checkpoint, window, _q0(d, V, R)


def _second_window(seed: int, d: _Draws, B, H, V, K, L, R) -> tuple[dict, dict, torch.Tensor]:
    """The checkpoint flushed from the edge inputs of the same seed, with a fresh window of the edge kinds."""
    checkpoint, window, q0 = _edge(_Draws(seed, d.device), B, H, V, K, L, R)
    checkpoint = _flush_fp64({**checkpoint, **window}, q0)
    kinds = _edge_kinds(B, H, d.device)
    window = _random_window(d, B, H, V, K, L)
    window = _cast(_edge_window(window, checkpoint["q"], kinds, d.uniform((B, H, K), -1000.0, -200.0)))
    return checkpoint, window, q0


def _kda_window(d: _Draws, B, H, V, K, L) -> dict:
    """One window of a KDA-like stream: L2-normalised keys, values ~ N(0, 1/4), write strengths in [0.1, 0.9] and
    per-channel log-gates (mostly slow, a few fast channels) on a 2^-16 grid, so pcum is their exact sum."""
    k = d.normal((B, H, L, K))
    k = k / torch.sqrt(_ordered_sum(k * k, -1))[..., None]
    rate = d.uniform((B, H, 1, K))
    rate = rate * rate * rate * 0.5
    log_gate = torch.round(-rate * d.uniform((B, H, L, K), 0.5, 1.5) * 2.0 ** 16) / 2.0 ** 16
    return {
        "kbuf": k,
        "ubuf": d.normal((B, H, L, V)) * 0.5,
        "gbuf": _exp(log_gate),
        "w": d.uniform((B, H, L), 0.1, 0.9),
        "pcum": _ordered_sum(log_gate, -2),
    }


def _empty_checkpoint(B, H, V, K, R, device) -> dict:
    zeros = lambda *shape: torch.zeros(shape, dtype=torch.float64, device=device)  # noqa: E731
    return _cast({"codes": zeros(B, H, V, K), "s_k": zeros(B, H, K) + EPS, "s_v": zeros(B, H, V) + EPS,
                  "u": zeros(B, H, R, K), "q": zeros(B, H, R, V)})


def _trajectory(d: _Draws, B, H, V, K, L, R) -> tuple[dict, dict, torch.Tensor]:
    """Start from an empty checkpoint and stream TRAJECTORY_WINDOWS windows through the flush, feeding each
    checkpoint back; the workload is the last checkpoint with one more window."""
    q0 = _q0(d, V, R)
    checkpoint = _empty_checkpoint(B, H, V, K, R, d.device)
    for _ in range(TRAJECTORY_WINDOWS):
        checkpoint = _flush_fp64({**checkpoint, **_cast(_kda_window(d, B, H, V, K, L))}, q0)
    return checkpoint, _cast(_kda_window(d, B, H, V, K, L)), q0


# ----------------------------------------------------------------------------------------------- stress: a grammar
# The `stress` family and `python -m harness.stress` draw every head (program) from independent named choices, each
# option list ordered from the plainest to the most degenerate, so that a search shrinks a failing head towards the
# plain one and a reproducer names only the choices that matter. Every value is built from exact operations on
# values exact in the input dtypes, so an exactly rank-deficient state or a projection onto q0 that vanishes is
# exactly that in the inputs, not approximately.
PROGRAM_GRAMMAR = {
    "checkpoint": ("both", "tokens", "codes", "zero"),      # which parts of the old checkpoint hold anything
    "tokens_rank": (4, 3, 2, 1),                           # rank of its token part q^T u
    "window": ("full", "few", "one", "empty"),              # live entries: 16, 4, 1, 0 (the rest as a reset leaves them)
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
TOTAL_DECAY_PCUM = -2000.0
TOTAL_DECAY_GATE = 2.0 ** -24                               # fp16's smallest positive value: gbuf stays in (0, 1]


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent (integral fp64 in the normal range), built from its bits: exact on every device."""
    return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)


def _dyadic(x: torch.Tensor) -> torch.Tensor:
    """x on the grid k / 8: exact in fp16 and bf16 for |x| <= 32."""
    return torch.round(x * 8.0) * 0.125


def _stress_choices(d: _Draws, B, H, params: dict) -> tuple[dict, dict]:
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


def _stress(d: _Draws, B, H, V, K, L, R, params: dict) -> tuple[dict, dict, torch.Tensor]:
    choices, call = _stress_choices(d, B, H, params)

    def where(axis, option, t, value):
        mask = choices[axis] == PROGRAM_GRAMMAR[axis].index(option)
        return torch.where(mask.reshape(B, H, *(1,) * (t.dim() - 2)), value, t)

    x = {**_random_checkpoint(d, B, H, V, K, R), **_random_window(d, B, H, V, K, L)}
    directions = d.integers((B, H, 5, V), -8, 8) * 0.125     # the value-side basis of a rank-r state
    q0 = _q0(d, V, R)
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
        basis = _mgs2(q0)

        def orthogonal(t):
            return t - _ordered_matmul(_ordered_matmul(t, basis), basis.transpose(-1, -2))
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
    checkpoint = _cast({k: x[k] for k in CHECKPOINT})
    return checkpoint, _cast({k: x[k] for k in WINDOW}), q0


def make_inputs(family: str, axes: dict, seed: int, device="cpu", params: dict | None = None
                ) -> dict[str, torch.Tensor]:
    """The inputs of one workload: a pure function of (family, axes, seed, params) whose bits do not depend on
    `device`. Only the stress family takes params: {"programs": [choices, ...], "call": choices}, each choices an
    object of PROGRAM_GRAMMAR (CALL_GRAMMAR) axes and options; anything else raises ValueError."""
    B, H, V, K, L, R = _dims(axes)
    d = _Draws(seed, torch.device(device))
    if params and family != STRESS_FAMILY:
        raise ValueError(f"family {family!r} takes no parameters")
    if family == STRESS_FAMILY:
        checkpoint, window, q0 = _stress(d, B, H, V, K, L, R, params or {})
    elif family == "random":
        checkpoint = _cast(_random_checkpoint(d, B, H, V, K, R))
        window, q0 = _cast(_random_window(d, B, H, V, K, L)), _q0(d, V, R)
    elif family == "edge":
        checkpoint, window, q0 = _edge(d, B, H, V, K, L, R)
    elif family == "second_window":
        checkpoint, window, q0 = _second_window(seed, _Draws(seed + 1, d.device), B, H, V, K, L, R)
    elif family == "trajectory":
        checkpoint, window, q0 = _trajectory(d, B, H, V, K, L, R)
    else:
        raise ValueError(f"unknown input family {family!r} (known: {', '.join(FAMILIES)})")
    return {k: v.contiguous() for k, v in {**checkpoint, **window, "q0": q0.to(DTYPES["q0"])}.items()}


# ----------------------------------------------------------------------------------------------- symmetries
# The harness times every call on programs no earlier call held: each timed call applies one of these to programs of
# a fresh pool. A signed permutation of the value axis (P_v, D_v) and of the key axis (P_k, D_k) maps every input to
# another input of the same family, exactly in every dtype (a permutation moves values, a sign flip of an int8 code
# in [-127, 127] or of a float is exact), and the state S to D_v P_v S P_k D_k. q0 stays fixed, so the subspace
# iteration starts elsewhere relative to the state and every output changes: no output can be derived from an earlier
# call's without the work.
def draw_variants(n: int, axes: dict, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Parameters of n random signed permutations: perm_v [n, V], perm_k [n, K] (int64), sign_v [n, V],
    sign_k [n, K] (+-1, int8)."""
    V, K = axes["value_dim"], axes["key_dim"]
    device = generator.device

    def perm(m):
        return torch.argsort(torch.rand(n, m, generator=generator, device=device), dim=-1, stable=True)

    def sign(m):
        return torch.where(torch.rand(n, m, generator=generator, device=device) < 0.5, -1, 1).to(torch.int8)
    return {"perm_v": perm(V), "perm_k": perm(K), "sign_v": sign(V), "sign_k": sign(K)}


def apply_variant(x: dict, variant: dict) -> dict:
    """The inputs x under one signed permutation (perm_v [V], perm_k [K], sign_v [V], sign_k [K]): new tensors,
    q0 and w as they were."""
    pv, pk, sv, sk = variant["perm_v"], variant["perm_k"], variant["sign_v"], variant["sign_k"]

    def values(t, signed):      # last dim is the value axis
        t = t.index_select(-1, pv)
        return t * sv.to(t.dtype) if signed else t

    def keys(t, signed):        # last dim is the key axis
        t = t.index_select(-1, pk)
        return t * sk.to(t.dtype) if signed else t
    codes = x["codes"].index_select(-2, pv).index_select(-1, pk) * (sv[:, None] * sk[None, :])
    return {**x, "codes": codes, "s_k": keys(x["s_k"], False), "s_v": values(x["s_v"], False),
            "u": keys(x["u"], True), "q": values(x["q"], True), "kbuf": keys(x["kbuf"], True),
            "ubuf": values(x["ubuf"], True), "gbuf": keys(x["gbuf"], False), "pcum": keys(x["pcum"], False)}


# ----------------------------------------------------------------------------------------------- drift
def drift(flush, reference, axes: dict, windows: int, seed: int, device="cpu"):
    """Stream `windows` trajectory-family windows through two pipelines that feed their checkpoints back, the
    candidate `flush` and `reference` (each called with the 11 inputs, returning the 5 outputs), from an empty
    checkpoint. Yields per window the mean decoded error of each against the exactly propagated fp64 state, their
    ratio and the worst per-head ratio (heads the format captures almost exactly, as in the criterion, left out)."""
    B, H, V, K, L, R = _dims(axes)
    d = _Draws(seed, torch.device(device))
    q0 = _q0(d, V, R).to(DTYPES["q0"])
    candidate = reference_checkpoint = _empty_checkpoint(B, H, V, K, R, d.device)
    state = torch.zeros((B, H, V, K), dtype=torch.float64, device=d.device)
    for t in range(windows):
        window = _cast(_kda_window(d, B, H, V, K, L))
        state = _advance(state, window)
        candidate = dict(zip(CHECKPOINT, flush(**candidate, **window, q0=q0)))
        reference_checkpoint = dict(zip(CHECKPOINT, reference(**reference_checkpoint, **window, q0=q0)))
        err = head_errors([candidate[k] for k in CHECKPOINT], state)
        err_ref = head_errors([reference_checkpoint[k] for k in CHECKPOINT], state)
        judged = err_ref >= EXACT_HEAD * state.abs().mean((-2, -1))
        worst = float((err / err_ref)[judged].max()) if judged.any() else None
        yield {"window": t, "error": float(err.mean()), "reference_error": float(err_ref.mean()),
               "ratio": float(err.mean() / err_ref.mean()) if err_ref.mean() > 0 else 1.0,
               "worst_head_ratio": worst}


# ----------------------------------------------------------------------------------------------- the criterion
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
    judged = (err_ref >= EXACT_HEAD * scale) & (err_ref > 0)
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


# ----------------------------------------------------------------------------------------------- deployment form
# The caller-owned pool a serving engine flushes in place (docs/operator.md, "Deployment form"); solutions provide
# `flush_inplace(pool, idx, q0)` for it in their `pool.py`. The region of (slot, head) starts at byte
# POOL_HEADER + (33 slot + head) * POOL_REGION (32 heads and one spare region a slot) and its first CHECKPOINT_BYTES
# are the checkpoint: int8 codes [V, K] at +0, fp32 s_k [K] at +16,384, fp32 s_v [V] at +16,896, fp16 rows u | q
# [R, K + V] at +17,408. The rest of each region, the spare regions and the header belong to the caller.
POOL_HEADER = 49_152
POOL_REGION = 65_536
POOL_REGIONS_PER_SLOT = 33
POOL_OFFSETS = {"codes": 0, "s_k": 16_384, "s_v": 16_896, "u": 17_408, "q": 17_408 + 256}
CHECKPOINT_BYTES = 19_456
EMPTY_SCALE = 1e-12     # the scales of an empty checkpoint (the flush's clamp; the domain wants > 0)


class Pool:
    """One flat byte buffer in the published engine layout with typed views [num_slots, heads, ...] of the checkpoint
    fields (codes, s_k, s_v, u, q; `regions` [num_slots, 33, POOL_REGION] bytes), and beside it the dense window
    (kbuf, ubuf, gbuf, w), pcum and the int32 fill counter `count` [num_slots, heads]. Slot 0 is reserved (idx 0 means
    no sequence). Every checkpoint starts empty and every window reset. Shapes: the definition's, heads = 32,
    V = K = 128, R = 4, L = 16."""

    HEADS, V, K, R, L = 32, 128, 128, 4, 16

    def __init__(self, num_slots: int, device):
        if not isinstance(num_slots, int) or num_slots < 2:
            raise ValueError(f"num_slots must be an int >= 2 (slot 0 is reserved), got {num_slots!r}")
        H, V, K, R, L = self.HEADS, self.V, self.K, self.R, self.L
        self.num_slots = num_slots
        self.buffer = torch.zeros(POOL_HEADER + num_slots * POOL_REGIONS_PER_SLOT * POOL_REGION, dtype=torch.uint8,
                                  device=device)
        self.device = self.buffer.device        # with its index ("cuda:0"), as every tensor's device is
        self.regions = self.buffer[POOL_HEADER:].view(num_slots, POOL_REGIONS_PER_SLOT, POOL_REGION)
        self.codes = self._field(torch.int8, "codes", (V, K), K)
        self.s_k = self._field(torch.float32, "s_k", (K,), K)
        self.s_v = self._field(torch.float32, "s_v", (V,), V)
        self.u = self._field(torch.float16, "u", (R, K), K + V)
        self.q = self._field(torch.float16, "q", (R, V), K + V)
        self.s_k.fill_(EMPTY_SCALE)
        self.s_v.fill_(EMPTY_SCALE)

        def dense(*shape, dtype, fill=0.0):
            return torch.full((num_slots, H, *shape), fill, dtype=dtype, device=self.device)
        self.kbuf = dense(L, K, dtype=DTYPES["kbuf"])
        self.ubuf = dense(L, V, dtype=DTYPES["ubuf"])
        self.gbuf = dense(L, K, dtype=DTYPES["gbuf"], fill=WINDOW_RESET["gbuf"])
        self.w = dense(L, dtype=DTYPES["w"], fill=WINDOW_RESET["w"])
        self.pcum = dense(K, dtype=DTYPES["pcum"], fill=WINDOW_RESET["pcum"])
        self.count = dense(dtype=torch.int32)

    def write(self, slots, **tensors) -> None:
        """Put per-sequence tensors [N, heads, ...] (any of the checkpoint and window fields and count) into the
        slots `slots` [N]."""
        for name, t in tensors.items():
            if name not in (*CHECKPOINT, *WINDOW, "count"):
                raise ValueError(f"no pool field {name!r} (fields: {', '.join((*CHECKPOINT, *WINDOW, 'count'))})")
            getattr(self, name)[slots] = t

    def check_call(self, idx, q0) -> None:
        """What `flush_inplace(self, idx, q0)` may check without the values (no host synchronisation): raises
        ValueError in one line. idx's values are the caller's contract, checked by `check_idx`."""
        self.check_idx_tensor(idx)
        shape = (self.V, self.R)
        if not isinstance(q0, torch.Tensor) or q0.dtype != torch.float32 or tuple(q0.shape) != shape \
                or not q0.is_contiguous() or q0.device != self.device:
            got = f"{q0.dtype} {list(q0.shape)} on {q0.device}" if isinstance(q0, torch.Tensor) else type(q0).__name__
            raise ValueError(f"q0 must be a contiguous float32 {list(shape)} tensor on {self.device}, got {got}")

    def check_idx_tensor(self, idx) -> None:
        """idx is a contiguous 1-D int32 tensor on the pool's device, or ValueError in one line."""
        if not isinstance(idx, torch.Tensor) or idx.dtype != torch.int32 or idx.dim() != 1 or not idx.is_contiguous():
            got = f"{idx.dtype} {list(idx.shape)}" if isinstance(idx, torch.Tensor) else type(idx).__name__
            raise ValueError(f"idx must be a contiguous 1-D int32 tensor of slots, got {got}")
        if idx.device != self.device:
            raise ValueError(f"idx is on {idx.device}, the pool on {self.device}")

    def _field(self, dtype, name: str, shape: tuple, row: int) -> torch.Tensor:
        """[num_slots, heads, *shape] view of a checkpoint field in every region; the last dim contiguous, the one
        before it `row` elements apart."""
        size = dtype.itemsize
        per_region = POOL_REGION // size
        inner = (row, 1) if len(shape) == 2 else (1,)
        return self.buffer.view(dtype).as_strided((self.num_slots, self.HEADS, *shape),
                                                  (POOL_REGIONS_PER_SLOT * per_region, per_region, *inner),
                                                  (POOL_HEADER + POOL_OFFSETS[name]) // size)


def check_idx(pool: Pool, idx) -> None:
    """The caller's contract on idx, checked on the host (a synchronisation): every value in [0, num_slots) and no
    slot twice (0 may repeat). Raises ValueError in one line."""
    pool.check_idx_tensor(idx)
    values = idx.cpu()
    bad = values[(values < 0) | (values >= pool.num_slots)]
    if bad.numel():
        raise ValueError(f"idx holds slot {int(bad[0])}, outside [0, {pool.num_slots})")
    used, counts = values[values != 0].unique(return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"idx holds slot {int(used[counts > 1][0])} more than once")
