"""The deployment form (OPERATOR.md, "Deployment form"): the operator's `Pool` layout, and each solution's
`pool.py::flush_inplace` against its own `run` (bit for bit), what must stay untouched, the window reset and idx's
contract. triton_v1 runs on the GPU when there is one, else on the CPU through the Triton interpreter (small: 48
programs flushed); cuda_v1 needs the GPU. GPU only: more families, CUDA-graph capture and replay."""
import pytest
import torch

from conftest import axes_for
from harness.ops import leapquant_kda_flush as op
from harness.ops.leapquant_kda_flush import Pool, check_idx
from harness.solutions import load_entry, load_module, load_solution

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CHECKPOINT = ("codes", "s_k", "s_v", "u", "q")
WINDOW = ("kbuf", "ubuf", "gbuf", "w", "pcum")
SOLUTIONS = [pytest.param("triton_v1"), pytest.param("cuda_v1", marks=gpu)]


@pytest.fixture(scope="module", params=SOLUTIONS)
def solution(request, defn):
    """pool.py's flush_inplace and the entry point `run`, loaded as users load them."""
    sol = load_solution(request.param, defn)
    return load_module(sol, "pool.py").flush_inplace, load_entry(sol, defn)


def _idx(*slots):
    return torch.tensor(slots, dtype=torch.int32, device=DEVICE)


def _fill(pool, x, slots):
    """Sequence n of the inputs x into slot slots[n], its window full."""
    pool.write(slots, **{k: x[k] for k in CHECKPOINT + WINDOW})
    pool.count[slots] = 16


def _snapshot(pool):
    return {"buffer": pool.buffer.clone(), "count": pool.count.clone(), **{k: getattr(pool, k).clone() for k in WINDOW}}


@pytest.fixture(scope="module")
def flushed(defn, solution):
    """A 4-slot pool: every byte random first, then edge inputs of 2 sequences in slots 3 and 1, slot 2 full but not
    in idx, slot 0 (reserved) full, slot 1's odd heads one token short; flushed once with idx [3, 0, 1]."""
    flush_inplace, run = solution
    pool = Pool(4, DEVICE)
    gen = torch.Generator().manual_seed(7)
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8, generator=gen))
    axes = axes_for(defn, 2)
    x = op.make_inputs("edge", axes, 11, DEVICE)
    _fill(pool, x, [3, 1])
    pool.write([2, 0], **{k: x[k] for k in WINDOW})
    pool.count[[0, 2]] = 16
    pool.count[1, 1::2] = 15
    before = _snapshot(pool)
    flush_inplace(pool, _idx(3, 0, 1), x["q0"])
    seq0 = run({k: v[:1] if k != "q0" else v for k, v in x.items()}, axes_for(defn, 1))
    # the whole sequence (a solution may serve only the definition's 32 heads); its even heads are the due ones
    seq1_even = [t[:, 0::2] for t in run({k: v[1:2] if k != "q0" else v for k, v in x.items()}, axes_for(defn, 1))]
    due = torch.zeros(4, 32, dtype=torch.bool, device=DEVICE)
    due[3] = True
    due[1, 0::2] = True
    yield {"flush_inplace": flush_inplace, "pool": pool, "before": before, "due": due, "seq0": seq0,
           "seq1_even": seq1_even}


