"""The multi-window drift check as users run it."""
from conftest import make_solution
from harness import drift
from harness.solutions import load_solution


def test_torch_v1_does_not_drift(capsys):
    assert drift.main(["--solution", "torch_v1", "--windows", "16", "--batch-size", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "window  15:" in out and "worst window" in out


def test_coarser_codes_drift_and_fail(tmp_path, monkeypatch, capsys):
    root = tmp_path / "solutions"
    make_solution(root, "coarse", "from flush import run as flush\n\n\ndef run(*x):\n"
                  "    codes, *rest = flush(*x)\n    return (codes // 4 * 4, *rest)\n")
    monkeypatch.setattr(drift, "load_solution", lambda n, d: load_solution(n, d, root))
    assert drift.main(["--solution", "coarse", "--windows", "4", "--batch-size", "1", "--device", "cpu"]) == 1
    assert "limit 1.01" in capsys.readouterr().out


def test_unknown_solution_one_line(capsys):
    assert drift.main(["--solution", "nope", "--windows", "2", "--device", "cpu"]) == 2
    assert "no such solution" in capsys.readouterr().err
