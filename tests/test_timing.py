"""The timer. Its parts (the draws, the symmetries, the clock check), then the whole timed path through
runner.evaluate: on the CPU (plain calls timed by perf_counter, a small loop and a loose tolerance for a shared
machine's noise) for the attacks that do not need a GPU, and on the GPU (skipped without one) for the rest. Each
attack is written as a competitor would write it and must lose; an honest solution in the same setting must pass."""
import dataclasses
import os
import re

import pytest
import torch
from safetensors.torch import load_file

from conftest import PROJECT, axes_for, make_solution
from harness import runner, timing
from harness.ops import leapquant_kda_flush as op
from harness.project import Settings
from harness.traces import read_traces
from harness.solutions import load_solution
from harness.workloads import load_inputs, load_workloads, select

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

HONEST = "from flush import run as flush\n\n\ndef run(*x):\n    return flush(*x)\n"

# Each finds the harness's TimedLoop (and the timed call's number) by walking up its callers' frames, as an attacker
# reading the harness's source would.
FIND_LOOP = """
import sys
from flush import run as flush


def _loop():
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if type(candidate).__name__ == "TimedLoop":
            return candidate
        frame = frame.f_back
    return None


def _call_number():
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "run" and "k" in frame.f_locals):
        frame = frame.f_back
    return frame.f_locals["k"] if frame is not None else None


# (loop, k, perm_v, perm_k, sign_v, sign_k) inside timed call k of a loop holding `kept`, else None; the symmetry
# is the checkpoint's (part 0), the window's differing from it
def _timed_call(kept):
    loop, k = _loop(), _call_number()
    if loop is None or k is None or not hasattr(loop, kept):
        return None
    return (loop, k, *(loop.variants[n][k, 0] for n in ("perm_v", "perm_k", "sign_v", "sign_k")))
"""

# Timed calls that return nothing useful; when the timed loop replies, `start` sets _fill_late(self) going, which
# writes every timed call's real outputs into the loop's output slots
LATE_OUTPUTS = """
import os
import threading
import torch
import harness.timing as timing
from flush import run as flush
_timed = [False]
_run = timing.TimedLoop.run


def _fill_late(loop):
    for k in range(loop.n_calls):
        x = timing.call_inputs(loop.op, loop.pool, loop.batched, loop.unit, loop.index, loop.variants, k,
                               loop.movable)
        for slot, t in zip(loop.slots[k], flush(*x.values())):
            slot.copy_(t)


def _timed_run(self, seed):
    _timed[0] = True
    try:
        return _run(self, seed)
    finally:
        _timed[0] = False
        {start}


timing.TimedLoop.run = _timed_run


def run(*x):
    if not _timed[0]:
        return flush(*x)
    return tuple(torch.empty_like(t) for t in flush(*x))
"""

