"""The deployment form (docs/operator.md, "Deployment form"): the operator's `Pool` layout and its argument checks, and
harness/deploy_bench.py (`python -m harness deploy`), which runs a solution's `pool.py::flush_inplace` in the
solution's sandboxed worker and judges the state the last call of each case left: triton_v1 passes on the CPU (Triton
interpreter, B = 1), planted pools that write a wrong checkpoint, touch a sequence that is not due, skip the window
reset or change a counter fail. GPU only: the timed benchmark of the committed pools, record included."""
import json
import shutil

import pytest
import torch

from conftest import PROJECT, make_solution
from harness import deploy_bench, runner
from harness.ops import leapquant_kda_flush as op
from harness.ops.leapquant_kda_flush import Pool, check_idx
from harness.solutions import load_solution, source_sha256

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


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


def test_idx_and_call_contract_checked_in_one_line():
    pool = Pool(4, "cpu")
    q0 = torch.zeros(128, 4)

    def idx(*slots):
        return torch.tensor(slots, dtype=torch.int32)

    bad = [
        (check_idx, idx(1, 4), "slot 4, outside [0, 4)"),
        (check_idx, idx(-1), "slot -1, outside [0, 4)"),
        (check_idx, idx(2, 0, 2), "slot 2 more than once"),
        (check_idx, idx(1, 2).long(), "int32 tensor of slots, got torch.int64"),
        (lambda p, i: p.check_call(i, q0), idx(1, 2)[None], "1-D int32 tensor of slots, got torch.int32 [1, 2]"),
        (lambda p, i: p.check_call(i, q0), idx(1, 0, 2)[::2], "contiguous"),
        (lambda p, i: p.check_call(i, q0), [1, 2], "got list"),
        (lambda p, i: p.check_call(i, q0.double()), idx(1), "q0 must be a contiguous float32 [128, 4]"),
    ]
    for fn, value, message in bad:
        with pytest.raises(ValueError) as err:
            fn(pool, value)
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    check_idx(pool, idx(0, 3, 0, 1, 2))                                            # 0 repeats: no sequence
    pool.check_call(idx(0, 3), q0)


