"""The operator module: families inside the domain and reproducible, and the criterion rejecting planted wrong
variants with the right reason."""
import math

import pytest
import torch

from conftest import PROJECT, axes_for
from harness.ops import leapquant_kda_flush as op
from harness.ops.leapquant_kda_flush import families
from harness.ops.leapquant_kda_flush.criterion import BROKEN_CAP
from harness.solutions import load_entry, load_solution

SEEDS = (11, 12345)


def _inputs(defn, family, batch_size, seed):
    return op.make_inputs(family, axes_for(defn, batch_size), seed)


@pytest.mark.parametrize("family", op.FAMILIES)
def test_family_inside_domain(defn, family):
    for seed in SEEDS:
        x = _inputs(defn, family, 2, seed)
        axes = axes_for(defn, 2)
        for name, spec in defn.inputs.items():
            assert x[name].dtype == spec.torch_dtype and tuple(x[name].shape) == defn.shape(spec, axes), name
        assert (x["s_k"] > 0).all() and (x["s_v"] > 0).all()
        assert ((x["w"] >= 0) & (x["w"] <= 1)).all()
        assert ((x["gbuf"] > 0) & (x["gbuf"] <= 1)).all()
        assert (x["pcum"] <= 0).all()
        assert (x["codes"] >= -127).all()
        assert op.exact_state(x).abs().max() < 1e5
        assert all(torch.isfinite(t.float()).all() for t in x.values())


@pytest.mark.parametrize("family", op.FAMILIES)
def test_movable_parts_stay_in_the_domain_however_they_are_moved_apart(defn, family):
    """parts_movable's promise: a program it marks movable keeps its largest entry below STATE_MAX and every column
    below COLUMN_NORM_MAX with its checkpoint and window under the timer's two related signed permutations (the
    value axis's apart); the heads built at the domain's edge (edge's `huge`) are the ones it keeps together."""
    axes = axes_for(defn, 2)
    generator = torch.Generator().manual_seed(3)
    for seed in SEEDS:
        x = _inputs(defn, family, 2, seed)
        movable = op.parts_movable(x)
        for _ in range(3):
            v = op.draw_variants(1, 2, axes, generator)
            moved = {**op.apply_variant({k: x[k] for k in op.CHECKPOINT}, {n: p[0, 0] for n, p in v.items()}),
                     **op.apply_variant({k: x[k] for k in op.WINDOW}, {n: p[0, 1] for n, p in v.items()})}
            s = op.exact_state({**x, **moved})
            assert (s.abs().amax((-2, -1))[movable] < families.STATE_MAX).all()
            assert (s.norm(dim=-2).amax(-1)[movable] < families.COLUMN_NORM_MAX).all()
        if family in op.INDEPENDENT_PARTS_FAMILIES:
            assert movable.all()
        if family == "edge":
            huge = op.edge_kinds(2, 32, "cpu") == op.EDGE_KINDS.index("huge")
            assert not movable[huge].any() and movable[~huge].float().mean() > 0.9


@pytest.mark.parametrize("family", op.FAMILIES)
def test_family_reproducible_and_seeded(defn, family):
    a, b = _inputs(defn, family, 1, 7), _inputs(defn, family, 1, 7)
    c = _inputs(defn, family, 1, 8)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["codes"], c["codes"]) or not torch.equal(a["kbuf"], c["kbuf"])


def test_edge_holds_every_kind(defn):
    x = _inputs(defn, "edge", 1, 3)
    s = op.exact_state(x)[0]
    scale = s.abs().mean((-2, -1))
    kinds = op.edge_kinds(1, s.shape[0], s.device)[0]
    by_kind = {k: scale[kinds == i] for i, k in enumerate(op.EDGE_KINDS)}
    assert (by_kind["zero"] == 0).all()
    assert (by_kind["tiny"] < 1e-3).all() and (by_kind["tinier"] < 1e-5).all()
    assert (by_kind["huge"] > 100 * by_kind["generic"].max()).all()
    assert (x["pcum"][0][kinds == op.EDGE_KINDS.index("decayed")] <= -200).all()
    for kind, rank in (("rank1", 1), ("rank2", 2)):
        for h in (kinds == op.EDGE_KINDS.index(kind)).nonzero().flatten():
            sv = torch.linalg.svdvals(s[h])
            assert sv[rank] < 1e-9 * sv[0], (kind, sv[:4])