def test_layout_matches_the_published_engine_layout():
    assert (op.POOL_HEADER, op.POOL_REGION, op.POOL_REGIONS_PER_SLOT, op.CHECKPOINT_BYTES) == (49_152, 65_536, 33,
                                                                                               19_456)
    pool = Pool(3, "cpu")
    assert pool.buffer.numel() == 49_152 + 3 * 33 * 65_536
    base = pool.buffer.data_ptr()
    for slot, head in ((0, 0), (1, 5), (2, 31)):
        region = 49_152 + (33 * slot + head) * 65_536
        assert pool.codes[slot, head].data_ptr() - base == region
        assert pool.regions[slot, head].data_ptr() - base == region
        assert pool.s_k[slot, head].data_ptr() - base == region + 16_384
        assert pool.s_v[slot, head].data_ptr() - base == region + 16_896
        for r in range(4):                                  # fp16 rows u | q, 256 values (512 bytes) each
            assert pool.u[slot, head, r].data_ptr() - base == region + 17_408 + 512 * r
            assert pool.q[slot, head, r].data_ptr() - base == region + 17_408 + 512 * r + 256
    pool.codes[2, 31, 127, 127] = -5                        # the last byte of the last region's codes
    assert pool.regions[2, 31, 16_383].view(torch.int8) == -5
    pool.q[1, 2, 3, 127] = 1.5                              # the last byte pair of a checkpoint
    assert pool.regions[1, 2, 19_454:19_456].view(torch.float16) == 1.5
    assert (pool.s_k == 1e-12).all() and (pool.s_v == 1e-12).all()
    assert (pool.gbuf == 1).all() and (pool.w == 0).all() and (pool.pcum == 0).all() and (pool.count == 0).all()


def test_checkpoint_in_place_equals_run_bit_for_bit(flushed):
    pool = flushed["pool"]
    for name, expected0, expected1 in zip(CHECKPOINT, flushed["seq0"], flushed["seq1_even"]):
        assert torch.equal(getattr(pool, name)[3], expected0[0]), name
        assert torch.equal(getattr(pool, name)[1, 0::2], expected1[0]), name


def test_only_due_checkpoints_change(flushed):
    pool, before, due = flushed["pool"], flushed["before"], flushed["due"]
    regions_before = before["buffer"][49_152:].view(4, 33, 65_536)
    changed = (pool.regions != regions_before).any(-1)                       # [slot, 33 regions]
    assert changed[:, :32][due].all()                                        # every due checkpoint was rewritten
    assert not changed[:, :32][~due].any()                                   # idx 0, slot 0, slot 2, short windows
    assert not changed[:, 32].any()                                          # the spare region of every slot


def test_bytes_outside_the_checkpoints_unchanged(flushed):
    pool, before = flushed["pool"], flushed["before"]
    assert torch.equal(pool.buffer[:49_152], before["buffer"][:49_152])
    regions_before = before["buffer"][49_152:].view(4, 33, 65_536)
    assert torch.equal(pool.regions[:, :, 19_456:], regions_before[:, :, 19_456:])


def test_window_reset_of_due_programs_only(flushed):
    pool, before, due = flushed["pool"], flushed["before"], flushed["due"]
    assert (pool.w[due] == 0).all() and (pool.pcum[due] == 0).all() and (pool.gbuf[due] == 1).all()
    assert (before["w"][due] != 0).any() and (before["pcum"][due] != 0).any()   # the reset did something
    for name in WINDOW:
        assert torch.equal(getattr(pool, name)[~due], before[name][~due]), name
    for name in ("kbuf", "ubuf"):
        assert torch.equal(getattr(pool, name), before[name]), name
    assert torch.equal(pool.count, before["count"])                             # the counter stays at 16


def test_idx_contract_checked_in_one_line(flushed):
    flush_inplace, pool = flushed["flush_inplace"], flushed["pool"]
    q0 = torch.zeros(128, 4, device=DEVICE)
    flush, idx = lambda p, i: flush_inplace(p, i, q0), _idx
    bad = [
        (check_idx, idx(1, 4), "slot 4, outside [0, 4)"),
        (check_idx, idx(-1), "slot -1, outside [0, 4)"),
        (check_idx, idx(2, 0, 2), "slot 2 more than once"),
        (check_idx, idx(1, 2).long(), "int32 tensor of slots, got torch.int64"),
        (flush, idx(1, 2)[None], "1-D int32 tensor of slots, got torch.int32 [1, 2]"),
        (flush, idx(1, 0, 2)[::2], "contiguous"),
        (flush, [1, 2], "got list"),
        (lambda p, i: flush_inplace(p, i, q0.double()), idx(1), "q0 must be a contiguous float32 [128, 4]"),
    ]
    for fn, value, message in bad:
        with pytest.raises(ValueError) as err:
            fn(pool, value)
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    check_idx(pool, idx(0, 3, 0, 1, 2))                                            # 0 repeats: no sequence


