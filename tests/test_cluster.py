"""harness.run --ray (harness/cluster.py) on a local Ray instance on the CPU: the jobs run as Ray tasks, one CPU each,
and give the verdicts a local run gives; a cluster that cannot be reached is one line."""
import pytest

from conftest import make_solution
from harness import run

ray = pytest.importorskip("ray", reason="Ray is the [cluster] extra: pip install -e \".[cluster]\"")

FINE = "from flush import run as flush\n\ndef run(*x):\n    return flush(*x)\n"


def _rows(out: str, name: str) -> list[list[str]]:
    return [line.split()[:5] for line in out.splitlines() if line.startswith(f"{name} ")][-4:]


def test_ray_jobs_give_the_verdicts_of_a_local_run(tmp_project, capsys):
    make_solution(tmp_project.solutions, "fine", FINE)
    make_solution(tmp_project.solutions, "broken", "def run(*x):\n    raise RuntimeError('kaput')\n")
    flags = ["--solution", "fine", "--solution", "broken", "--batch-sizes", "1", "--families", "edge,random",
             "--no-traces", "--run-seed", "5", "--project", str(tmp_project.root)]
    assert run.main(flags + ["--device", "cpu"]) == 1
    local = capsys.readouterr().out
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert run.main(flags + ["--ray", "auto"]) == 1
    finally:
        ray.shutdown()
    clustered = capsys.readouterr().out
    assert "on a Ray cluster (2 x cpu)" in clustered, clustered
    for name in ("fine", "broken"):
        assert _rows(local, name) == _rows(clustered, name) and _rows(local, name), (local, clustered)
    assert {row[3] for row in _rows(clustered, "fine")} == {"PASSED"}
    assert {row[3] for row in _rows(clustered, "broken")} == {"RUNTIME_ERROR"}


def test_an_unreachable_cluster_is_one_line(capsys):
    assert run.main(["--solution", "torch_v1", "--ray", "127.0.0.1:1", "--no-traces"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --ray 127.0.0.1:1: ") and err.count("\n") == 1, err