def test_second_window_starts_from_a_flushed_edge_checkpoint(defn):
    edge, second = _inputs(defn, "edge", 1, 5), _inputs(defn, "second_window", 1, 5)
    assert torch.equal(edge["q0"], second["q0"])
    ref = defn.reference_run()(**edge)
    codes_agree = (ref[0] == second["codes"]).float().mean()
    assert codes_agree > 0.95      # the fp64 feedback and the fp32 reference round a few codes differently
    assert not torch.equal(edge["kbuf"], second["kbuf"])


# ---------------------------------------------------------------------------------------------- planted variants
def _requantize(x, ref_out, residual=lambda e: e, rounding=torch.round):
    """Scales and codes recomputed from the reference's tokens, with a planted change to the residual or rounding."""
    _, _, _, u, q = ref_out
    e = residual(op.exact_state(x).float() - q.float().transpose(-1, -2) @ u.float())
    sk = e.abs().mean(-2).sqrt().clamp_min(op.EPS)
    sv = (e.abs() / sk[..., None, :]).amax(-1).clamp_min(op.EPS)
    codes = rounding(e / (sk[..., None, :] * sv[..., :, None]) * op.QMAX).clamp(-op.QMAX, op.QMAX).to(torch.int8)
    return codes, sk, sv, u, q


def _bf16_decayed_keys(defn, x):
    d = op.decay_history(x["gbuf"].double())
    planted = dict(x, kbuf=(x["kbuf"].double() * d).to(torch.bfloat16), gbuf=torch.ones_like(x["gbuf"]))
    return defn.reference_run()(**planted)


PLANTED = {
    "codes truncated": lambda defn, x, ref: _requantize(x, ref, rounding=torch.trunc),
    "residual in fp16": lambda defn, x, ref: _requantize(x, ref, residual=lambda e: e.half().float()),
    "decayed keys in bf16": lambda defn, x, ref: _bf16_decayed_keys(defn, x),
}


@pytest.mark.parametrize("family", op.FAMILIES)
def test_exact_requantization_passes(defn, family):
    """The planted variants' own pipeline, left unplanted, passes: the failures below are the plants' doing."""
    x = _inputs(defn, family, 2, 99)
    ref = defn.reference_run()(**x)
    assert op.judge(x, _requantize(x, ref), ref).passed


@pytest.mark.parametrize("variant", PLANTED)
def test_planted_variant_rejected(defn, variant):
    failures = []
    for family in op.FAMILIES:
        x = _inputs(defn, family, 2, 99)
        ref = defn.reference_run()(**x)
        v = op.judge(x, PLANTED[variant](defn, x, ref), ref)
        failures.append((family, v.passed, v.reason))
    assert any(not passed for _, passed, _ in failures), failures
    assert all(("ratio" in r or "cap" in r) for _, passed, r in failures if not passed), failures


def test_code_out_of_range_rejected(defn):
    x = _inputs(defn, "random", 1, 4)
    ref = defn.reference_run()(**x)
    codes = ref[0].clone()
    codes[0, 3, 5, 7] = -128
    v = op.judge(x, (codes,) + ref[1:], ref)
    assert not v.passed and "out of range" in v.reason


@pytest.mark.parametrize("index", [1, 2, 3])
def test_non_finite_rejected(defn, index):
    x = _inputs(defn, "trajectory", 1, 4)
    ref = defn.reference_run()(**x)
    bad = list(ref)
    bad[index] = bad[index].contiguous().clone()
    bad[index].view(-1)[17] = float("nan")
    v = op.judge(x, tuple(bad), ref)
    assert not v.passed and "non-finite" in v.reason


def test_swapped_scales_rejected(defn):
    x = _inputs(defn, "random", 1, 4)
    ref = defn.reference_run()(**x)
    v = op.judge(x, (ref[0], ref[2], ref[1], ref[3], ref[4]), ref)
    assert not v.passed and "ratio" in v.reason