CHEATS = {
    # the real flush done in the output-poisoning hook, before the timed region, into buffers the timed call copies
    "poison_hook": FIND_LOOP + """
import torch
import harness.timing
_buffers = {}
_poison = harness.timing.poison


def _set_of(loop, x):
    return next((i for i, s in enumerate(loop.sets) if s["codes"] is x[0]), None)


def _poison_and_flush(outputs):
    loop, i = _loop(), sys._getframe(1).f_locals.get("i")
    if loop is not None and i in _buffers:
        for buffer, t in zip(_buffers[i], flush(*loop.sets[i].values())):
            buffer.copy_(t)
    _poison(outputs)


harness.timing.poison = _poison_and_flush


def run(*x):
    loop = _loop()
    i = _set_of(loop, x) if loop is not None else None
    if i is None:
        return flush(*x)
    if i not in _buffers:
        _buffers[i] = tuple(torch.zeros_like(t) for t in flush(*x))
    return tuple(t.clone() for t in _buffers[i])
""",
    # every timed call's outputs computed in the first one (the schedule is in the loop's memory): a fast median
    "front_loads": FIND_LOOP + """
from harness.timing import call_inputs
_answers = []


def run(*x):
    loop, k = _loop(), _call_number()
    if loop is None or k is None or not hasattr(loop, "index"):
        return flush(*x)
    if k == 0:
        _answers[:] = [flush(*call_inputs(loop.op, loop.pool, loop.batched, loop.unit, loop.index, loop.variants,
                                          j, loop.movable).values()) for j in range(loop.n_calls)]
    return tuple(t.clone() for t in _answers[k])
""",
    # every program of the pool flushed once as it arrives (before the clock starts); each timed call then applies
    # its schedule's signed permutation to those outputs: a gather, no flush, at a small fraction of the time
    "undoes_symmetry": FIND_LOOP + """
import harness.timing as timing
_load_pool = timing.TimedLoop.load_pool


def _load_pool_and_flush(self, pool):
    _load_pool(self, pool)
    heads = self.unit[-1]
    x = {k: v.reshape(-1, heads, *v.shape[1:]) if k in self.batched else v for k, v in self.pool.items()}
    self.flushed = [t.reshape(-1, *t.shape[2:]) for t in flush(*x.values())]


timing.TimedLoop.load_pool = _load_pool_and_flush


def run(*x):
    found = _timed_call("flushed")
    if found is None:
        return flush(*x)
    loop, k, pv, pk, sv, sk = found
    codes, s_k, s_v, u, q = (t.index_select(0, loop.index[k, 0]) for t in loop.flushed)
    codes = codes.index_select(-2, pv).index_select(-1, pk) * (sv[:, None] * sk[None, :])
    out = (codes, s_k.index_select(-1, pk), s_v.index_select(-1, pv), u.index_select(-1, pk) * sk.to(u.dtype),
           q.index_select(-1, pv) * sv.to(q.dtype))
    return tuple(t.reshape(*loop.unit, *t.shape[1:]) for t in out)
""",
    # the state rebuilt for every pool program as the pool arrives (before the clock): the rebuild needs no q0, so it
    # follows the symmetry exactly, and each timed call would only gather and permute it and run the rest of the
    # flush. It cannot, since a timed program's checkpoint and window are moved apart (each part under a symmetry of
    # its own) and, in families of independent parts, come from two pool programs (PROGRAM_PARTS)
    "rebuilds_state_ahead": FIND_LOOP + """
import torch
import harness.timing as timing
from flush import EPS, QMAX, _orthonormalize
_load_pool = timing.TimedLoop.load_pool


def _rebuild(codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum):
    decay = torch.exp(pcum)
    after = torch.cumprod(gbuf.float().flip(-2), -2).flip(-2)
    d = torch.cat([after[..., 1:, :], torch.ones_like(after[..., :1, :])], -2)
    left = torch.cat([q.float(), ubuf.float()], -2).transpose(-1, -2)
    right = torch.cat([u.float() * decay[..., None, :], kbuf.float() * d * w[..., None]], -2)
    return torch.matmul(left, right) + codes.float() * (s_k * decay * (1.0 / QMAX))[..., None, :] * s_v[..., :, None]


def _load_pool_and_rebuild(self, pool):
    _load_pool(self, pool)
    self.states = _rebuild(*(self.pool[k] for k in self.sets[0] if k != "q0"))


timing.TimedLoop.load_pool = _load_pool_and_rebuild


def run(*x):
    found = _timed_call("states")
    if found is None:
        return flush(*x)
    loop, k, pv, pk, sv, sk = found
    s = loop.states.index_select(0, loop.index[k, 0]).index_select(-2, pv).index_select(-1, pk)
    s = (s * (sv[:, None] * sk[None, :])).reshape(*x[0].shape[:2], *s.shape[1:])
    st = s.transpose(-1, -2)
    qv = _orthonormalize(torch.matmul(s, _orthonormalize(torch.matmul(st, x[-1]))))
    u_new = torch.matmul(st, qv).transpose(-1, -2).to(torch.float16)
    q_new = qv.transpose(-1, -2).to(torch.float16)
    s = s - torch.matmul(q_new.transpose(-1, -2).float(), u_new.float())
    s_k_new = s.abs().mean(-2).sqrt().clamp_min(EPS)
    s_v_new = (s.abs() / s_k_new[..., None, :]).amax(-1).clamp_min(EPS)
    codes = torch.round(s * QMAX / (s_k_new[..., None, :] * s_v_new[..., :, None])).clamp_(-QMAX, QMAX)
    return codes.to(torch.int8), s_k_new, s_v_new, u_new, q_new
""",
    # a clock that reads zero
    "forges_clock": """
import time
import torch
from flush import run as flush


class _FastEvent(torch.cuda.Event):
    def elapsed_time(self, end):
        return 1e-6


torch.cuda.Event = _FastEvent
time.perf_counter = lambda: 0.0


def run(*x):
    return flush(*x)
""",
    # the timed calls do nothing; as the loop replies, a thread of the worker starts computing every timed call's
    # real outputs into the loop's output slots, after the harness's clock has stopped
    "late_outputs": LATE_OUTPUTS.format(start="threading.Thread(target=_fill_late, args=(self,)).start()"),
    # the same from a child process in a session of its own, which the kill of the worker's process group misses:
    # it dies with the sandbox's PID namespace, which the harness waits for before it reads
    "late_outputs_from_a_child": LATE_OUTPUTS.format(
        start="if os.fork() == 0:\n            os.setsid()\n            _fill_late(self)\n            os._exit(0)"),
    # the loop's own clock replaced by megabytes of JSON that would land in the committed trace
    "junk_loop_clock": """
import harness.timing as timing
from flush import run as flush
_run = timing.TimedLoop.run


def _junk(self, seed):
    out = _run(self, seed)
    self.loop_ms = {"note": "| forged | row |\\n" * 3, "blob": ["x" * 1000] * 3000}
    return out


timing.TimedLoop.run = _junk


def run(*x):
    return flush(*x)
""",
    # outputs cached by the input tensors' identity: right once, stale when the harness refills the buffers
    "replays_by_buffer": """
from flush import run as flush
_cache = {}


def run(*x):
    key = (tuple(x[0].shape), x[0].data_ptr())
    if key not in _cache:
        _cache[key] = flush(*x)
    return _cache[key]
""",
}


