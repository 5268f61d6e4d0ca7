"""python -m harness.new NAME --language python|triton|cuda [--author WHO] [--definition NAME]: write a new solution
folder, solutions/NAME/, that passes as it stands: the definition's reference math in the language's simplest form
(python: the reference itself; triton and cuda: the state's rebuild as a kernel and the rest in torch, from the
operator's templates in harness/ops/<op_type>/templates/<language>/, described by <language>.md beside it), its
solution.json and a NOTES.md to fill in.
Then `python -m harness.run --solution NAME`. Exits 2 on bad input (an existing folder, a bad name, no template)."""
from __future__ import annotations

import argparse
import getpass
import json
import re
import sys
from pathlib import Path

from harness import HarnessError, cli
from harness.definition import Definition, project_definition
from harness.records import LANGUAGES
from harness.solutions import load_solution

OPS = Path(__file__).resolve().parent / "ops"
ENTRY_FILES = {"python": "flush.py", "triton": "kernel.py", "cuda": "main.py"}
HARDWARE = {"python": ["CPU", "NVIDIA_H200"], "triton": ["NVIDIA_H200"], "cuda": ["NVIDIA_H200"]}
DEPENDENCIES = {"python": ["torch >= 2.11"], "triton": ["torch >= 2.11", "triton >= 3.6"],
                "cuda": ["torch >= 2.11", "ninja"]}
NOTES = """# {name}: notes

## Status
A new {language} solution written by `python -m harness.new`: the reference's math, correct and not yet fast.
Replace this paragraph with the current version's time and ratio to the memory floor (from LEADERBOARD.md) and its
correctness state (`python -m harness.run --solution {name}`, `python -m harness.stress --solution {name}`).

## Design
{design}

## Versions
| version | commit | B = 64 | B = 256 | B = 512 | x floor at 64 / 512 | what changed | predicted | measured |
| --- | --- | --- | --- | --- | --- | --- | --- | --- |
| 1 | | | | | | the skeleton | | |

## Measured and not kept
Nothing yet.
"""
PYTHON_DESIGN = "The definition's reference code as it stands (`flush.py`)."


def write_solution(defn: Definition, name: str, language: str, author: str, root: str | Path) -> Path:
    """Write root/<name>/ (root: a project's solutions/) for `language` and return the folder."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or name == "reference":
        raise HarnessError(f"{name!r} is not a solution name: lower case letters, digits and _, not 'reference'")
    if language not in LANGUAGES:
        raise HarnessError(f"unknown language {language!r} (one of {', '.join(LANGUAGES)})")
    folder = Path(root) / name
    if folder.exists():
        raise HarnessError(f"{folder} exists already")
    if language == "python":
        files = {"flush.py": f'"""{name}: the definition\'s reference, as a starting point."""\n' + defn.reference}
        design = PYTHON_DESIGN
    else:
        templates = OPS / defn.op_type / "templates" / language
        if not templates.is_dir():
            raise HarnessError(f"no {language} template for op_type {defn.op_type!r} ({templates})")
        files = {p.name: p.read_text().replace("{name}", name) for p in sorted(templates.iterdir()) if p.is_file()}
        design = templates.with_suffix(".md").read_text().strip()
    entry = ENTRY_FILES[language]
    folder.mkdir(parents=True)
    for path, text in files.items():
        (folder / path).write_text(text)
    sources = [entry] + sorted(p for p in files if p != entry)
    (folder / "solution.json").write_text(json.dumps({
        "name": name, "definition": defn.name, "author": author,
        "description": f"{language}: the reference's math in its simplest form (a starting point)",
        "spec": {"language": language, "target_hardware": HARDWARE[language], "entry_point": f"{entry}::run",
                 "destination_passing_style": False, "dependencies": DEPENDENCIES[language]},
        "sources": [{"path": p} for p in sources]}, indent=2) + "\n")
    (folder / "NOTES.md").write_text(NOTES.format(name=name, language=language, design=design))
    load_solution(name, defn, root)     # what was written parses
    return folder


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = cli.description(__doc__)
    p.epilog = cli.epilog(None)
    p.add_argument("name", help="the solution's name, also its folder's (lower case letters, digits and _)")
    p.add_argument("--language", choices=LANGUAGES, required=True,
                   help="python: the reference itself; triton, cuda: the state's rebuild as a kernel, the rest in "
                        "torch")
    p.add_argument("--author", default=getpass.getuser(), help="solution.json's author (default: %(default)s)")
    cli.add_definition(p)
    cli.add_solutions_dir(p)


def main(argv=None) -> int:
    return execute(cli.parse(add_arguments, "python -m harness.new", argv))


def execute(args: argparse.Namespace) -> int:
    try:
        project = cli.project_of(args)
        folder = write_solution(project_definition(project, args.definition), args.name, args.language,
                                args.author, args.solutions or project.solutions)
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {folder}: run `python -m harness.run --solution {args.name}`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