@pytest.mark.parametrize("seed", SEEDS)
def test_scales_that_only_work_out_in_fp64_are_rejected(defn, seed):
    """s_k raised and s_v lowered by the same power of two on one head: the exact decode is unchanged, bit for bit,
    but a consumer's fp32 decode ((codes * s_k) / 127 * s_v) overflows there."""
    x = _inputs(defn, "random", 1, seed)
    ref = defn.reference_run()(**x)
    s_k, s_v = ref[1].clone(), ref[2].clone()
    shift = 2.0 ** (121 - int(torch.log2(s_k[0, 7].max()).floor()))      # codes * s_k past fp32's 3.4e38
    s_k[0, 7] *= shift
    s_v[0, 7] /= shift
    assert torch.isfinite(s_k).all() and float(s_v[0, 7].min()) >= 2.0 ** -126      # still normal fp32 numbers
    tampered = (ref[0], s_k, s_v, ref[3], ref[4])
    assert torch.equal(op.decode_checkpoint(*tampered), op.decode_checkpoint(*ref))
    v = op.judge(x, tampered, ref)
    assert not v.passed and v.extra["failure"] == "non-finite fp32 decode" and "head 7" in v.reason, v.reason
    assert op.judge(x, ref, ref).passed


def test_zero_head_must_decode_exactly(defn):
    x = _inputs(defn, "edge", 1, 4)
    ref = defn.reference_run()(**x)
    zero = int((op.edge_kinds(1, 32, "cpu")[0] == op.EDGE_KINDS.index("zero")).nonzero()[0])
    u, q = ref[3].clone(), ref[4].clone()
    u[0, zero, 0, 0], q[0, zero, 0, 0] = 1e-3, 1.0
    v = op.judge(x, ref[:3] + (u, q), ref)
    assert not v.passed and "cap" in v.reason and f"head {zero}" in v.reason


# ---------------------------------------------------------------------------------------------- stress grammar
def _stress(defn, programs, call=None, seed=0, batch_size=1):
    return op.make_inputs("stress", axes_for(defn, batch_size), seed, params={"programs": programs,
                                                                              "call": call or {}})


@pytest.mark.parametrize("r", [0, 1, 2, 3, 4, 5])
def test_stress_rank_is_exact(defn, r):
    """A head of rank r is exactly of rank <= r (singular values past r at fp64 rounding), whatever its other
    choices; r < 5 heads with codes are not possible, so every such head is captured by the tokens alone."""
    programs = [{"rank": r, "checkpoint": c, "window": wdw, "keys": k, "scale": sc, "values": v}
                for c in ("both", "tokens") for wdw in ("full", "one") for k in ("random", "cancel")
                for sc in ("unit", "hot_row", "huge") for v in ("random", "exact")][:32]
    x = _stress(defn, programs, seed=r)
    assert (x["codes"] == 0).all()
    for h, sv in enumerate(torch.linalg.svdvals(op.exact_state(x)[0])):
        assert r == 5 or sv[r] <= 1e-12 * sv[0], (h, programs[h], sv[:6])


@pytest.mark.parametrize("q0", ["half", "one_hot"])
def test_stress_orthogonal_to_q0_exactly(defn, q0):
    """With q0 zero on part of the value axis, a low-rank head orthogonal to q0 has S^T q0 = 0 exactly: the first
    Gram-Schmidt sees an all-zero matrix."""
    programs = [{"rank": r, "overlap": "orthogonal_q0", "scale": s} for r in (1, 2, 3, 4, 5)
                for s in ("unit", "hot_row", "tiny")]
    x = _stress(defn, programs, {"q0": q0})
    s = op.exact_state(x)[0, :len(programs)]
    assert (torch.einsum("hvk,vr->hkr", s, x["q0"].double()) == 0).all()
    assert (s.abs().amax((-2, -1)) > 0).all()