def test_draw_calls_is_a_pure_function_of_the_seed(defn):
    axes = axes_for(defn, 1)
    index, variants = timing.draw_calls(30, 32, 2048, 7, op, axes, mix_parts=True)
    again, variants_again = timing.draw_calls(30, 32, 2048, 7, op, axes, mix_parts=True)
    other, _ = timing.draw_calls(30, 32, 2048, 8, op, axes, mix_parts=True)
    assert torch.equal(index, again) and all(torch.equal(variants[k], variants_again[k]) for k in variants)
    assert not torch.equal(index, other)
    assert index.shape == (30, len(op.PROGRAM_PARTS), 32) and int(index.max()) < 2048
    rows = index.reshape(-1, 32)
    assert all(len(set(row.tolist())) == 32 for row in rows)                  # no program twice in a call's part
    assert len({tuple(row.tolist()) for row in rows}) == len(rows)             # a different draw every call and part
    assert sorted(variants) == ["perm_k", "perm_v", "sign_k", "sign_v"]
    assert variants["perm_v"].shape == (30, len(op.PROGRAM_PARTS), axes["value_dim"])   # one for each part of a call
    # the parts share the key axis's (pcum, in the window, stays on its checkpoint columns), not the value axis's
    assert torch.equal(variants["perm_k"][:, 0], variants["perm_k"][:, 1])
    assert not torch.equal(variants["perm_v"][:, 0], variants["perm_v"][:, 1])


