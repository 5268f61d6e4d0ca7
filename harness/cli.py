"""The harness's command line, shared by every command (`python -m harness COMMAND`, harness/__main__.py, and each
command's own `python -m harness.<module>`): the parser class, the flags that several commands take (each spelled and
explained once, here), the comma-list parser and the exit-code convention.

A command module defines `add_arguments(parser)` (its flags, through the helpers below where it shares them, its
description and epilog) and `execute(args) -> int`; its `main(argv)` is `execute(parse(add_arguments, prog, argv))`,
and harness/__main__.py hangs the same `add_arguments` under an argparse subcommand. Nothing here imports torch until a
device is resolved, so `--help` stays quick."""
from __future__ import annotations

import argparse
import json
import textwrap
from typing import Callable

from tabulate import tabulate

from harness import HarnessError, one_line
from harness.project import Project, Settings

DEVICES = ("auto", "cuda", "cpu")

# the exit-code convention of every command
EXIT_OK = 0             # everything asked for was done and every solution passed
EXIT_FAILED = 1         # a solution failed (a workload not PASSED, a failure found, a check not met)
EXIT_USAGE = 2          # bad usage or input: arguments, definition, solution, workload file


def cell(value) -> str:
    """A table cell from anything a solution can influence (its name, an error it raised): one line (one_line), `|`
    escaped, so that it can neither end its row nor add columns to a markdown table."""
    return one_line(value).replace("|", "\\|")


def table(rows, headers, tablefmt: str = "simple") -> str:
    """rows as a table (tabulate; "github" for markdown) with every cell passed through `cell`, numbers as given."""
    return tabulate([[cell(v) for v in row] for row in rows], headers=headers, tablefmt=tablefmt,
                    disable_numparse=True)


def exit_codes(failed: str | None = "a solution failed") -> str:
    """The epilog's block on exit codes; `failed` says what exit 1 means for the command (None: it never exits 1)."""
    rows = [(EXIT_OK, "ok"), (EXIT_FAILED, failed),
            (EXIT_USAGE, "bad usage or input (arguments, definition, solution, workload file): one line on stderr")]
    return "exit codes:\n" + "\n".join(textwrap.fill(f"{code}  {meaning}", 100, initial_indent="  ",
                                                     subsequent_indent="     ") for code, meaning in rows if meaning)


class Parser(argparse.ArgumentParser):
    """argparse's parser with the harness's conventions: a usage error is one line on stderr and exit 2 (not the
    usage block), the description and epilog keep their line breaks, and an epilog may be a function, called only
    when the help is shown (so that listing the families reads no files on an ordinary run)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def format_help(self) -> str:
        if callable(self.epilog):
            self.epilog = self.epilog()
        return super().format_help()

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def parse(add_arguments: Callable[[argparse.ArgumentParser], None], prog: str, argv=None) -> argparse.Namespace:
    """A command's arguments, parsed by a Parser named `prog` that `add_arguments` filled."""
    p = Parser(prog=prog)
    add_arguments(p)
    return p.parse_args(argv)


def description(doc: str, width: int = 100) -> str:
    """A module docstring as a command's description: without its leading synopsis (`python -m harness.x ...: `),
    each paragraph filled to `width` unless it holds indented lines (examples, kept as written)."""
    text = doc.strip()
    if text.startswith("python "):
        text = text.split(": ", 1)[1] if ": " in text else text
    text = text[:1].upper() + text[1:]
    paragraphs = text.split("\n\n")
    return "\n\n".join(p if any(line[:1].isspace() for line in p.splitlines())
                       else textwrap.fill(" ".join(p.split()), width) for p in paragraphs)