def test_stress_windows_and_cancelling_pairs(defn):
    x = _stress(defn, [{"checkpoint": "zero", "window": w, "keys": "cancel", "decay": "none"}
                       for w in ("full", "few", "one", "empty")])
    live = (x["w"][0, :4] != 0).sum(-1).tolist()
    assert live == [16, 4, 1, 0]
    s = op.exact_state(x)[0]
    only_ends = {k: x[k].clone() for k in x}
    only_ends["w"][0, 0, 1:15] = 0          # full window: pairs (1, 2) ... (13, 14) cancel, entries 0 and 15 stay
    only_ends["w"][0, 1, 1:3] = 0           # four entries: pair (1, 2) cancels
    assert torch.allclose(op.exact_state(only_ends)[0, :2], s[:2], rtol=0, atol=1e-12 * float(s.abs().max()))
    assert (s[3] == 0).all() and (x["s_k"][0, :4] == op.EPS).all()


def test_stress_plain_programs_and_bad_params(defn):
    """Programs past the named list are plain; a named axis must exist and its option be one of the grammar's."""
    x = _stress(defn, [{"rank": 0}])
    assert (op.exact_state(x)[0, 0] == 0).all() and (op.exact_state(x)[0, 1:].abs().amax((-2, -1)) > 0).all()
    for params, message in (({"programs": [{"colour": "red"}]}, "keys among"),
                            ({"programs": [{"rank": 7}]}, "has no option 7"),
                            ({"call": {"q0": "sparse"}}, "has no option 'sparse'"),
                            ({"heads": []}, "unknown stress parameters")):
        with pytest.raises(ValueError, match=message):
            op.make_inputs("stress", axes_for(defn, 1), 0, params=params)


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 1e6])
def test_a_head_the_reference_breaks_on_is_held_to_the_looser_cap(defn, bad):
    """The reference's fp32 Gram-Schmidt returns non-finite or overlong token rows on some exactly rank-deficient
    stress heads (a search over the grammar finds them; a GPU run found one whose inflated rows made the reference's
    error near zero, so the exact-head cap failed every correct kernel). Such a head has no reference error to
    compare with: a right output passes, a wrong one fails on the looser cap."""
    x = _inputs(defn, "stress", 1, 5)
    ref = defn.reference_run()(**x)
    head = 3
    broken_q = ref[4].clone()
    broken_q[0, head, 0, 0] = bad
    broken_ref = ref[:4] + (broken_q,)
    verdict = op.judge(x, ref, broken_ref)
    assert verdict.passed and verdict.extra["reference_broken_heads"] == 1
    wrong_u = ref[3].clone()
    wrong_u[0, head] *= 1.5
    v = op.judge(x, ref[:3] + (wrong_u, ref[4]), broken_ref)
    assert not v.passed and "cap" in v.reason and f"head {head}" in v.reason


def test_the_reference_judged_as_its_own_yardstick_is_not_failed_where_it_breaks(defn):
    """The definition's reference, run as a solution for its times, returned non-finite tokens on one stress head of
    a timed call under a symmetry (H100 and H200, B = 256): the reference it is judged against, run by the harness,
    breaks on the same head. As the yardstick that head is counted, not failed; any other output there still fails
    as a candidate's would, and a yardstick that breaks where the harness's reference does not fails too."""
    x = _inputs(defn, "stress", 1, 5)
    ref = defn.reference_run()(**x)
    head, other = 3, 5
    broken_u = ref[3].clone()
    broken_u[0, head, 0, 0] = float("nan")
    broken = ref[:3] + (broken_u, ref[4])
    verdict = op.judge(x, broken, broken, defn.reference, yardstick=True)
    assert verdict.passed and verdict.extra["reference_broken_heads"] == 1, verdict.reason
    verdict = op.judge(x, broken, broken, defn.reference)
    assert not verdict.passed and f"non-finite values in u_new at (batch 0, head {head})" in verdict.reason
    elsewhere = broken_u.clone()
    elsewhere[0, other, 0, 0] = float("inf")
    verdict = op.judge(x, ref[:3] + (elsewhere, ref[4]), broken, defn.reference, yardstick=True)
    assert not verdict.passed and f"head {other})" in verdict.reason, verdict.reason


DEEP_RANK_ONE = {"checkpoint": "tokens", "tokens_rank": 2, "window": "few", "keys": "cancel", "rank": 4,
                 "scale": "deep", "decay": "total", "values": "exact"}


