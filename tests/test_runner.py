"""The runner on misbehaving solutions: each gets its status and a one-line log, and never stops the others."""
import pytest

from conftest import make_solution
from harness import runner
from harness.solutions import load_solution
from harness.workloads import load_workloads, select

CORRECT = "from flush import run as flush\n\n\ndef run(*x):\n    return flush(*x)\n"

BAD = {
    "raises": ("def run(*x):\n    raise ValueError('boom in the kernel')\n", runner.RUNTIME_ERROR, "ValueError: boom"),
    "does not import": ("def run(*x)\n    pass\n", runner.COMPILE_ERROR, "SyntaxError"),
    "missing function": ("def other(*x):\n    pass\n", runner.COMPILE_ERROR, "no function 'run'"),
    "dies": ("import os\n\ndef run(*x):\n    os._exit(3)\n", runner.RUNTIME_ERROR, "died"),
    "modifies input": (CORRECT.replace("return flush(*x)", "out = flush(*x)\n    x[5].mul_(2)\n    return out"),
                       runner.RUNTIME_ERROR, "modified its input 'kbuf'"),
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
    "not a tuple of tensors": ("def run(*x):\n    return 'done'\n", runner.INCORRECT_SHAPE, "returned 1 outputs"),
}


@pytest.fixture(scope="module")
def small(defn):
    return select(load_workloads(defn), [1], ["random"])


@pytest.mark.parametrize("case", BAD)
def test_bad_solution_gets_its_status(defn, small, tmp_path, case):
    code, status, log = BAD[case]
    make_solution(tmp_path, "bad", code)
    [result] = runner.evaluate(defn, load_solution("bad", defn, tmp_path), small, "cpu", timeout_s=60)
    assert result.status == status, result.log
    assert log in result.log and "\n" not in result.log and "Traceback" not in result.log


def test_hang_times_out_and_the_next_workload_still_runs(defn, tmp_path):
    marker = tmp_path / "hung_once"
    code = (f"import os, time\nfrom flush import run as flush\n\ndef run(*x):\n"
            f"    if not os.path.exists({str(marker)!r}):\n        open({str(marker)!r}, 'w').close()\n"
            f"        time.sleep(600)\n    return flush(*x)\n")
    make_solution(tmp_path, "hangs", code)
    workloads = select(load_workloads(defn), [1], ["random", "edge"])
    results = runner.evaluate(defn, load_solution("hangs", defn, tmp_path), workloads, "cpu", timeout_s=8)
    assert [r.status for r in results] == [runner.TIMEOUT, runner.PASSED]
    assert "no answer within 8 s" in results[0].log


def test_cpu_worker_runs_one_intra_op_thread(defn, small, tmp_path):
    """CPU verdicts repeat from run to run: a multi-threaded CPU matmul in a worker rounded differently in about one
    start in ten (torch_v1, edge B=1: worst-head ratio 1.0004 or 1.0443)."""
    make_solution(tmp_path, "threads", "import torch\nfrom flush import run as flush\n\ndef run(*x):\n"
                  "    assert torch.get_num_threads() == 1, f'{torch.get_num_threads()} threads'\n"
                  "    return flush(*x)\n")
    [result] = runner.evaluate(defn, load_solution("threads", defn, tmp_path), small, "cpu", timeout_s=60)
    assert result.status == runner.PASSED, result.log


def test_compile_error_loads_once(defn, tmp_path):
    make_solution(tmp_path, "broken", "raise ImportError('no such toolchain')\n")
    worker = runner.Worker(load_solution("broken", defn, tmp_path), defn, "cpu", timeout_s=60)
    assert worker.call("run", {}, {}) == (runner.COMPILE_ERROR, "ImportError: no such toolchain at main.py:1")
    spawned = worker.proc
    assert worker.call("run", {}, {})[0] == runner.COMPILE_ERROR
    assert worker.proc is spawned                    # the second workload did not spawn (and fail) again
    worker.stop()


def test_program_layout(defn):
    batched, n = runner.program_layout(defn)
    assert n == 2 and "q0" not in batched and len(batched) == 10


def test_floor_matches_operator_md(defn):
    """51,776 bytes per program (OPERATOR.md) plus q0 [V, R] fp32, read once per call."""
    axes = defn.resolve_axes({"batch_size": 64})
    nbytes = runner.floor_ms(defn, axes, bandwidth=1e3)          # at 1 kB/s a byte takes a millisecond
    assert nbytes == pytest.approx(51776 * 64 * 32 + 128 * 4 * 4)


CHEATS_ON_CPU = {
    "returns_inputs": (runner.INCORRECT_NUMERICAL, "ratio"),
    "modifies_inputs": (runner.RUNTIME_ERROR, "modified its input 'codes'"),
    "patches_timer": (runner.RUNTIME_ERROR, "the solution replaced torch.cuda.Event"),
}


@pytest.mark.parametrize("cheat", CHEATS_ON_CPU)
def test_cheat_rejected_on_cpu(defn, small, cheat):
    status, log = CHEATS_ON_CPU[cheat]
    [result] = runner.evaluate(defn, load_solution(cheat, defn, "tests/cheats"), small, "cpu", timeout_s=60)
    assert result.status == status and log in result.log, (result.status, result.log)
