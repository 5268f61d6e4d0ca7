"""The timer. CPU: the refill permutation and the tamper guard. GPU (skipped without one): honest solutions are
timed above the memory floor, and every cheat fixture is rejected."""
import pytest
import torch

from harness import runner, timing
from harness.solutions import load_solution
from harness.workloads import load_workloads, select

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def test_permuted_moves_whole_programs():
    base = {"a": torch.arange(2 * 3 * 4.0).reshape(2, 3, 4), "b": torch.arange(6.0).reshape(2, 3), "c": torch.ones(5)}
    into = {k: torch.empty_like(v) for k, v in base.items()}
    perm = torch.tensor([5, 0, 3, 1, 2, 4])
    timing.permuted(base, ("a", "b"), 2, perm, into)
    flat_a, flat_b = into["a"].reshape(6, 4), into["b"].reshape(6)
    for slot, program in enumerate(perm.tolist()):
        assert torch.equal(flat_a[slot], base["a"].reshape(6, 4)[program]) and flat_b[slot] == program


def test_tamper_guard():
    timing.guard()
    assert timing.tampered() is None
    original = torch.cuda.Event
    try:
        torch.cuda.Event = object
        assert timing.tampered() == "torch.cuda.Event"
    finally:
        torch.cuda.Event = original
    assert timing.tampered() is None


@pytest.fixture(scope="module")
def gpu_workloads(defn):
    return select(load_workloads(defn), [1, 16], ["random", "trajectory"])


@gpu
def test_honest_solution_timed_above_the_floor(defn, gpu_workloads):
    for r in runner.evaluate(defn, load_solution("torch_v1", defn), gpu_workloads, "cuda"):
        assert r.status == runner.PASSED, r.log
        assert r.floor_ms < r.latency_ms < 1e3


CHEATS_ON_GPU = {                   # a cheat that caches across workloads is caught by the untimed check as well
    "replay_by_shape": ("timed call", "ratio", "non-finite", "has shape"),
    "first_call_only": ("timed call", "ratio", "non-finite", "has shape"),
    "side_stream": ("not CUDA-graph capturable",),
    "returns_inputs": ("ratio",),
    "modifies_inputs": ("modified its input",),
    "patches_timer": ("replaced torch.cuda.Event",),
}


@gpu
@pytest.mark.parametrize("cheat", CHEATS_ON_GPU)
def test_cheat_rejected_on_gpu(defn, gpu_workloads, cheat):
    results = runner.evaluate(defn, load_solution(cheat, defn, "tests/cheats"), gpu_workloads, "cuda")
    assert all(r.status != runner.PASSED for r in results), [(r.status, r.log) for r in results]
    assert all(any(m in r.log for m in CHEATS_ON_GPU[cheat]) for r in results), [r.log for r in results]


def test_schedule_is_the_parents_and_reproducible():
    perms, samples = timing.schedule(64, seed=5)
    assert len(perms) == timing.WARMUP_CALLS + timing.TIMED_CALLS and len(samples) == timing.TIMED_CALLS
    assert all(torch.equal(p.sort().values, torch.arange(64)) for p in perms)
    assert len({tuple(p.tolist()) for p in perms}) == len(perms)          # a fresh permutation every call
    again, _ = timing.schedule(64, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(perms, again))
