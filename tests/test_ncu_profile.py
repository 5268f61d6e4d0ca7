"""scripts/ncu_profile.py's stall attribution: SASS rows of an ncu source page mapped to source lines through the
cubin's line table (a tiny kernel compiled here with -lineinfo stands in for a profiled one)."""
import csv
import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("ncu_profile", Path(__file__).parents[1] / "scripts" / "ncu_profile.py")
ncu_profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ncu_profile)

KERNEL = """__global__ void k(float* x) {
  x[threadIdx.x] = x[threadIdx.x] * 2.0f;
  x[threadIdx.x + 32] += 1.0f;
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


def _source_page(path, lines, hot_line):
    """An ncu source page (csv) whose samples all fall on the instructions of hot_line, as long-scoreboard stalls."""
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_long_sb",
              "stall_wait", "stall_long_sb (Not Issued)"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "k"])
        w.writerow(header)
        for i, where in enumerate(lines):
            hot = where is not None and where[1] == hot_line
            w.writerow([hex(16 * i), "NOP", 5 if hot else 0, 32, 5 if hot else 0, 0, 0])


def test_samples_land_on_their_source_line(cubin, capsys):
    lines = ncu_profile.source_lines(str(cubin / "k.cubin"), str(cubin / "k.cu"))
    assert {where[1] for where in lines if where} >= {2, 3}
    _source_page(cubin / "page.csv", lines, hot_line=3)
    ncu_profile.stalls(str(cubin / "page.csv"), str(cubin / "k.cubin"), str(cubin / "k.cu"), top=3)
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("by reason: long_sb 100.0%")
    assert "100.0%" in out[2] and "x[threadIdx.x + 32] += 1.0f;" in out[2]


def test_a_profile_of_another_kernel_is_refused(cubin):
    lines = ncu_profile.source_lines(str(cubin / "k.cubin"), None)
    _source_page(cubin / "short.csv", lines[:-1], hot_line=3)
    with pytest.raises(ValueError, match="not the profiled kernel"):
        ncu_profile.stalls(str(cubin / "short.csv"), str(cubin / "k.cubin"), None, top=3)


def test_bad_input_is_one_line(tmp_path, cubin, capsys):
    (tmp_path / "not_a_page.csv").write_text("a,b\n")
    assert ncu_profile.main(["stalls", str(tmp_path / "not_a_page.csv"), str(cubin / "k.cubin")]) == 2
    assert ncu_profile.main(["stalls", str(tmp_path / "missing.csv"), str(cubin / "k.cubin")]) == 2
    assert ncu_profile.main(["run", "--solution", "no_such_solution"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)
    assert "no 'Address' header row" in err[0] and "no such solution" in err[2]