@pytest.mark.parametrize("lifted", [True, False])
def test_deep_rank_deficient_heads_are_judged_fairly(defn, monkeypatch, lifted):
    """`deep` heads (s_v and ubuf at 2^-32, no tokens) whose window cancels to rank 1 lie near 1e-10: fp16 tokens hold
    nothing there, and the reference's Gram-Schmidt breaks on about one head in four (an H100 run failed cuda_v1 and
    triton_v1 on such heads, the reference's tokens inflated). The family lifts every state that is not zero to a
    largest entry of at least 2^-20; unlifted, the judge holds the heads the reference breaks on to the looser cap,
    which torch_v1 meets where the exact-head cap (a tenth of it) would fail it."""
    if not lifted:
        monkeypatch.setattr(families, "STATE_MIN", 2.0 ** -200)
    axes = axes_for(defn, 1)
    flush = load_entry(load_solution("torch_v1", defn, PROJECT.solutions), defn)
    broken, cap_use = 0, 0.0
    for seed in (0, 1, 2):
        x = op.make_inputs("stress", axes, seed, params={"programs": [DEEP_RANK_ONE] * 32, "call": {"q0": "one_hot"}})
        largest = op.exact_state(x).abs().amax((-2, -1))
        assert ((largest == 0) | (largest >= 2.0 ** -20)).all() == lifted
        verdict = op.judge(x, flush(x, axes), defn.reference_run()(**x))
        assert verdict.passed, verdict.reason
        broken += verdict.extra["reference_broken_heads"]
        cap_use = max(cap_use, verdict.extra["max_cap_use"])
    if not lifted:
        assert broken > 0 and cap_use > op.EXACT_CAP / BROKEN_CAP


# the fresh seed of second_window B = 64 in an H100 run (harness.runner.fresh_seed of run seed 32805483733539235)
LUCKY_SEED, LUCKY_B, LUCKY_HEAD = 68589653423761957, 32, 28


def test_a_head_where_the_reference_is_lucky_is_measured_against_its_orderings(defn):
    """On this head (mean|S| 2.3e-8) the fp32 reference's error is lucky: torch_v1, the reference with S^T q0 computed
    as (q0^T S)^T and the reference in fp64 all come out 1.12% worse. With the definition's code the judge measures
    the head against the most lenient equivalent ordering and passes it; a kernel that is worse than all of them
    still fails."""
    x = op.make_inputs("second_window", axes_for(defn, 64), LUCKY_SEED)
    x = {k: (v if k == "q0" else v[LUCKY_B:LUCKY_B + 1]) for k, v in x.items()}
    axes = axes_for(defn, 1)
    out = load_entry(load_solution("torch_v1", defn, PROJECT.solutions), defn)(x, axes)
    ref = defn.reference_run()(**x)
    plain = op.judge(x, out, ref)
    assert not plain.passed and f"head {LUCKY_HEAD})" in plain.reason and plain.score < 1.02, plain.reason
    verdict = op.judge(x, out, ref, defn.reference)
    assert verdict.passed and verdict.extra["ratio_rechecked_heads"] == 1, verdict.reason
    worse = out[:3] + (out[3] * 1.001, out[4])
    verdict = op.judge(x, worse, ref, defn.reference)
    assert not verdict.passed and "most lenient equivalent ordering" in verdict.reason, verdict.reason