def test_a_timed_program_mixes_parts_of_two_pool_programs(defn):
    """In a family of independent parts, call k's checkpoint and window come from the pool programs index[k, 0] and
    index[k, 1], in every batched input of the definition (the parts cover them all, each once), so the state a
    timed program rebuilds exists in no pool program."""
    axes = axes_for(defn, 1)
    batched, _ = runner.program_layout(defn)
    assert sorted(timing.program_parts(op, batched)) == sorted(batched)
    assert timing.mixes_parts(op, "random")
    pool = {k: timing.flat_programs(v, 2) if k in batched else v
            for k, v in op.make_inputs("random", axes_for(defn, 4), 5).items()}
    index, variants = timing.draw_calls(3, 32, 128, 9, op, axes, mix_parts=True)
    x = timing.call_inputs(op, pool, set(batched), (1, 32), index, variants, 2,
                           timing.parts_movable(op, pool, batched, mix_parts=True))
    for name in batched:
        part = next(i for i, group in enumerate(op.PROGRAM_PARTS) if name in group)
        # the part's symmetry with its signs left out: the magnitudes of its inputs are those of its part's programs
        v = {**{n: p[2, part] for n, p in variants.items()}, "sign_v": torch.ones_like(variants["sign_v"][2, part]),
             "sign_k": torch.ones_like(variants["sign_k"][2, part])}
        taken = {k: (t.index_select(0, index[2, part]).reshape(1, 32, *t.shape[1:]) if k in batched else t)
                 for k, t in pool.items()}
        assert torch.equal(x[name].abs(), op.apply_variant(taken, v)[name].abs()), name
    assert not torch.equal(index[:, 0], index[:, 1])
    with pytest.raises(ValueError, match="PROGRAM_PARTS"):
        timing.program_parts(op, [*batched, "extra"])
    whole, _ = timing.draw_calls(3, 32, 128, 9, op, axes, mix_parts=False)
    assert torch.equal(whole[:, 0], index[:, 0]) and torch.equal(whole[:, 1], whole[:, 0])


@pytest.mark.parametrize("family", [f for f in op.FAMILIES if f not in op.INDEPENDENT_PARTS_FAMILIES])
def test_a_timed_state_is_no_pool_programs_state_moved(defn, family):
    """In a family whose timed programs take both parts from one pool program, the state a timed program rebuilds
    is still not that program's state under a symmetry (whose singular values it would share): the checkpoint and
    the window are moved apart, so the state cannot be rebuilt from the pool before the schedule."""
    axes = axes_for(defn, 1)
    batched, _ = runner.program_layout(defn)
    pool = {k: timing.flat_programs(v, 2) if k in batched else v
            for k, v in op.make_inputs(family, axes_for(defn, 2), 5).items()}
    index, variants = timing.draw_calls(2, 32, 64, 9, op, axes, mix_parts=timing.mixes_parts(op, family))
    assert torch.equal(index[:, 0], index[:, 1])
    movable = timing.parts_movable(op, pool, batched, mix_parts=False)
    x = timing.call_inputs(op, pool, set(batched), (1, 32), index, variants, 1, movable)
    movable = movable.index_select(0, index[1, 0])
    source = {k: (t.index_select(0, index[1, 0]).reshape(1, 32, *t.shape[1:]) if k in batched else t)
              for k, t in pool.items()}
    timed, ahead = (torch.linalg.svdvals(op.exact_state(y)) for y in (x, source))
    ckpt, window = (op.exact_state(part).norm(dim=(-2, -1)) for part in (
        {**source, "w": torch.zeros_like(source["w"])},
        {**source, "codes": torch.zeros_like(source["codes"]), "u": torch.zeros_like(source["u"])}))
    both = (torch.minimum(ckpt, window) > 1e-2 * torch.maximum(ckpt, window)).flatten()   # two parts of a size
    moved = ((timed - ahead).abs().amax(-1) > 1e-3 * ahead.amax(-1)).flatten()
    assert int((both & movable).sum()) >= 8 and bool(moved[both & movable].all()), (both, movable, moved)
    assert not moved[~movable].any()        # heads near the domain's edge: their parts move together


