"""harness/profile.py's stall attribution (`python -m harness profile`): SASS rows of an ncu source page mapped to
source lines through the cubin's line table (two tiny kernels compiled here with -lineinfo stand in for profiled ones;
a cubin may hold several kernels, and the profile picks its own by length)."""
import csv
import re
import shutil
import subprocess

import pytest

from harness import profile as ncu_profile

KERNEL = """extern "C" __global__ void k(float* x) {
  x[threadIdx.x] = x[threadIdx.x] * 2.0f;
  x[threadIdx.x + 32] += 1.0f;
}
extern "C" __global__ void k2(float* x, int n) {
  for (int i = 0; i < n; ++i) x[threadIdx.x + 64 * i] = sqrtf(x[threadIdx.x + 64 * i]);
}
extern "C" __global__ void k3(float* x) {
  __shared__ float s[64];
  s[threadIdx.x] = x[threadIdx.x];
  __syncthreads();
  x[threadIdx.x] = s[63 - threadIdx.x];
}
"""


@pytest.fixture(scope="module")
def cubin(tmp_path_factory):
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    d = tmp_path_factory.mktemp("k")
    (d / "k.cu").write_text(KERNEL)
    subprocess.run(["nvcc", "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-lineinfo", "-O3", "-o",
                    str(d / "k.cubin"), str(d / "k.cu")], check=True)
    return d


def _source_page(path, lines, hot_line, barrier_at=None):
    """An ncu source page (csv) whose samples all fall on the instructions of hot_line, as long-scoreboard stalls;
    instruction barrier_at, if given, is a CTA barrier."""
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_long_sb",
              "stall_wait", "stall_long_sb (Not Issued)"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "k"])
        w.writerow(header)
        for i, where in enumerate(lines):
            hot = where is not None and where[1] == hot_line
            sass = "BAR.SYNC.DEFER_BLOCKING 0x0" if i == barrier_at else "NOP"
            w.writerow([hex(16 * i), sass, 5 if hot else 0, 32, 5 if hot else 0, 0, 0])


def test_samples_land_on_their_source_line(cubin, capsys):
    kernels = ncu_profile.source_lines(str(cubin / "k.cubin"), str(cubin / "k.cu"))
    assert set(kernels) == {"k", "k2", "k3"} and len({len(v) for v in kernels.values()}) == 3
    lines = kernels["k"]
    assert {where[1] for where in lines if where} >= {2, 3}
    _source_page(cubin / "page.csv", lines, hot_line=3)
    ncu_profile.stalls(str(cubin / "page.csv"), str(cubin / "k.cubin"), str(cubin / "k.cu"), top=3)
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("by reason: long_sb 100.0%")
    assert "100.0%" in out[2] and "x[threadIdx.x + 32] += 1.0f;" in out[2]


def test_the_profiled_kernel_is_found_among_several(cubin, capsys):
    kernels = ncu_profile.source_lines(str(cubin / "k.cubin"), str(cubin / "k.cu"))
    _source_page(cubin / "page2.csv", kernels["k2"], hot_line=6)
    ncu_profile.stalls(str(cubin / "page2.csv"), str(cubin / "k.cubin"), str(cubin / "k.cu"), top=3)
    out = capsys.readouterr().out.splitlines()
    assert "100.0%" in out[2] and "sqrtf" in out[2]


def test_samples_by_stretch_between_barriers(cubin, capsys):
    lines = ncu_profile.source_lines(str(cubin / "k.cubin"), str(cubin / "k.cu"))["k"]
    hot = [i for i, where in enumerate(lines) if where and where[1] == 3]
    barrier = hot[len(hot) // 2]                     # some of line 3's samples fall before the barrier, some after
    _source_page(cubin / "bar.csv", lines, hot_line=3, barrier_at=barrier)
    ncu_profile.stalls(str(cubin / "bar.csv"), str(cubin / "k.cubin"), str(cubin / "k.cu"), top=3)
    out = capsys.readouterr().out.splitlines()
    at = out.index("by stretch between CTA barriers (samples, instructions, first line):")
    first, second = out[at + 1].split(), out[at + 2].split()
    before = sum(i <= barrier for i in hot) / len(hot)
    assert first[0] == "0" and second[0] == "1" and len(out) > at + 3 and not out[at + 3].startswith("    2")
    assert float(first[1][:-1]) == pytest.approx(100 * before, abs=0.05)
    assert float(second[1][:-1]) == pytest.approx(100 * (1 - before), abs=0.05)
    assert float(first[2][:-1]) == pytest.approx(100 * (barrier + 1) / len(lines), abs=0.05)


def test_a_profile_of_another_kernel_is_refused(cubin):
    kernels = ncu_profile.source_lines(str(cubin / "k.cubin"), None)
    lines = kernels["k"][:-1]
    assert len(lines) != len(kernels["k2"])
    _source_page(cubin / "short.csv", lines, hot_line=3)
    with pytest.raises(ValueError, match="not the profiled kernel"):
        ncu_profile.stalls(str(cubin / "short.csv"), str(cubin / "k.cubin"), None, top=3)


def test_sass_counts_each_kernel_to_its_last_exit(cubin, capsys):
    kernels = ncu_profile.source_lines(str(cubin / "k.cubin"), None)
    ncu_profile.sass(str(cubin / "k.cubin"), top=3)
    out = capsys.readouterr().out.splitlines()
    heads = {line.split(":")[0]: line for line in out if not line.startswith("  ")}
    assert set(heads) == {"k", "k2", "k3"}
    for name, line in heads.items():
        main, after = (int(x) for x in re.search(r"(\d+) instructions to the last EXIT \((\d+) out", line).groups())
        assert main + after == len(kernels[name]) and main > 0
    assert heads["k"].endswith(" 0 CTA barriers") and heads["k3"].endswith(" 1 CTA barriers")


def test_bad_input_is_one_line(tmp_path, cubin, capsys):
    (tmp_path / "not_a_page.csv").write_text("a,b\n")
    assert ncu_profile.main(["stalls", str(tmp_path / "not_a_page.csv"), str(cubin / "k.cubin")]) == 2
    assert ncu_profile.main(["stalls", str(tmp_path / "missing.csv"), str(cubin / "k.cubin")]) == 2
    assert ncu_profile.main(["run", "--solution", "no_such_solution"]) == 2
    assert ncu_profile.main(["sass", str(tmp_path / "not_a_page.csv")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 4 and all(line.startswith("error: ") for line in err)
    assert "no 'Address' header row" in err[0] and "no such solution" in err[2]