def test_a_head_where_the_tokens_fp16_rounding_decides_is_measured_against_the_reference_rounding_alike(
        defn, monkeypatch):
    """On this head (leading singular value ~2e3, tail ~3) torch_v1's fp32 token entry and the reference's sit on
    either side of an fp16 midpoint (0.0004 of an fp16 unit from it): the other rounding costs 1.4% of error, a
    lottery that no ordering of the reference reproduces. The judge measures the head against the reference rounding
    as torch_v1 did, and passes it; a candidate that is worse than that still fails, and the reference given its own
    tokens rounds them as it did."""
    from safetensors.torch import load_file

    from harness.ops.leapquant_kda_flush import criterion
    x = {k: v for k, v in load_file(PROJECT.root / "tests" / "data" / "token_rounding_head.safetensors").items()}
    x = {k: x[k] for k in defn.inputs}
    axes = {**axes_for(defn, 1), "num_heads": 1}
    out = load_entry(load_solution("torch_v1", defn, PROJECT.solutions), defn)(x, axes)
    ref = defn.reference_run()(**x)
    verdict = op.judge(x, out, ref, defn.reference)
    assert verdict.passed and verdict.extra["ratio_rechecked_heads"] == 1, verdict.reason
    worse = out[:3] + (out[3] * 1.001, out[4])
    assert not op.judge(x, worse, ref, defn.reference).passed
    tokens = {name: ref[i] for name, i in criterion.TOKEN_OUTPUTS.items()}
    fp32 = [unrounded for _, unrounded in criterion._ordering_runs(x, defn.reference)]
    bound = criterion._token_bound(op.exact_state(x), x["q0"])
    again = criterion._rounded_as(defn.reference, tokens, fp32, bound)(**x)
    assert all(torch.equal(a, b) for a, b in zip(again, ref))
    monkeypatch.setattr(criterion, "_rounded_as", lambda code, candidate, fp32, bound: defn.reference_run())
    verdict = op.judge(x, out, ref, defn.reference)
    assert not verdict.passed and 1.01 < verdict.score < 1.02, verdict.reason


def test_the_orderings_by_symmetry_are_the_same_flush_summed_in_other_orders(defn):
    """The reference on inputs with permuted value and key axes, its outputs permuted back: on fresh random heads
    under 1% of the token entries round otherwise than the reference's, by at most a few fp16 units, and the errors
    agree within 0.5%; the unrounded tokens kept for the rounding rule are the outputs' (in the reference's
    coordinates). A permutation left unmapped would move every entry."""
    from harness.ops.leapquant_kda_flush import criterion
    x = op.make_inputs("random", axes_for(defn, 1), 9_301)
    state = op.exact_state(x)
    runs = criterion._ordering_runs(x, defn.reference)
    permuted = runs[len(runs) - criterion.PERMUTED_ORDERINGS:]
    assert len(permuted) == criterion.PERMUTED_ORDERINGS >= 2
    reference_error = criterion.head_errors(runs[0][0], state)
    for out, fp32 in permuted:
        for name, i in criterion.TOKEN_OUTPUTS.items():
            assert torch.equal(fp32[name].half(), out[i])
            unit = (torch.nextafter(runs[0][0][i], runs[0][0][i].new_tensor(math.inf)).float()
                    - runs[0][0][i].float()).abs()
            units = (out[i].float() - runs[0][0][i].float()).abs() / unit
            assert float(units.max()) <= 4 and float((units > 0).float().mean()) < 0.01, name
        ratio = criterion.head_errors(out, state) / reference_error
        assert float((ratio - 1).abs().max()) < 5e-3
    assert any(not torch.equal(out[3], runs[0][0][3]) for out, _ in permuted)      # other orders, other roundings


def test_a_head_whose_error_turns_on_one_token_entry_passes_tokens_summed_in_any_fp32_order(defn):
    """On this head (singular values 1.7e3, 2e2, then 8 and below) one entry of the leading u token lies a few
    millionths of an fp16 unit from a midpoint, and its other rounding costs 1.2% of error. Tokens off by what
    summing in another fp32 order gives (relative noise 2^-20: the orderings of the reference agree within 2^-22) take
    it in a third of the draws, and must pass; tokens off by 2^-11 (TF32) fail."""
    from safetensors.torch import load_file

    from harness.ops.leapquant_kda_flush import criterion
    x = load_file(PROJECT.root / "tests" / "data" / "summation_order_head.safetensors")
    x = {k: x[k] for k in defn.inputs}
    ref = defn.reference_run()(**x)
    state = op.exact_state(x)
    generator = torch.Generator().manual_seed(20)

    def perturbed(relative):
        def tokens(name, value):
            noise = torch.randn(value.shape, generator=generator, dtype=torch.float64)
            return (value.double() * (1 + relative * noise)).to(torch.float16)
        return criterion.ordering_run(defn.reference, [], "perturbed", tokens)(**x)

    plain_ratios, verdicts = [], []
    for _ in range(12):
        out = perturbed(2.0 ** -20)
        plain_ratios.append(float(criterion.head_errors(out, state)[0, 0] / criterion.head_errors(ref, state)[0, 0]))
        verdicts.append(op.judge(x, out, ref, defn.reference))
    assert max(plain_ratios) > 1.01, plain_ratios          # the lottery is drawn: the plain ratio would fail
    assert all(v.passed for v in verdicts), [v.reason for v in verdicts if not v.passed]
    assert not all(op.judge(x, perturbed(2.0 ** -11), ref, defn.reference).passed for _ in range(6))