@pytest.mark.parametrize("family", op.FAMILIES)
def test_timed_programs_stay_where_the_family_puts_its_states(defn, family):
    """Timed programs are programs of the workload's family: their states (the largest entry of each head, exactly
    rebuilt) lie where the family's own lie, as far as the domain's bounds go. Mixing the parts of a family that
    scales its heads into the domain as a whole (stress) made heads whose state lay below 2^-20, on which the
    reference itself returned non-finite values (H200, timed calls at B = 16 and 256)."""
    batch = 16
    w = next(w for w in load_workloads(defn, PROJECT.workload_file(defn)) if w.family == family)
    programs = runner.Programs(defn, dataclasses.replace(w, axes={**w.axes, "batch_size": batch}), 5, "cpu", 1024)
    axes = defn.resolve_axes({**w.axes, "batch_size": batch})
    index, variants = timing.draw_calls(4, programs.n_programs, programs.pool_programs, 11, op, axes,
                                        mix_parts=timing.mixes_parts(op, family))
    whole = op.exact_state(programs.first()).abs().amax((-2, -1)).flatten()
    timed = op.exact_state(programs.calls(op, index, variants, programs.movable(op, timing.mixes_parts(op, family)),
                                          0, 4))
    timed = timed.abs().amax((-2, -1)).flatten()

    def outside(largest):       # share of heads above |S| = 1e4, or not zero and wholly below 2^-20
        return float(((largest >= 1e4) | ((largest > 0) & (largest < 2.0 ** -20))).double().mean())
    assert outside(timed) <= outside(whole) + 0.5 / len(whole), (outside(timed), outside(whole))
    assert float(timed.max()) <= max(float(whole.max()), 1e4)


@pytest.mark.parametrize("family", op.FAMILIES)
def test_symmetry_maps_the_state_exactly_and_changes_the_outputs(defn, family):
    """The state of the transformed inputs is D_v P_v S P_k D_k, and the reference's outputs are not a rearrangement
    of the untransformed ones (q0 stays fixed), so a timed call cannot be answered from another's outputs."""
    axes = axes_for(defn, 1)
    x = op.make_inputs(family, axes, 11)
    _, variants = timing.draw_calls(1, 32, 32, 3, op, axes, mix_parts=False)
    v = {k: p[0, 0] for k, p in variants.items()}
    y = op.apply_variant(x, v)
    assert all(y[k].dtype == x[k].dtype and y[k].shape == x[k].shape for k in x)
    s, sy = op.exact_state(x), op.exact_state(y)
    moved = s[..., v["perm_v"], :][..., v["perm_k"]] * v["sign_v"].double()[:, None] * v["sign_k"].double()
    assert torch.allclose(moved, sy, rtol=1e-12, atol=1e-12 * float(s.abs().max()))
    reference = defn.reference_run()
    u, uy = reference(**x)[3], reference(**y)[3]
    moved_u = u.index_select(-1, v["perm_k"]) * v["sign_k"].to(u.dtype)
    assert not torch.equal(moved_u, uy)


def test_clock_disagreement():
    honest = [1.0] * 50
    assert timing.clock_disagreement(honest, wall_ms=60.0 + timing.CLOCK_SLACK_MS, null_wall_ms=10.0) is None
    assert "outside the timed region" in timing.clock_disagreement([0.1] * 50, wall_ms=60.0, null_wall_ms=10.0)
    front_loaded = [45.0] + [0.1] * 49                                          # the sum is right, the median is not
    assert timing.clock_disagreement(front_loaded, wall_ms=60.0, null_wall_ms=10.0) is not None
    # the null loop's own calls (0.2 ms each) are part of what its wall time subtracted
    assert timing.clock_disagreement(honest, wall_ms=50.0 + timing.CLOCK_SLACK_MS, null_wall_ms=10.0,
                                     null_call_ms=0.2) is None
    assert timing.clock_disagreement([0.85] * 50, wall_ms=50.0 + timing.CLOCK_SLACK_MS, null_wall_ms=10.0,
                                     null_call_ms=0.2) is not None


