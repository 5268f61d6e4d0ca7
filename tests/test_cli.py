"""The command line (harness/cli.py, harness/__main__.py): `python -m harness --help` lists every command, the input
families with their batch sizes and the exit codes; every command and flag has its help; empty and zero batch lists
are refused in one line; a run ends with a one-line summary; and every command keeps the exit-code convention (0 ok,
1 a solution failed, 2 bad usage or input)."""
import argparse
import ast
import subprocess
import sys

import pytest

from conftest import ROOT, make_solution
from harness import __main__ as harness_main, cli, gen_workloads, run
from harness.runner import Result
from harness.workloads import Workload

COMMANDS = list(harness_main.COMMANDS)


def _python(*args, timeout=300, cwd=ROOT):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _exit(argv, capsys):
    """(exit code, stdout, stderr) of `python -m harness ARGV`, in this process."""
    with pytest.raises(SystemExit) as e:
        harness_main.main(argv)
    out, err = capsys.readouterr()
    return e.value.code, out, err


def test_top_level_help_lists_every_command_the_families_and_the_exit_codes():
    done = _python("-m", "harness", "--help")
    assert done.returncode == 0, done.stderr
    listed = done.stdout.split("commands:")[1]
    for command, (_, summary) in harness_main.COMMANDS.items():
        assert f"    {command} " in listed or f"    {command}\n" in listed, command
    assert "input families and their batch sizes" in done.stdout
    assert "  edge " in done.stdout and "1, 2, 16, 32, 64, 128, 256, 512" in done.stdout
    assert "  stress " in done.stdout and "1, 16, 64, 256" in done.stdout
    assert "exit codes:" in done.stdout and "  0  ok" in done.stdout and "  1  a solution failed" in done.stdout
    assert "  2  bad usage or input" in done.stdout


def test_no_command_is_a_usage_error_in_one_line():
    done = _python("-m", "harness")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "COMMAND" in done.stderr, done.stderr


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_its_exit_codes(command, capsys):
    code, out, _ = _exit([command, "--help"], capsys)
    assert code == 0
    assert out.startswith(f"usage: python -m harness {command} ") and "exit codes:" in out, out
    module = __import__(harness_main.COMMANDS[command][0], fromlist=["main"])
    with pytest.raises(SystemExit) as e:                       # the module's own entry point: the same parser
        module.main(["--help"])
    assert e.value.code == 0
    own = capsys.readouterr().out
    assert own.startswith(f"usage: python -m {module.__name__} ")
    assert own.split("\n\n", 1)[1] == out.split("\n\n", 1)[1]


@pytest.mark.parametrize("tool", ["run", "stalls", "sass"])
def test_profile_tools_have_help(tool, capsys):
    code, out, _ = _exit(["profile", tool, "--help"], capsys)
    assert code == 0 and out.startswith(f"usage: python -m harness profile {tool} ") and "exit codes:" in out