def test_a_head_whose_start_is_rank_deficient_is_measured_against_the_exact_arithmetic(defn):
    """On this head S^T q0 has rank 3 while the state has rank 5: in exact arithmetic the fourth column's remainder
    is zero and the reference's token a zero one, in fp32 it is rounding normalised into an arbitrary direction whose
    luck decides the error. A kernel that makes it a zero token is 2x the fp32 reference's error and passes against
    the exact arithmetic's ordering; worse than that still fails."""
    from safetensors.torch import load_file

    from harness.ops.leapquant_kda_flush import criterion
    x = load_file(PROJECT.root / "tests" / "data" / "dependent_start_head.safetensors")
    x = {k: x[k] for k in defn.inputs}
    name = "exact: fp64, a dependent column a zero token"
    exact = criterion.ordering_run(defn.reference, criterion.ORDERINGS[name], name)(**x)
    candidate = tuple(t.to(dt) for t, dt in zip(exact, [t.dtype for t in defn.reference_run()(**x)]))
    assert int((candidate[4][0, 0].abs().sum(-1) == 0).sum()) == 1          # one zero token
    ref = defn.reference_run()(**x)
    plain = op.judge(x, candidate, ref)
    assert not plain.passed and plain.score > 1.5, plain.reason
    assert op.judge(x, candidate, ref, defn.reference).passed
    worse = candidate[:3] + (candidate[3] * 1.01, candidate[4])
    assert not op.judge(x, worse, ref, defn.reference).passed


def test_a_head_the_reference_captures_by_the_luck_of_its_rounding_is_not_held_to_the_cap(defn):
    """A tiny rank-4 state whose first column of S^T q0 vanishes exactly: the reference's fp32 rebuild leaves rounding
    there, normalised into a token that happens to capture the state (5.5e-5 of mean|S|, under EXACT_HEAD), while the
    exact arithmetic (and torch_v1, cuda_v1, triton_v1, whose rebuilds are exact there) makes it a zero token and
    leaves 1.4e-3 to the codes, over the 1e-3 cap. Measured against that ordering the head passes; 0.5% off s_v
    fails."""
    from safetensors.torch import load_file

    from harness.ops.leapquant_kda_flush import criterion
    x = load_file(PROJECT.root / "tests" / "data" / "orthogonal_start_head.safetensors")
    x = {k: x[k] for k in defn.inputs}
    name = "exact: fp64, a dependent column a zero token"
    exact = criterion.ordering_run(defn.reference, criterion.ORDERINGS[name], name)(**x)
    assert float(exact[3][0, 0, 0].abs().max()) == 0.0                          # the first token a zero one
    out = load_entry(load_solution("torch_v1", defn, PROJECT.solutions), defn)(x, {**axes_for(defn, 1),
                                                                                   "num_heads": 1})
    ref = defn.reference_run()(**x)
    plain = op.judge(x, out, ref)
    assert not plain.passed and "exceeds the cap" in plain.reason, plain.reason
    verdict = op.judge(x, out, ref, defn.reference)
    assert verdict.passed and verdict.extra["exact_heads"] == 0, verdict.reason
    worse = out[:2] + (out[2] * 1.005,) + out[3:]
    assert not op.judge(x, worse, ref, defn.reference).passed


def test_every_ordering_applies_to_the_reference_and_an_edit_that_does_not_is_refused(defn):
    from harness.ops.leapquant_kda_flush.criterion import ORDERINGS, ordering_run, orderings
    assert len(orderings(defn.reference)) == len(ORDERINGS)
    with pytest.raises(ValueError, match="is not in the reference code"):
        ordering_run(defn.reference, [("no such line", "x")], "broken")
    assert len(orderings(defn.reference.replace("uk = x @ qv", "uk = x.matmul(qv)"))) == len(ORDERINGS) - 1