def test_every_recorded_honest_loop_passes_the_clock_check():
    """The check's constants against every timed loop the committed traces hold (honest kernels, several GPUs): a
    tightening that would refuse one of them fails here rather than on the next GPU run."""
    loops = [(t.evaluation.performance.latency_ms, t.evaluation.performance.clock)
             for path in sorted(PROJECT.traces.glob("*/*.jsonl")) for t in read_traces(path)
             if t.evaluation.performance is not None and t.evaluation.performance.clock]
    assert len(loops) >= 100
    for median, clock in loops:
        refused = timing.clock_disagreement([median] * clock["timed_calls"], clock["wall_ms"], clock["null_wall_ms"],
                                            clock["null_call_ms"])
        assert refused is None, refused


@pytest.fixture
def cpu_timing(monkeypatch) -> Settings:
    """The CPU's timed path: a short loop, a copy rate set rather than measured, and a tolerance for a shared 2-core
    machine (the attacks below miss by far more)."""
    monkeypatch.setattr(timing, "CLOCK_TOLERANCE", 0.5)
    return Settings(timeout_s=120, min_calls=12, max_calls=12, pool_programs=256, bandwidth=1e12)


def _timed_on_cpu(defn, tmp_path, name, code, settings: Settings, dps=False, family="random"):
    make_solution(tmp_path, name, code, dps=dps)
    workloads = select(load_workloads(defn, PROJECT.workload_file(defn)), [1], [family])
    return runner.evaluate(defn, load_solution(name, defn, tmp_path), workloads, "cpu", root=PROJECT.root,
                           settings=settings, timed=True, failures=tmp_path / "kept")


@pytest.mark.parametrize("family", ["random", "edge"])       # parts of two pool programs; one's, moved apart
def test_honest_solution_passes_the_cpu_timed_path(defn, tmp_path, cpu_timing, family):
    [r] = _timed_on_cpu(defn, tmp_path, "honest", HONEST, cpu_timing, family=family)
    assert r.status == runner.PASSED, r.log
    assert r.latency_ms > 0 and r.clock["timed_calls"] == 12 and r.fresh_seed is not None


OUTSIDE_EVENTS = {runner.RUNTIME_ERROR: ("outside the timed region",)}
# work that outlives the reply: unwritten outputs judged, or the words the harness reads twice caught changing (which
# of the two depends on how far the late work got before the kill)
LATE = {runner.INCORRECT_NUMERICAL: ("timed calls",), runner.RUNTIME_ERROR: ("changed after its reply",)}


@pytest.mark.parametrize("cheat, outcomes", [
    ("poison_hook", OUTSIDE_EVENTS),
    ("front_loads", OUTSIDE_EVENTS),
    ("forges_clock", OUTSIDE_EVENTS),
    ("replays_by_buffer", {runner.INCORRECT_NUMERICAL: ("timed calls", "fresh inputs")}),
    # the symmetry keeps q0 fixed, so a permuted output of the untransformed program is worse than the reference's
    # on ~40% of heads (and not on any head for a real flush)
    ("undoes_symmetry", {runner.INCORRECT_NUMERICAL: ("timed calls",)}),
    ("rebuilds_state_ahead", {runner.INCORRECT_NUMERICAL: ("timed calls",)}),
    ("late_outputs", LATE),
    ("late_outputs_from_a_child", LATE),
    ("junk_loop_clock", {runner.RUNTIME_ERROR: ("no valid latencies",)}),
])
def test_timing_attack_loses_on_cpu(defn, tmp_path, cpu_timing, cheat, outcomes):
    [r] = _timed_on_cpu(defn, tmp_path, cheat, CHEATS[cheat], cpu_timing)
    assert r.status in outcomes and any(m in r.log for m in outcomes[r.status]), (r.status, r.log)


