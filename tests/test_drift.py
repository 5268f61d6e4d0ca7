"""The multi-window drift check as users run it."""
import json

from conftest import make_solution
from harness import drift


def test_torch_v1_does_not_drift(capsys):
    assert drift.main(["--solution", "torch_v1", "--windows", "16", "--batch-size", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "window  15:" in out and "worst window" in out


def test_coarser_codes_drift_and_fail(tmp_project, capsys):
    make_solution(tmp_project.solutions, "coarse", "from flush import run as flush\n\n\ndef run(*x):\n"
                  "    codes, *rest = flush(*x)\n    return (codes // 4 * 4, *rest)\n")
    assert drift.main(["--solution", "coarse", "--windows", "4", "--batch-size", "1", "--device", "cpu",
                       "--project", str(tmp_project.root)]) == 1
    assert "limit 1.01" in capsys.readouterr().out


def test_unknown_solution_one_line(capsys):
    assert drift.main(["--solution", "nope", "--windows", "2", "--device", "cpu"]) == 2
    assert "no such solution" in capsys.readouterr().err


def test_record_writes_the_table(tmp_path, capsys):
    assert drift.main(["--solution", "torch_v1", "--windows", "2", "--batch-size", "1", "--device", "cpu",
                       "--record", "--traces", str(tmp_path)]) == 0
    path = tmp_path / "leapquant_kda_flush_r4_int8_h32_v128_k128" / "drift_torch_v1.json"
    record = json.loads(path.read_text())
    assert [r["window"] for r in record["rows"]] == [0, 1] and record["windows"] == 2
    assert record["worst"] == max(record["rows"], key=lambda r: r["ratio"]) and record["limit"] == 1.01
    assert len(record["solution_sha256"]) == 64 and record["environment"]["hardware"].startswith("CPU")
