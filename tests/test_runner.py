"""The runner on misbehaving solutions: each gets its status and a one-line log, and never stops the others."""
import json
import mmap
import time

import pytest
import torch

from conftest import PROJECT, make_solution
from harness import runner
from harness.project import Settings
from harness.solutions import load_entry, load_solution
from harness.ops import load_op
from harness.workloads import load_inputs, load_workloads, select

CORRECT = "from flush import run as flush\n\n\ndef run(*x):\n    return flush(*x)\n"

BAD = {
    "raises": ("def run(*x):\n    raise ValueError('boom in the kernel')\n", runner.RUNTIME_ERROR, "ValueError: boom"),
    "does not import": ("def run(*x)\n    pass\n", runner.COMPILE_ERROR, "SyntaxError"),
    "missing function": ("def other(*x):\n    pass\n", runner.COMPILE_ERROR, "no function 'run'"),
    "dies": ("import os\n\ndef run(*x):\n    os._exit(3)\n", runner.RUNTIME_ERROR, "died"),
    "modifies input": (CORRECT.replace("return flush(*x)", "out = flush(*x)\n    x[5].mul_(2)\n    return out"),
                       runner.RUNTIME_ERROR, "modified its input 'kbuf'"),
    # the check of its inputs cannot be switched off from inside: the harness compares the memory it lent
    "modifies input and hides it": ("import torch\nfrom flush import run as flush\ntorch.equal = lambda a, b: True\n\n"
                                    "def run(*x):\n    out = flush(*x)\n    x[10].zero_()\n    return out\n",
                                    runner.RUNTIME_ERROR, "modified its input 'q0'"),
    "returns its inputs": ("def run(codes, s_k, s_v, u, q, *rest):\n    return codes, s_k, s_v, u, q\n",
                           runner.INCORRECT_NUMERICAL, "ratio"),
    "wrong dtype": (CORRECT.replace("return flush(*x)", "o = flush(*x)\n    return (o[0].short(),) + o[1:]"),
                    runner.INCORRECT_DTYPE, "codes_new is torch.int16"),
    "wrong shape": (CORRECT.replace("return flush(*x)", "o = flush(*x)\n    return (o[0][:, :8],) + o[1:]"),
                    runner.INCORRECT_SHAPE, "codes_new has shape"),
    "too few outputs": (CORRECT.replace("return flush(*x)", "return flush(*x)[:4]"),
                        runner.INCORRECT_SHAPE, "returned 4 outputs"),
    "tokens swapped": (CORRECT.replace("return flush(*x)", "o = flush(*x)\n    return o[:3] + (o[4], o[3])"),
                       runner.INCORRECT_NUMERICAL, "ratio"),
    "zeros": ("import torch\nfrom flush import run as flush\n\ndef run(*x):\n"
              "    return tuple(torch.zeros_like(t) for t in flush(*x))\n", runner.INCORRECT_NUMERICAL, ""),
    "returns its input": (CORRECT.replace("return flush(*x)", "o = flush(*x)\n    return (x[0],) + o[1:]"),
                          runner.INCORRECT_NUMERICAL, ""),
    "terminal escapes in its message": ("def run(*x):\n    raise ValueError('\\x1b[2K\\x1b[G  PASSED \\x1b[8m')\n",
                                        runner.RUNTIME_ERROR, "ValueError: [2K [G PASSED [8m"),
    "not a tuple of tensors": ("def run(*x):\n    return 'done'\n", runner.INCORRECT_SHAPE, "returned 1 outputs"),
}


def evaluate(defn, sol, workloads, timeout_s: float, **kwargs):
    """runner.evaluate on the CPU, on the project's workloads, with a timeout per call."""
    return runner.evaluate(defn, sol, workloads, "cpu", root=PROJECT.root, settings=Settings(timeout_s=timeout_s),
                           **kwargs)


@pytest.fixture(scope="module")
def small(defn):
    return select(load_workloads(defn, PROJECT.workload_file(defn)), [1], ["random"])



def test_a_worker_that_ends_at_its_start_is_a_compile_error(defn, small, tmp_path):
    sol = load_solution("torch_v1", defn, PROJECT.solutions)
    worker = runner.Worker(sol, defn, "cpu", 30, [PROJECT.root])
    worker.box._prefix = [*worker.box._prefix[:1], "--die-with-parent", "--", "/bin/sh", "-c", "echo gone; exit 3",
                          "--"] if worker.box.sandboxed else ["/bin/sh", "-c", "echo gone; exit 3", "--"]
    try:
        status, log, _ = worker.request({"op": "stop"}, None, "nothing", 0)
    finally:
        worker.close()
    assert status == runner.COMPILE_ERROR and "\n" not in log, log