def test_a_refusal_stands_only_when_every_timed_loop_disagrees_with_the_clock(defn, tmp_path, cpu_timing,
                                                                              monkeypatch):
    """A hiccup of the harness's own clock on one loop is timed again on calls of their own (and recorded); a
    disagreement on every loop is refused."""
    check = timing.clock_disagreement
    hiccups = iter(["a hiccup"])
    monkeypatch.setattr(timing, "clock_disagreement", lambda *a, **k: next(hiccups, None) or check(*a, **k))
    [r] = _timed_on_cpu(defn, tmp_path, "honest", HONEST, cpu_timing)
    assert r.status == runner.PASSED and r.clock["refused_loops"] == ["a hiccup"], (r.status, r.log)
    [r] = _timed_on_cpu(defn, tmp_path, "honest_one_loop", HONEST, cpu_timing.replace(clock_attempts=1))
    assert r.status == runner.PASSED and r.clock["refused_loops"] == [], (r.status, r.log)
    monkeypatch.setattr(timing, "clock_disagreement", lambda *a, **k: "disagrees")
    [r] = _timed_on_cpu(defn, tmp_path, "honest_refused", HONEST, cpu_timing)
    assert r.status == runner.RUNTIME_ERROR and r.log == "timing refused (2 loops): disagrees", (r.status, r.log)


def test_the_state_cannot_be_rebuilt_ahead_where_both_parts_come_from_one_program(defn, tmp_path, cpu_timing):
    """edge's timed programs take checkpoint and window from one pool program; moved by two symmetries, they still
    rebuild a state that the pool did not hold (with one symmetry a call, this cheat passed)."""
    [r] = _timed_on_cpu(defn, tmp_path, "ahead", CHEATS["rebuilds_state_ahead"], cpu_timing, family="edge")
    assert r.status == runner.INCORRECT_NUMERICAL and "timed calls" in r.log, (r.status, r.log)


def test_a_solution_named_null_is_timed_like_any_other(defn, tmp_path, cpu_timing, monkeypatch):
    """A solution called `null` shares nothing with the harness's null loop (which runs in the harness's process,
    with no home): when that loop ran in a sandboxed worker, such a solution deleted the worker's home as a stale home
    of its own, and the next null worker's sandbox did not start."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    [first] = _timed_on_cpu(defn, tmp_path / "a", "honest", HONEST, cpu_timing)
    [named] = _timed_on_cpu(defn, tmp_path / "b", "null", HONEST, cpu_timing)
    [again] = _timed_on_cpu(defn, tmp_path / "c", "honest", HONEST, cpu_timing)
    assert [r.status for r in (first, named, again)] == [runner.PASSED] * 3, [first.log, named.log, again.log]

# destination-passing: writes its outputs while the harness judges it and warms the loop up, then leaves them as
# they are (the timed loop fills no outputs inside the call: its preparation poisons them beforehand)
LAZY_DPS = """
from flush import run as flush
_calls = []


def run(*x):
    _calls.append(1)
    if len(_calls) <= 16:
        for out, value in zip(x[-5:], flush(*x[:-5])):
            out.copy_(value)