def test_slots_out_of_range_or_not_full_write_nothing(flushed):
    """A broken contract (slots out of range) and a call where nothing is due leave every byte as it was."""
    flush_inplace, pool = flushed["flush_inplace"], flushed["pool"]
    q0 = torch.zeros(128, 4, device=DEVICE)
    saved_count = pool.count.clone()
    try:
        for count, slots in ((16, [4, -3, 2**31 - 1]), (15, [1, 2, 3])):
            pool.count.fill_(count)
            before = _snapshot(pool)
            flush_inplace(pool, _idx(*slots), q0)
            after = _snapshot(pool)
            for name in before:
                assert torch.equal(after[name], before[name]), (slots, name)
    finally:
        pool.count.copy_(saved_count)


# --------------------------------------------------------------------------------------------------- GPU only
def _run_per_slot(run, x, axes):
    return dict(zip(CHECKPOINT, run(x, axes)))


@gpu
@pytest.mark.parametrize("family", ["random", "trajectory"])
def test_gpu_in_place_equals_run_bit_for_bit(defn, solution, family):
    flush_inplace, run = solution
    axes = axes_for(defn, 2)
    x = op.make_inputs(family, axes, 5, "cuda")
    pool = Pool(3, "cuda")
    _fill(pool, x, [2, 1])
    flush_inplace(pool, torch.tensor([2, 1], dtype=torch.int32, device="cuda"), x["q0"])
    expected = _run_per_slot(run, x, axes)
    for name in CHECKPOINT:
        assert torch.equal(getattr(pool, name)[[2, 1]], expected[name]), name
    assert (pool.w[1:] == 0).all() and (pool.pcum[1:] == 0).all() and (pool.gbuf[1:] == 1).all()


@gpu
def test_gpu_graph_capture_and_replay_with_new_contents(defn, solution):
    from harness import timing
    flush_inplace, run = solution
    axes = axes_for(defn, 2)
    first, second = (op.make_inputs(f, axes, 9, "cuda") for f in ("random", "trajectory"))
    pool = Pool(4, "cuda")
    idx = torch.tensor([3, 1], dtype=torch.int32, device="cuda")
    q0 = first["q0"].clone()
    _fill(pool, first, [3, 1])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        flush_inplace(pool, idx, q0)              # warm-up: compiles
    torch.cuda.synchronize()
    _fill(pool, first, [3, 1])
    graph, _ = timing.capture(lambda: flush_inplace(pool, idx, q0), stream)
    torch.cuda.synchronize()
    assert (pool.count[[3, 1]] == 16).all() and (pool.w[[3, 1]] != 0).any()   # capture ran nothing
    for x, slots in ((first, [3, 1]), (second, [2, 3])):
        _fill(pool, x, slots)
        idx.copy_(torch.tensor(slots, dtype=torch.int32))
        q0.copy_(x["q0"])
        graph.replay()
        torch.cuda.synchronize()
        expected = _run_per_slot(run, x, axes)
        for name in CHECKPOINT:
            assert torch.equal(getattr(pool, name)[slots], expected[name]), name
        assert (pool.w[slots] == 0).all()
    pool.count.fill_(15)                                   # none due: the replay changes nothing
    _fill(pool, first, [1, 2])
    pool.count.fill_(15)
    before = pool.buffer.clone(), pool.w.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(pool.buffer, before[0]) and torch.equal(pool.w, before[1])