@pytest.mark.parametrize("case", BAD)
def test_bad_solution_gets_its_status(defn, small, tmp_path, case):
    code, status, log = BAD[case]
    make_solution(tmp_path, "bad", code)
    [result] = evaluate(defn, load_solution("bad", defn, tmp_path), small, timeout_s=60)
    assert result.status == status, result.log
    assert log in result.log and "\n" not in result.log and "Traceback" not in result.log


def test_hang_times_out_and_ends_the_solutions_run(defn, tmp_path, monkeypatch):
    """The first timeout stops the solution: its other workloads are reported without costing a timeout each;
    with keep_going the worker is started again and they run. (The marker lives in the solution's home, the one
    place it may write that outlives its worker.)"""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code = ("import os, time\nfrom flush import run as flush\n\ndef run(*x):\n"
            "    marker = os.path.expanduser('~/hung_once')\n"
            "    if not os.path.exists(marker):\n        open(marker, 'w').close()\n"
            "        time.sleep(600)\n    return flush(*x)\n")
    make_solution(tmp_path, "hangs", code)
    workloads = select(load_workloads(defn, PROJECT.workload_file(defn)), [1], ["random", "edge"])
    sol = load_solution("hangs", defn, tmp_path)
    start = time.monotonic()
    results = evaluate(defn, sol, workloads, timeout_s=8)
    assert time.monotonic() - start < 40
    assert [r.status for r in results] == [runner.TIMEOUT, runner.TIMEOUT]
    assert "no answer within 8 s" in results[0].log
    assert results[1].log.startswith("not run: the worker was stopped on edge batch_size=1")
    [marker] = (tmp_path / "cache").rglob("hung_once")
    marker.unlink()
    kept = evaluate(defn, sol, workloads, timeout_s=8, keep_going=True)
    assert [r.status for r in kept] == [runner.TIMEOUT, runner.PASSED], kept[1].log


def test_cpu_worker_runs_one_intra_op_thread(defn, small, tmp_path):
    """CPU verdicts repeat from run to run: a multi-threaded CPU matmul in a worker rounded differently in about one
    start in ten (torch_v1, edge B=1: worst-head ratio 1.0004 or 1.0443)."""
    make_solution(tmp_path, "threads", "import torch\nfrom flush import run as flush\n\ndef run(*x):\n"
                  "    assert torch.get_num_threads() == 1, f'{torch.get_num_threads()} threads'\n"
                  "    return flush(*x)\n")
    [result] = evaluate(defn, load_solution("threads", defn, tmp_path), small, timeout_s=60)
    assert result.status == runner.PASSED, result.log


def test_compile_error_loads_once(defn, tmp_path):
    make_solution(tmp_path, "broken", "raise ImportError('no such toolchain')\n")
    worker = runner.Worker(load_solution("broken", defn, tmp_path), defn, "cpu", timeout_s=60, hide=[])
    assert worker.request({"op": "run", "axes": {}}, None, "running", 0) == \
        (runner.COMPILE_ERROR, "ImportError: no such toolchain at main.py:1", None)
    assert worker.request({"op": "run", "axes": {}}, None, "running", 0)[0] == runner.COMPILE_ERROR
    assert worker.proc is None                      # the second workload did not start (and fail) again
    worker.close()


def test_every_workload_is_also_judged_on_fresh_inputs(defn, small, tmp_path):
    """A table of the committed workloads' answers passes them and nothing else: the fresh draw catches it."""
    from harness.workloads import load_inputs
    [w] = small
    inputs = load_inputs(defn, w, root=PROJECT.root)
    answers = tmp_path / "answers.pt"
    flush = load_entry(load_solution("torch_v1", defn, PROJECT.solutions), defn)
    torch.save(flush(inputs, defn.resolve_axes(w.axes)), answers)
    folder = make_solution(tmp_path, "table", "import os, torch\n\n"
                           "def run(*x):\n    return torch.load(os.path.join(os.path.dirname(__file__), "
                           "'answers.pt'))\n", copy_flush=False)
    (folder / "answers.pt").write_bytes(answers.read_bytes())
    raw = json.loads((folder / "solution.json").read_text())
    raw["sources"].append({"path": "answers.pt"})
    (folder / "solution.json").write_text(json.dumps(raw))
    [result] = evaluate(defn, load_solution("table", defn, tmp_path), small, timeout_s=60)
    assert result.status == runner.INCORRECT_NUMERICAL and result.log.startswith("fresh inputs: "), result.log
    assert result.fresh_seed is not None