"""


def test_destination_passing_outputs_left_unwritten_in_the_timed_loop_fail(defn, tmp_path, cpu_timing):
    [r] = _timed_on_cpu(defn, tmp_path, "lazy_dps", LAZY_DPS, cpu_timing, dps=True)
    assert r.status == runner.INCORRECT_NUMERICAL and "timed calls" in r.log, (r.status, r.log)
    # with the run seed, the schedule seed rebuilds the calls on this device; the failing element's inputs are kept
    # as a workload that harness.run replays on any machine
    kept = re.search(r"\(schedule seed \d+; element \d+'s inputs in (\S+\.safetensors), replay: python -m "
                     r"harness\.run --solution lazy_dps --workloads (\S+\.jsonl)\)$", r.log)
    assert kept, r.log
    inputs = load_file(kept.group(1))
    assert set(inputs) == set(defn.inputs) and inputs["codes"].shape[0] == 1 and inputs["q0"].shape == (128, 4)
    [line] = load_workloads(defn, kept.group(2))
    assert (line.family, line.axes) == ("random", {"batch_size": 1})
    assert all(torch.equal(inputs[k], v) for k, v in load_inputs(defn, line, root=PROJECT.root).items())
    [replayed] = runner.evaluate(defn, load_solution("lazy_dps", defn, tmp_path), [line], "cpu", root=PROJECT.root)
    assert replayed.status == runner.PASSED, replayed.log      # lazy only in a timed loop: its untimed call is honest


@pytest.fixture(scope="module")
def gpu_workloads(defn):
    return select(load_workloads(defn, PROJECT.workload_file(defn)), [1, 16], ["random", "edge"])


@gpu
def test_honest_solution_timed_above_the_floor(defn, gpu_workloads):
    for r in runner.evaluate(defn, load_solution("torch_v1", defn, PROJECT.solutions), gpu_workloads, "cuda",
                             root=PROJECT.root):
        assert r.status == runner.PASSED, r.log
        assert r.floor_ms < r.latency_ms < 1e3


SIDE_STREAM = """
import torch
from flush import run as flush
_side = []


def run(*x):
    if not _side:
        _side.append(torch.cuda.Stream())
    with torch.cuda.stream(_side[0]):
        return flush(*x)
"""


@gpu
@pytest.mark.parametrize("cheat, messages", [      # front-loading needs Python between replays: CPU only
    # the hook's work lands in the captured preparation: the clock refuses it, or the capture fails on it
    ("poison_hook", ("outside the timed region", "not CUDA-graph capturable")),
    ("forges_clock", ("outside the timed region",)),
    ("replays_by_buffer", ("timed calls", "fresh inputs")),
    ("side_stream", ("not CUDA-graph capturable",)),
])
def test_timing_attack_loses_on_gpu(defn, gpu_workloads, tmp_path, cheat, messages):
    make_solution(tmp_path, cheat, SIDE_STREAM if cheat == "side_stream" else CHEATS[cheat])
    results = runner.evaluate(defn, load_solution(cheat, defn, tmp_path), gpu_workloads, "cuda", root=PROJECT.root)
    assert all(r.status != runner.PASSED and any(m in r.log for m in messages) for r in results), \
        [(r.status, r.log) for r in results]



# an honest loop, then GPU work left queued at the reply: a second of spinning, then every lent output zeroed
LATE_GPU_WRITES = """
import torch
import harness.timing as timing
from flush import run as flush
_run = timing.TimedLoop.run


def _late(self, seed):
    out = _run(self, seed)
    lent = self.slots[0][0]
    whole = torch.empty(0, dtype=torch.uint8, device=lent.device).set_(lent.untyped_storage())
    torch.cuda._sleep(2_000_000_000)
    whole.zero_()
    return out


timing.TimedLoop.run = _late


def run(*x):
    return flush(*x)
"""


@gpu
def test_gpu_work_left_running_at_the_reply_never_reaches_the_judge(defn, gpu_workloads, tmp_path):
    """Killing the worker does not stop kernels it queued. Their writes land before the harness's first read of the
    outputs (inside the clock: the zeroed outputs are judged), after it (refused as changed), or never (the driver's
    teardown of the worker's context cuts them)."""
    make_solution(tmp_path, "late_gpu_writes", LATE_GPU_WRITES)
    results = runner.evaluate(defn, load_solution("late_gpu_writes", defn, tmp_path), gpu_workloads[:1], "cuda",
                              root=PROJECT.root)
    assert all(r.status == runner.PASSED or "changed after its reply" in r.log
               or (r.status == runner.INCORRECT_NUMERICAL and "timed calls" in r.log) for r in results), \
        [(r.status, r.log) for r in results]


def test_gpu_process_check_leaves_out_the_harness_and_its_workers():
    """NVML's list of processes on the GPU includes the harness and its workers; only others are reported."""
    import subprocess
    import sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        own = timing._own_processes()
        assert os.getpid() in own and child.pid in own and 1 not in own
    finally:
        child.kill()
        child.wait()
