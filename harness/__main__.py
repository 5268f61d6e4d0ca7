"""python -m harness COMMAND [flags]: the harness's command line, one argparse subcommand per task. Each command is
also its module's own entry point (`python -m harness.run ...` is `python -m harness run ...`), and `harness` once
the package is installed (pip install -e .)."""
from __future__ import annotations

import argparse
import importlib
import sys
import textwrap
from pathlib import Path

from harness import cli

# command -> (module, one line for the list); a module has add_arguments(parser) and execute(args)
COMMANDS = {
    "run": ("harness.run", "judge (and on a GPU time) solutions on the definition's workloads; one table"),
    "stress": ("harness.stress", "search the grammar of degenerate inputs for inputs a solution gets wrong"),
    "drift": ("harness.drift", "feed each flush's checkpoint back for many windows; accuracy against the reference"),
    "deploy": ("harness.deploy_bench", "judge and time a solution's deployment form (pool.py) in its worker"),
    "report": ("harness.report", "rebuild LEADERBOARD.md and leaderboard.png from traces/ (--check: is it current)"),
    "export": ("harness.export", "write the repository as a self-contained FlashInfer-bench dataset"),
    "new": ("harness.new", "write a new solution folder that passes as it stands"),
    "gen-workloads": ("harness.gen_workloads", "(re)write the definition's workload lines and blobs"),
    "profile": ("harness.profile", "Nsight Compute helpers: run a solution for ncu, stalls by source line, SASS"),
}


def _epilog() -> str:
    return "\n\n".join([
        textwrap.fill("Flags that several commands take are spelled and mean the same in each: --solution NAME, "
                      "--definition NAME, --device auto|cuda|cpu, --batch-sizes B,B,... (each at least 1; an empty "
                      "list is refused), --families F,F,..., --timeout S, --traces DIR. `python -m harness COMMAND "
                      "--help` lists a command's flags.", 100),
        cli.catalogue(),
        cli.exit_codes("a solution failed (a workload not PASSED, a failure found, a window over the limit, a "
                       "deployment case failing its check; report --check: LEADERBOARD.md is stale)")])


def parser(command: str | None = None, prog: str = "python -m harness") -> argparse.ArgumentParser:
    """The command line's parser. Only `command`'s module is imported and given its flags (the others are listed
    with their one line), so that a command does not load what the others need."""
    p = cli.Parser(prog=prog, description=cli.description(__doc__), epilog=_epilog)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True, title="commands")
    for name, (module, summary) in COMMANDS.items():
        s = sub.add_parser(name, help=summary, description=summary)
        if name == command:
            mod = importlib.import_module(module)
            mod.add_arguments(s)
            s.set_defaults(execute=mod.execute)
    return p


def main(argv=None) -> int:
    prog = "python -m harness"
    if argv is None:
        argv = sys.argv[1:]
        if Path(sys.argv[0]).name == "harness":        # the console script
            prog = "harness"
    argv = list(argv)
    command = argv[0] if argv and argv[0] in COMMANDS else None
    args = parser(command, prog).parse_args(argv)
    return args.execute(args)


if __name__ == "__main__":
    sys.exit(main())
