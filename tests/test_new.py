"""harness.new: the folder it writes passes as it stands (python and triton judged on CPU, cuda compiled for
sm_90a), and bad input is one line."""
import json
import shutil
import subprocess

import pytest

from harness import new, run
from harness.solutions import load_solution


@pytest.mark.parametrize("language", ["python", "triton"])
def test_new_solution_passes_on_cpu(defn, tmp_project, capsys, language):
    project = ["--project", str(tmp_project.root)]
    assert new.main(["mine", "--language", language, *project]) == 0       # into the project's solutions/
    root = tmp_project.solutions
    sol = load_solution("mine", defn, root)
    assert sol.language == language and (root / "mine" / "NOTES.md").exists()
    code = run.main(["--solution", "mine", "--device", "cpu", "--batch-sizes", "1", "--no-traces", *project])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = [line.split() for line in out.splitlines() if line.startswith("mine ")]
    assert len(rows) == 5 and all(r[3] == "PASSED" for r in rows), out      # every family at B = 1


def test_new_cuda_solution_compiles_for_sm90a(defn, tmp_path):
    root = tmp_path / "solutions"
    folder = new.write_solution(defn, "mine", "cuda", "tests", root)
    assert json.loads((folder / "solution.json").read_text())["spec"]["entry_point"] == "main.py::run"
    nvcc = shutil.which("nvcc") or shutil.which("nvcc", path="/usr/local/cuda/bin")
    if nvcc is None:
        pytest.skip("nvcc not found on PATH: the compile check needs the CUDA toolkit")
    res = subprocess.run([nvcc, "-c", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-I", str(folder),
                          str(folder / "rebuild.cu"), "-o", str(tmp_path / "rebuild.o")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("args, message", [
    (["Bad-Name", "--language", "python"], "is not a solution name"),
    (["reference", "--language", "python"], "is not a solution name"),
    (["taken", "--language", "python"], "exists already"),
])
def test_bad_input_is_one_line(tmp_path, capsys, args, message):
    (tmp_path / "taken").mkdir()
    assert new.main(args + ["--solutions", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