# ------------------------------------------------------------------------------------- deploy_bench, in the worker
def test_triton_v1_pool_passes_the_check_on_cpu(tmp_path, capsys):
    """Three cases at B = 1 (all due, 1 in 16 due on its first call: due too, none due), one untimed call each
    through the Triton interpreter in triton_v1's worker; nothing is written."""
    code = deploy_bench.main(["--solution", "triton_v1", "--device", "cpu", "--batch-sizes", "1",
                              "--traces", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("one call, untimed: PASSED") == 3, out
    assert not any(tmp_path.iterdir())


# A deployment form in plain torch (host synchronising: CPU only), correct but for what a plant changes
POOL = '''\
import torch
from flush import run as flush

CHECKPOINT = ("codes", "s_k", "s_v", "u", "q")
INPUTS = (*CHECKPOINT, "kbuf", "ubuf", "gbuf", "w", "pcum")


def flush_inplace(pool, idx, q0):
    pool.check_call(idx, q0)
    slots = idx.long()
    due = (slots > 0) & (pool.count[slots] == pool.kbuf.shape[2]).all(-1)
    slots = slots[due]
    # PLANT: which slots
    if not slots.numel():
        return
    outputs = flush(*(getattr(pool, name)[slots] for name in INPUTS), q0)
    for name, t in zip(CHECKPOINT, outputs):
        getattr(pool, name)[slots] = t
    # PLANT: the checkpoint written
    pool.w[slots], pool.pcum[slots], pool.gbuf[slots] = 0.0, 0.0, 1.0
    # PLANT: after the window reset
'''
PLANTS = {
    "honest": ({}, None),
    "zero_codes": ({"the checkpoint written": "pool.codes[slots] = 0"},
                   "all due B=   1: one call, untimed: INCORRECT_NUMERICAL: due checkpoints: worst-head ratio"),
    "flushes_every_slot": ({"which slots": "slots = idx.long()[idx > 0]"},
                           "none due B=   1: one call, untimed: INCORRECT_NUMERICAL: sequence 0 (not due): its codes "
                           "changed"),
    "keeps_the_window": ({"after the window reset": "pool.w[slots] = 0.5"},
                         "all due B=   1: one call, untimed: INCORRECT_NUMERICAL: sequence 0 (due): its w is not "
                         "reset to 0"),
    "clears_the_counter": ({"after the window reset": "pool.count[slots] = 0"},
                           "all due B=   1: one call, untimed: INCORRECT_NUMERICAL: sequence 0: its counter changed"),
}


def plant(root, name: str, lines: dict):
    """A solution folder `name` under root: torch_v1's flush as `run`, and POOL as pool.py with `lines` put in
    place of its PLANT comments."""
    folder = make_solution(root, name, "from flush import run as flush\n\n\ndef run(*x):\n    return flush(*x)\n")
    source = POOL
    for where, line in lines.items():
        source = source.replace(f"# PLANT: {where}", line)
    (folder / "pool.py").write_text(source)
    raw = json.loads((folder / "solution.json").read_text())
    raw["sources"].append({"path": "pool.py"})
    (folder / "solution.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("name", PLANTS)
def test_planted_pool_is_judged_against_the_reference(name, tmp_project, capsys):
    lines, failure = PLANTS[name]
    plant(tmp_project.solutions, name, lines)
    code = deploy_bench.main(["--solution", name, "--device", "cpu", "--batch-sizes", "1",
                              "--project", str(tmp_project.root)])
    out = capsys.readouterr().out
    if failure is None:
        assert code == 0 and out.count("one call, untimed: PASSED") == 3, out
    else:
        assert code == 1 and failure in out, out


def test_bad_input_is_one_line_and_exit_2(capsys):
    for argv, message in ((["--solution", "torch_v1"], "torch_v1: no pool.py among its sources"),
                          (["--solution", "nonesuch"], "no such solution"),
                          (["--solution", "triton_v1", "--batch-sizes", "3"], "no workload with batch_size=3")):
        assert deploy_bench.main([*argv, "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_a_malformed_state_is_a_runtime_error(defn):
    """What the worker sends back is checked before it is judged."""
    x = op.make_inputs("random", defn.resolve_axes({"batch_size": 1}), 3)
    count = torch.full((1, 32), 16, dtype=torch.int32)
    state = {name: x[name] for name in (*op.CHECKPOINT, *op.WINDOW)} | {"count": count}
    status, log = deploy_bench.check_state(defn, op, x, count, {**state, "s_v": x["s_v"].half()})
    assert status == runner.RUNTIME_ERROR and "s_v came back as torch.float16 [1, 32, 128]" in log, log
    status, log = deploy_bench.check_state(defn, op, x, count, {k: v for k, v in state.items() if k != "pcum"})
    assert status == runner.RUNTIME_ERROR and "pcum came back as nothing" in log, log


# --------------------------------------------------------------------------------------------------- GPU only
@gpu
@pytest.mark.parametrize("name", ["triton_v1", "cuda_v1"])
def test_gpu_benchmark_writes_its_record(name, tmp_path, defn, capsys):
    code = deploy_bench.main(["--solution", name, "--batch-sizes", "1,16", "--traces", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    record = json.loads((tmp_path / defn.name / f"deploy_{name}.json").read_text())
    assert record["solution_sha256"] == source_sha256(load_solution(name, defn, PROJECT.solutions), defn)
    assert record["sandbox"] == "bwrap" or record["sandbox"].startswith("unsandboxed (")
    assert [r["case"] for r in record["rows"]] == ["all due", "all due", "1 in 16 due", "none due",
                                                   "none due, per call in a graph of 8"]
    assert all(r["checked"] and r["status"] == runner.PASSED for r in record["rows"])
    assert all(r["median_us"] > 0 for r in record["rows"][:4]) and record["empty_graph_us"] > 0


@gpu
def test_a_time_below_the_floor_is_refused(tmp_project, capsys):
    """The deployment form's times are its worker's own: one that claims less than 0.9x the memory floor is refused
    in the record and the exit code."""
    # triton_v1's deployment form (capturable, unlike POOL's masked indexing), its median forged in the worker
    folder = tmp_project.solutions / "forger"
    shutil.copytree(PROJECT.solutions / "triton_v1", folder, ignore=shutil.ignore_patterns("tools", "*.md"))
    raw = json.loads((folder / "solution.json").read_text())
    (folder / "solution.json").write_text(json.dumps({**raw, "name": "forger"}))
    with open(folder / "pool.py", "a") as f:
        f.write("\n\nimport harness.deploy as _deploy\n_run_case = _deploy.run_case\n"
                "_deploy.run_case = lambda *a: (1e-6,) + _run_case(*a)[1:]\n")
    code = deploy_bench.main(["--solution", "forger", "--batch-sizes", "16", "--project", str(tmp_project.root)])
    out = capsys.readouterr().out
    assert code == 1 and "physically impossible" in out, out