def _actions(parser, where):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _actions(sub, f"{where} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield where, action


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_has_help(command):
    missing = [f"{where}: {action.option_strings or action.dest}"
               for where, action in _actions(harness_main.parser(command), "harness")
               if not (action.help or "").strip()]
    assert not missing


def test_shared_flags_are_spelled_and_explained_the_same_everywhere():
    """A flag two commands take has one spelling, metavar and (where not told otherwise) type and choices."""
    seen = {}
    for command in COMMANDS:
        for where, action in _actions(harness_main.parser(command), command):
            for flag in action.option_strings:
                seen.setdefault(flag, []).append((where, action))
    for flag in ("--device", "--batch-sizes", "--families", "--definition", "--solution", "--timeout", "--traces"):
        actions = [a for _, a in seen[flag]]
        assert len(actions) >= 2, flag
        assert len({a.metavar for a in actions}) == 1, (flag, [(w, a.metavar) for w, a in seen[flag]])
        assert len({a.type for a in actions}) == 1, flag
        assert len({tuple(a.choices or ()) for a in actions}) == 1, flag
    assert {a.choices for _, a in seen["--device"]} == {("auto", "cuda", "cpu")}
    assert {a.type for _, a in seen["--batch-sizes"]} == {cli.batch_size_list}


@pytest.mark.parametrize("command", ["run", "deploy", "export", "gen-workloads"])
@pytest.mark.parametrize("value", ["", "0", "64,0", "1,,2", "-1", "x"])
def test_empty_or_zero_batch_lists_are_refused_in_one_line(command, value, capsys, tmp_path):
    argv = {"run": ["run"], "deploy": ["deploy", "--solution", "triton_v1"], "export": ["export", str(tmp_path)],
            "gen-workloads": ["gen-workloads"]}[command]
    code, out, err = _exit([*argv, f"--batch-sizes={value}"], capsys)
    assert code == 2 and not out
    assert err.count("\n") == 1 and "error: argument --batch-sizes: " in err, err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("argv", [["run", "--families="], ["run", "--families", "edge,"], ["stress", "--solution", "x",
                                  "--batch-size", "0"], ["drift", "--solution", "x", "--windows", "0"],
                                  ["run", "--timeout", "0"], ["run", "--device", "gpu"]])
def test_other_bad_values_are_refused_in_one_line(argv, capsys):
    code, out, err = _exit(argv, capsys)
    assert code == 2 and not out and err.count("\n") == 1 and f"python -m harness {argv[0]}: error: " in err, err


def test_comma_lists():
    assert cli.batch_size_list("1, 64,256") == (1, 64, 256)
    assert cli.family_list("edge,random") == ("edge", "random")
    for bad in ("", " ", "0", "1,0", "1,", ",1", "1.5", "one"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli.batch_size_list(bad)


def test_summary_line():
    w = Workload("d", "u", {"batch_size": 1}, {}, "edge", 1, "")
    results = [Result("a", w, "PASSED"), Result("a", w, "PASSED"), Result("b", w, "INCORRECT_NUMERICAL"),
               Result("b", w, "PASSED"), Result("c", w, "TIMEOUT"), Result("c", w, "RUNTIME_ERROR")]
    assert run.summary(results, [], 2) == "3 solutions x 2 workloads: 3 PASSED, 1 INCORRECT_NUMERICAL, " \
                                          "1 RUNTIME_ERROR, 1 TIMEOUT"
    assert run.summary(results[:1], [("broken", "not valid JSON")], 1) == "2 solutions x 1 workload: 1 PASSED, " \
                                                                         "1 COMPILE_ERROR"
    assert run.summary([], [], 4) == "0 solutions x 4 workloads: nothing run"


def test_run_ends_with_the_summary_and_exits_0_or_1(tmp_project, capsys):
    make_solution(tmp_project.solutions, "broken", "def run(*x):\n    raise RuntimeError('kaput')\n")
    make_solution(tmp_project.solutions, "fine",
                  "from flush import run as flush\n\ndef run(*x):\n    return flush(*x)\n")
    flags = ["--device", "cpu", "--batch-sizes", "1", "--families", "edge,random", "--no-traces",
             "--project", str(tmp_project.root)]
    assert harness_main.main(["run", "--solution", "fine", *flags]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "1 solution x 2 workloads: 2 PASSED"
    assert harness_main.main(["run", "--solution", "fine", "--solution", "broken", *flags]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "2 solutions x 2 workloads: 2 PASSED, 2 RUNTIME_ERROR"


def test_bad_input_exits_2_in_one_line_from_every_command(tmp_path, monkeypatch, capsys):
    def never(*args, **kwargs):
        raise AssertionError("gen-workloads wrote workloads on bad input")
    monkeypatch.setattr(gen_workloads, "make_workload", never)
    monkeypatch.setattr(gen_workloads, "save_workloads", never)
    cases = [
        (["run", "--solution", "nope", "--device", "cpu", "--no-traces"], "no such solution"),
        (["stress", "--solution", "nope", "--device", "cpu", "--no-database"], "no such solution"),
        (["drift", "--solution", "nope", "--device", "cpu"], "no such solution"),
        (["deploy", "--solution", "nope", "--device", "cpu"], "no such solution"),
        (["new", "Bad-Name", "--language", "python", "--solutions", str(tmp_path)], "is not a solution name"),
        (["export", str(tmp_path / "out"), "--no-blobs", "--batch-sizes", "3"], "no workload with batch_size=3"),
        (["gen-workloads", "--families", "gaussian"], "unknown input family 'gaussian'"),
        (["gen-workloads", "--definition", "other"], "no definition named 'other'"),
        (["profile", "run", "--solution", "nope"], "no such solution"),
        (["profile", "sass", str(tmp_path / "missing.cubin")], "error: "),
    ]
    for argv, message in cases:
        assert harness_main.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and message in err, (argv, err)


def test_module_entry_points_keep_working():
    done = _python("-m", "harness.run", "--solution", "nope", "--device", "cpu", "--no-traces")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "no such solution" in done.stderr, done.stderr
    done = _python("-m", "harness", "run", "--batch-sizes", "0")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "at least 1" in done.stderr, done.stderr


def test_commands_find_the_project_from_any_folder(tmp_path):
    """Run from a folder outside any project, a command reads the checkout's project (its solutions are known);
    --project names another, and a folder that is not one is bad input in one line."""
    done = _python("-m", "harness", "run", "--solution", "nope", "--device", "cpu", "--no-traces", cwd=tmp_path)
    assert done.returncode == 2 and "known: reference, " in done.stderr and "torch_v1" in done.stderr, done.stderr
    assert str(ROOT / "solutions") in done.stderr
    done = _python("-m", "harness", "run", "--solution", "torch_v1", "--project", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "not a project" in done.stderr, done.stderr


def test_console_script_is_the_command_line():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["harness"].partition(":")
    assert (module, function) == ("harness.__main__", "main")
    assert getattr(__import__(module, fromlist=[function]), function) is harness_main.main


def test_scripts_edit_no_path_and_import_no_private_names():
    """Scripts and commands import the harness as a package (no sys.path edits), and no module imports a private
    name of another (the shared helpers are public, in harness/cli.py)."""
    commands = {ROOT / (module.replace(".", "/") + ".py") for module, _ in harness_main.COMMANDS.values()}
    commands |= {ROOT / "harness" / "cli.py", ROOT / "harness" / "__main__.py"}
    for path in sorted((ROOT / "scripts").glob("*.py")) + sorted((ROOT / "harness").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if path.parent.name == "scripts" or path in commands:
                assert not (isinstance(node, ast.Attribute) and node.attr == "path"
                            and getattr(node.value, "id", "") == "sys"), f"{path.relative_to(ROOT)}:{node.lineno}"
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("harness"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.relative_to(ROOT)}:{node.lineno}: imports {private}"
    for moved in ("bench_deploy.py", "gen_workloads.py", "ncu_profile.py"):
        assert not (ROOT / "scripts" / moved).exists(), moved


def test_a_cell_cannot_end_its_row_or_add_columns():
    forged = "slow\n| cuda_v1 | PASSED |\r\x1b[2K\u2028"
    assert "\n" not in cli.cell(forged) and "\x1b" not in cli.cell(forged) and "\u2028" not in cli.cell(forged)
    rows = cli.table([[forged, "1"]], ["solution", "B"], "github").splitlines()
    assert len(rows) == 3 and rows[2].count("|") - rows[2].count("\\|") == 3      # two cells, escaped pipes
