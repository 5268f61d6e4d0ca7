"""A solution as it was at a git revision, as a solution folder of its own beside the current one, so that one
harness call judges and times both (an A/B in one device call, on the same GPU and the same workloads):

    python scripts/solution_at.py 9958253 cuda_v1          # writes solutions/cuda_v1_9958253/, prints its name
    python -m harness.run --device cuda --no-traces --solution cuda_v1_9958253 --solution cuda_v1 ...
    rm -r solutions/cuda_v1_9958253

The copy holds the solution's files at that revision, its solution.json renamed to the folder's name (the harness
requires the two to agree). It needs the repository's git history, so make the copy in a clone before moving the
working tree to a GPU machine without one; the folder is untracked: delete it afterwards.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git(*args: str) -> bytes:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True)
    if done.returncode:
        why = (done.stderr.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
        raise ValueError(f"git {' '.join(args)}: {why}")
    return done.stdout


def solution_at(rev: str, solution: str, name: str | None = None, root: Path = ROOT / "solutions") -> Path:
    """Writes solution `solution` as of `rev` to root/<name> (default <solution>_<rev>) and returns that folder."""
    commit = git("rev-parse", "--short", f"{rev}^{{commit}}").decode().strip()
    name = name or f"{solution}_{commit}"
    dest = root / name
    if dest.exists():
        raise ValueError(f"{dest} exists already: remove it or pass --name")
    prefix = f"solutions/{solution}/"
    files = [f for f in git("ls-tree", "-r", "--name-only", commit, "--", prefix).decode().splitlines() if f]
    if f"{prefix}solution.json" not in files:
        raise ValueError(f"revision {commit} has no {prefix}solution.json")
    for path in files:
        target = dest / path[len(prefix):]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(git("show", f"{commit}:{path}"))
    spec = json.loads((dest / "solution.json").read_text())
    spec["name"] = name
    (dest / "solution.json").write_text(json.dumps(spec, indent=2) + "\n")
    return dest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="exit codes: 0 written (its name printed); 2 bad usage or input (a revision, a "
                                        "solution or a folder name), one line on stderr")
    ap.add_argument("rev", help="a git revision (commit, tag, branch)")
    ap.add_argument("solution", help="the solution folder's name under solutions/")
    ap.add_argument("--name", help="the new folder's name (default <solution>_<short commit>)")
    args = ap.parse_args(argv)
    try:
        dest = solution_at(args.rev, args.solution, args.name)
    except ValueError as err:
        print(f"solution_at: {err}", file=sys.stderr)
        return 2
    print(dest.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