# ------------------------------------------------------------------------------------------------ value parsers
def comma_list(kind: Callable = str, what: str = "name", positive: bool = False) -> Callable[[str], tuple]:
    """An argparse type: a comma-separated list of `kind` ("1,64,256"), as a tuple. An empty list, an empty item
    and (with `positive`) a value below 1 are refused."""
    def parse_list(text: str) -> tuple:
        items = [x.strip() for x in text.split(",")]
        if not text.strip():
            raise argparse.ArgumentTypeError(f"an empty list: give at least one {what}")
        if not all(items):
            raise argparse.ArgumentTypeError(f"{text!r} has an empty item: give {what}s separated by single commas")
        try:
            values = tuple(kind(x) for x in items)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {what}s") from None
        if positive and any(v < 1 for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: every {what} must be at least 1")
        return values
    parse_list.__name__ = f"{what} list"
    return parse_list


batch_size_list = comma_list(int, "batch size", positive=True)
family_list = comma_list(str, "family")


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be above 0")
    return value


# ------------------------------------------------------------------------------------------------ shared flags
def add_solution(p, many: bool = False, help: str | None = None) -> None:
    """--solution NAME: one, required; with `many`, repeatable into args.solutions, default every solution."""
    if many:
        p.add_argument("--solution", action="append", dest="solutions", metavar="NAME",
                       help=help or "solution folder name under solutions/, or 'reference'; repeat for several "
                                    "(default: every solution of the definition)")
    else:
        p.add_argument("--solution", required=True, metavar="NAME",
                       help=help or "solution folder name under solutions/, or 'reference'")


def add_solutions_dir(p) -> None:
    p.add_argument("--solutions", metavar="DIR",
                   help="the folder holding the solution folders (default: the project's solutions/)")


def add_project(p) -> None:
    """--project DIR: read back with project_of(args)."""
    p.add_argument("--project", metavar="DIR",
                   help="the project's root folder, which holds definitions/, solutions/, workloads/ and traces/ "
                        "(default: the nearest such folder at or above the working directory, else the checkout "
                        "the harness is installed from)")


def add_definition(p) -> None:
    """--project DIR and --definition NAME (default the project's only definition; required when it has several),
    read back with project_of(args) and definition.project_definition(project, args.definition)."""
    add_project(p)
    p.add_argument("--definition", metavar="NAME",
                   help="definition name, under the project's definitions/ (default: its only definition; required "
                        "when it holds several)")


def project_of(args: argparse.Namespace) -> Project:
    """The project a command works in: --project, else found (Project.find)."""
    return Project.at(args.project) if getattr(args, "project", None) else Project.find()


def add_device(p, default: str = "auto", help: str | None = None) -> None:
    p.add_argument("--device", choices=DEVICES, default=default, metavar="|".join(DEVICES),
                   help=(help or "auto: the GPU when torch sees one, else the CPU, where Triton runs through its "
                                 "interpreter")
                   + " (default: %(default)s)")


def add_batch_sizes(p, default=None, help: str | None = None) -> None:
    """--batch-sizes B,B,...: a non-empty comma list of batch sizes of at least 1."""
    p.add_argument("--batch-sizes", type=batch_size_list, default=default, metavar="B,B,...",
                   help=help or "comma-separated batch sizes (default: all)")


def add_batch_size(p, default: int, help: str | None = None) -> None:
    """--batch-size B: one batch size, at least 1 (commands that take one)."""
    p.add_argument("--batch-size", type=positive_int, default=default, metavar="B",
                   help=(help or "sequences per call") + " (default: %(default)s)")


def add_families(p, default=None, help: str | None = None) -> None:
    """--families F,F,...: a non-empty comma list of input families."""
    p.add_argument("--families", type=family_list, default=default, metavar="F,F,...",
                   help=help or "comma-separated input families (default: all)")


def add_family(p, default: str, help: str | None = None) -> None:
    """--family F: one input family (commands that take one)."""
    p.add_argument("--family", default=default, metavar="F",
                   help=(help or "the input family whose workloads give the inputs") + " (default: %(default)s)")


def add_timeout(p, help: str | None = None) -> None:
    """--timeout S: read back into the run's Settings with settings_of(args, competition)."""
    p.add_argument("--timeout", type=positive_float, metavar="S",
                   help=(help or "seconds per call before TIMEOUT")
                   + f" (default: the competition file's timeout_s, else {Settings.timeout_s:g})")


def settings_of(args: argparse.Namespace, competition) -> Settings:
    """The run's Settings: the competition's (harness.competition.load_competition), with what the command line
    set (--timeout) over it."""
    settings = competition.settings
    if getattr(args, "timeout", None) is not None:
        settings = settings.replace(timeout_s=args.timeout)
    return settings


def add_traces(p, help: str | None = None) -> None:
    """--traces DIR, default None: the command picks its default (usually the project's traces/)."""
    p.add_argument("--traces", metavar="DIR",
                   help=help or "root of the traces and records, one folder per definition (default: the project's "
                                "traces/)")


# ------------------------------------------------------------------------------------------------ helpers
def resolve_device(choice: str, cpu_note: str = "Triton through the interpreter, not timed") -> str:
    """The device `--device` names: auto is the GPU when torch sees one (else the CPU, said in one line); cuda
    without a GPU is bad input."""
    import torch

    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
        if choice == "cpu":
            print(f"no GPU found: running on CPU ({cpu_note})", flush=True)
    elif choice == "cuda" and not torch.cuda.is_available():
        raise HarnessError("--device cuda: torch sees no GPU")
    return choice


def catalogue() -> str:
    """The input families and batch sizes of the default definition's committed workloads (what --families and
    --batch-sizes choose from), for --help; read from the workload lines, nothing generated or checked."""
    try:
        project = Project.find()
    except HarnessError as e:
        return f"families and batch sizes: {e}"
    definition = project.default_definition_name()
    if definition is None:
        return f"families and batch sizes: not exactly one definition in {project.definitions}"
    paths = sorted(project.workloads.glob(f"*/{definition}.jsonl"))
    if not paths:
        return f"families and batch sizes: no workload file for {definition} in {project.workloads}"
    sizes: dict[str, set] = {}
    try:
        for line in paths[0].read_text().splitlines():
            if line.strip():
                w = json.loads(line)["workload"]
                sizes.setdefault(w["family"], set()).add(w["axes"]["batch_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"families and batch sizes: {paths[0]} does not read ({type(e).__name__}: {e})"
    width = max(map(len, sizes), default=0)
    return "\n".join([f"input families and their batch sizes (the committed workloads of {definition}):"]
                     + [f"  {family:<{width}}  {', '.join(map(str, sorted(bs)))}" for family, bs in sizes.items()])


def epilog(failed: str | None = "a solution failed", families: bool = False) -> Callable[[], str]:
    """A command's epilog, built when the help is shown: the families and batch sizes (with `families`), then the
    exit codes."""
    return lambda: "\n\n".join(([catalogue()] if families else []) + [exit_codes(failed)])