class LentOutputsWriter:
    """A stand-in for a worker in the timed path that answers every request, fills the outputs it was lent in its
    loop and, when it is stopped after its reply, writes `late` over them (what GPU work it left running would do
    once the clock stopped)."""

    def __init__(self, late: bytes | None):
        self.late, self.gone, self.memory = late, True, None

    def request(self, header, tensors, what, max_bytes, lend=None):
        if lend is not None:
            self.memory = mmap.mmap(lend, header["lent_bytes"])
        if header["op"] == "time_run":
            self.memory[:] = b"\x55" * len(self.memory)        # the loop's outputs
        return "ok", {"latencies_ms": [0.1], "loop_ms": [1.0, 1.0]} if header["op"] == "time_run" else {}, None

    def stop(self, grace=True):
        if self.late is not None:
            n = len(self.memory)
            self.memory[:] = (self.late * (n // len(self.late) + 1))[:n]


@pytest.mark.parametrize("late", [None, b"\0", b"\1\2\3\4\5\6\7"])
def test_outputs_written_after_the_reply_are_refused(defn, small, late):
    axes = defn.resolve_axes(small[0].axes)
    batched, n_prefix = runner.program_layout(defn)
    pool = runner.Programs(defn, small[0], 5, "cpu", 64).pool
    worker = LentOutputsWriter(late)
    m = runner._timed_measure(defn, worker, pool, pool, axes, batched, n_prefix, 3, 1, True)
    if m.outputs is not None:
        m.outputs.close()
    if late is None:
        assert m.status == "ok"
    else:
        assert m.status == runner.RUNTIME_ERROR and "changed after its reply" in m.reply, (m.status, m.reply)

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_lent_inputs_are_written_before_the_worker_reads_them(defn):
    """The harness's copy of the inputs into the memory it lends runs on its own stream, which the worker's kernels
    do not wait for: held back behind a long kernel here, it must still be complete before the request goes out."""
    earlier, w = select(load_workloads(defn, PROJECT.workload_file(defn)), [64], ["edge", "random"])
    op, sol = load_op(defn.op_type), load_solution("torch_v1", defn, PROJECT.solutions)
    worker = runner.Worker(sol, defn, "cuda", 120, [PROJECT.root])
    try:    # started and warm, and the memory it is lent next may hold another workload's inputs
        assert runner.judge_call(defn, op, worker, load_inputs(defn, earlier, "cuda", root=PROJECT.root),
                                 earlier.axes)[0] == runner.PASSED
        inputs = load_inputs(defn, w, "cuda", root=PROJECT.root)
        torch.cuda._sleep(2_000_000_000)            # about a second of the harness's stream, before the copy
        status, log, _ = runner.judge_call(defn, op, worker, inputs, w.axes)
    finally:
        worker.close()
    assert status == runner.PASSED, log

def test_program_layout(defn):
    batched, n = runner.program_layout(defn)
    assert n == 2 and "q0" not in batched and len(batched) == 10


def test_floor_matches_operator_md(defn):
    """51,776 bytes per program (docs/operator.md) plus q0 [V, R] fp32, read once per call."""
    axes = defn.resolve_axes({"batch_size": 64})
    nbytes = runner.floor_ms(defn, axes, bandwidth=1e3)          # at 1 kB/s a byte takes a millisecond
    assert nbytes == pytest.approx(51776 * 64 * 32 + 128 * 4 * 4)




def test_the_harness_running_out_of_memory_is_that_workloads_status(defn, tmp_path, monkeypatch):
    """Generating or checking a workload's inputs in the harness's own process may not fit on a shared GPU: that
    workload gets one status line and the next ones are judged."""
    workloads = select(load_workloads(defn, PROJECT.workload_file(defn)), [1], ["random", "edge"])
    real = runner.load_inputs

    def load_inputs(defn, w, device, *, root):
        if w.family == "random":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore detail")
        return real(defn, w, device, root=root)
    monkeypatch.setattr(runner, "load_inputs", load_inputs)
    results = evaluate(defn, load_solution("torch_v1", defn, PROJECT.solutions), workloads, timeout_s=60)
    by_family = {r.workload.family: r for r in results}
    assert by_family["random"].status == runner.RUNTIME_ERROR and "\n" not in by_family["random"].log
    assert by_family["random"].log.startswith("the harness ran out of device memory on this workload: CUDA out")
    assert by_family["edge"].status == runner.PASSED
