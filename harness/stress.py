"""python -m harness.stress --solution NAME [--examples N] [--seed S] [--device auto|cuda|cpu] [--batch-size B]
[--record]: search the operator's grammar of degenerate inputs for inputs that a solution gets wrong.

Each example is one call, at a batch size drawn from the powers of two below --batch-size and itself, whose programs
are drawn from the operator's PROGRAM_GRAMMAR (one option of every named axis per program; programs past the drawn
list take the plainest option of every axis; a search that finds nothing then tries a quarter as many examples again
with every program drawing its options from the seed, as the family does) and CALL_GRAMMAR, with a seed for the
values (mixed with the search's salt, so that no call's inputs are known in advance). The solution runs in its
sandboxed worker and is judged as `harness.run` judges it (same loader, runner, timeouts and judge); before the
first example and at random between others it is also shown a committed workload at B = 1, as a run shows it first,
so that it cannot tell the search from a run by whether it has seen committed inputs. Hypothesis drives the search:
it shrinks a failing example towards the smallest batch size and the fewest programs off their plainest options (it
may leave plain programs before the one that fails: they are the same as the programs past the list), keeps failing
examples in the project's .hypothesis/ and tries them first next time. Each distinct failure is printed as one line
and written as a reproducer workload that `python -m harness.run --solution NAME --workloads FILE` replays. Exits 1
on any failure, 2 on bad input. --record writes the outcome to <traces>/<definition>/stress_<NAME>.json for the
leaderboard (traces: the project's traces/ unless --traces is given)."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import hypothesis
from hypothesis import HealthCheck, Verbosity, given, settings, strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase

from harness import HarnessError, cli, traces
from harness.cli import resolve_device
from harness.competition import load_competition
from harness.definition import Definition, project_definition
from harness.ops import load_op
from harness.project import Project, write_file
from harness.records import StressRecord
from harness.runner import COMPILE_ERROR, PASSED, Worker, judge_call, program_layout
from harness.solutions import load_solution
from harness.workloads import Workload, generate_tensors, load_inputs, load_workloads, write_reproducer

DEFAULT_EXAMPLES = 100
DRAWN_SHARE = 4            # a search that finds nothing tries 1 / DRAWN_SHARE as many examples more, drawn (`run`)
COMMITTED_BATCH = 1         # the largest batch size of the committed workloads mixed among the examples


class Failure(Exception):
    """One failing example: the choices that made it and what the judge said."""

    def __init__(self, example: dict, status: str, log: str, score: float | None):
        super().__init__(f"{status}: {log}")
        self.example, self.status, self.log, self.score = example, status, log, score


_FAILURE_KINDS: dict[str, type] = {}


def failure_kind(kind: str) -> type:
    """A Failure subclass per kind of failure: Hypothesis keeps (and shrinks) one example per distinct exception
    type, so each kind is reported with its own smallest example."""
    if kind not in _FAILURE_KINDS:
        _FAILURE_KINDS[kind] = type(f"Failure[{kind}]", (Failure,), {})
    return _FAILURE_KINDS[kind]


def batch_sizes(largest: int) -> list[int]:
    """The batch sizes an example draws from: the powers of two below `largest`, and `largest`."""
    return [1 << i for i in range(largest.bit_length()) if 1 << i < largest] + [largest]


def examples(op, n_programs: int, sizes: list[int], drawn: bool = False):
    """Strategy of examples {"batch_size": int, "programs": [choices, ...], "call": choices, "seed": int, "drawn":
    bool}; the first option of each axis (and the smallest batch size) is its plainest, which is what Hypothesis
    shrinks towards. The named programs are at most one sequence's (`n_programs`); `drawn` examples name none: every
    program of every sequence draws its options from the seed, as the family's do."""
    program = st.fixed_dictionaries({axis: st.sampled_from(options) for axis, options in op.PROGRAM_GRAMMAR.items()})
    call = st.fixed_dictionaries({axis: st.sampled_from(options) for axis, options in op.CALL_GRAMMAR.items()})
    programs = st.just([]) if drawn else st.lists(program, min_size=1, max_size=n_programs)
    return st.fixed_dictionaries({"batch_size": st.sampled_from(sizes), "programs": programs, "call": call,
                                  "seed": st.integers(0, 2 ** 32 - 1), "drawn": st.just(drawn)})


def params_of(op, example: dict) -> dict:
    """The family params of an example, each program naming only the axes off their plainest option (none when
    the example's programs are drawn from the seed)."""
    def named(choices, grammar):
        return {axis: option for axis, option in choices.items() if option != grammar[axis][0]}
    call = named(example["call"], op.CALL_GRAMMAR)
    if example.get("drawn"):
        return {"call": call}
    return {"programs": [named(p, op.PROGRAM_GRAMMAR) for p in example["programs"]], "call": call}


def describe(op, example: dict, seed: int) -> str:
    """One line: the programs off plain (by index; the others are plain), the call's choices, the batch size and
    the values' seed."""
    params = params_of(op, example)
    if "programs" not in params:
        programs = "every program drawn from the seed"
    else:
        programs = "; ".join(f"program {i}: " + " ".join(f"{a}={o}" for a, o in p.items())
                             for i, p in enumerate(params["programs"]) if p) or "every program plain"
    call = " ".join(f"{a}={o}" for a, o in params["call"].items()) or "plain"
    return f"{programs} | call: {call} | batch_size {example['batch_size']} | seed {seed}"


class Search:
    """The search over one solution: its worker, the examples tried and the distinct failures found."""

    def __init__(self, defn: Definition, solution: str, device: str, batch_size: int, timeout_s: float,
                 project: Project, solutions_root: str | Path | None = None, salt: int = 0):
        self.defn, self.device, self.project, self.salt = defn, device, project, salt
        self.op = load_op(defn.op_type)
        self.sol = load_solution(solution, defn, solutions_root or project.solutions)
        self.sizes = batch_sizes(batch_size)
        _, n_prefix = program_layout(defn)
        out = next(iter(defn.outputs.values()))
        axes = defn.resolve_axes({"batch_size": 1})
        self.n_programs = 1
        for a in out.shape[:n_prefix]:
            self.n_programs *= axes[a]
        self.worker = Worker(self.sol, defn, device, timeout_s, hide=[project.root])
        self.calls = 0
        # the committed workloads a run judges first (the smallest: they cost little), mixed among the examples
        self.committed = [w for w in load_workloads(defn, project.workload_file(defn))
                          if w.axes.get("batch_size", 1) <= COMMITTED_BATCH]
        self.committed_failures: list[tuple[Workload, str, str]] = []
        self.committed_inputs: dict[str, dict] = {}     # by uuid, loaded (and hash-checked) once

    def values_seed(self, example: dict) -> int:
        """The seed of an example's values: its own mixed with the search's salt (search_salt)."""
        digest = hashlib.blake2b(f"{self.salt}:{example['seed']}".encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little")

    def inputs(self, example: dict) -> dict:
        return generate_tensors(self.defn, self.op.STRESS_FAMILY, var_axes(example), self.values_seed(example),
                                self.device, params_of(self.op, example))

    def decoy(self, example: dict) -> None:
        """Before the first example and, at random, before others (a hash of the example's salted seed, so that
        Hypothesis's replays see the same calls), one of the committed workloads, judged as `harness.run` judges it
        first: a solution cannot tell the search from a run by whether it has been shown committed inputs. A failure
        there is kept in committed_failures, not searched."""
        mix = self.values_seed(example)
        if not self.committed or (self.calls and mix % 2):
            return
        w = self.committed[(mix >> 1) % len(self.committed)]
        if w.uuid not in self.committed_inputs:
            self.committed_inputs[w.uuid] = load_inputs(self.defn, w, self.device, root=self.project.root)
        self.calls += 1
        status, log, _ = judge_call(self.defn, self.op, self.worker, self.committed_inputs[w.uuid], w.axes)
        self.worker.fatal = None
        if status != PASSED and all(w is not seen for seen, _, _ in self.committed_failures):
            self.committed_failures.append((w, status, log))

    def check(self, example: dict) -> None:
        """Judge the solution on one example (after a committed workload, now and then: `decoy`); raise the Failure
        of its kind when it is not PASSED."""
        self.decoy(example)
        self.calls += 1
        status, log, verdict = judge_call(self.defn, self.op, self.worker, self.inputs(example), var_axes(example))
        self.worker.fatal = None                # a timed-out or dead worker is restarted for the next example
        if status != PASSED:
            kind = (verdict.extra.get("failure") if verdict is not None else None) or status
            raise failure_kind(kind)(example, status, log, verdict.score if verdict else None)

    def run(self, n_examples: int, seed: int | None, database: Path | None) -> list[Failure]:
        """Search n_examples examples (from `seed`, or Hypothesis's own randomness after replaying the failures kept
        in `database`); the distinct failures, each shrunk. When they find none, n_examples // DRAWN_SHARE more whose
        every program draws its options from the seed, as the family's do: failures that need several degenerate
        programs at once, which one sequence's named programs cannot make (they shrink in batch size and call only,
        so they come second)."""
        self.worker.start()
        if self.worker.load_error:              # not a search failure: nothing to shrink
            self.worker.close()
            raise HarnessError(f"{self.sol.name}: {COMPILE_ERROR}: {self.worker.load_error}")
        try:
            for drawn, count in ((False, n_examples), (True, max(1, n_examples // DRAWN_SHARE))):
                failures = self._phase(examples(self.op, self.n_programs, self.sizes, drawn), count, seed, database)
                if failures:
                    return failures
            return []
        finally:
            self.worker.close()

    def _phase(self, strategy, n_examples: int, seed: int | None, database: Path | None) -> list[Failure]:
        configured = settings(max_examples=n_examples, deadline=None, database=(
            DirectoryBasedExampleDatabase(str(database)) if database else None), report_multiple_bugs=True,
            suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet, print_blob=False)
        test = configured(given(strategy)(self.check))
        if seed is not None:                    # Hypothesis neither replays nor keeps examples in a seeded run
            test = hypothesis.seed(seed)(test)
        try:
            test()
        except Exception as e:                  # noqa: BLE001 -- sorted below: failures, or the search's own error
            failures = _failures(e)
            if not failures:
                raise HarnessError(f"the search stopped: {type(e).__name__}: {' '.join(str(e).split())[:300]}") \
                    from None
            return failures
        return []

    def reproducer(self, failure: Failure, folder: Path) -> Path:
        """Write the failing example as a one-line workload file (and its blob) under folder; its path. The blob's
        path in the line is relative to the project's root (as harness.run reads it), absolute outside it."""
        params = params_of(self.op, failure.example)
        seed = self.values_seed(failure.example)
        digest = hashlib.sha256(json.dumps([params, seed], sort_keys=True).encode()).hexdigest()
        return write_reproducer(self.defn, folder, f"{self.op.STRESS_FAMILY}_{digest[:12]}", self.op.STRESS_FAMILY,
                                var_axes(failure.example), seed, params, root=self.project.root)


def project_path(project, path: Path) -> str:
    """path as a record names it: relative to the project's root when inside it (records are committed)."""
    path = Path(path).absolute()             # not resolved: a linked workloads/ stays the project's
    return (path.relative_to(project.root) if path.is_relative_to(project.root) else path).as_posix()


def var_axes(example: dict) -> dict:
    return {"batch_size": example["batch_size"]}


def search_salt(seed: int | None, database: Path | None) -> int:
    """Mixed into every example's seed, so that no call's inputs are known in advance: Hypothesis tries the plainest
    example with seed 0 first, and a solution that recognised that call would know it is being searched and could
    take its careful path from then on. Derived from --seed for a repeatable search; else kept beside the project's
    database (the failures it replays then stand for the same inputs; the worker does not see the project), else
    new."""
    if seed is not None:
        return int.from_bytes(hashlib.blake2b(f"seed:{seed}".encode(), digest_size=8).digest(), "little")
    fresh = int.from_bytes(os.urandom(8), "little")
    if database is None:
        return fresh
    path = database.with_name(f"{database.name}.salt")
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, f"{fresh}\n")
        return fresh


def _failures(e: BaseException) -> list[Failure]:
    """The Failures in what Hypothesis raised: one, or a group of distinct ones (nested groups flattened)."""
    if isinstance(e, Failure):
        return [e]
    if isinstance(e, BaseExceptionGroup):
        return [f for sub in e.exceptions for f in _failures(sub)]
    return []


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = cli.description(__doc__)
    p.epilog = cli.epilog("a failure found (each printed as one FAILED line, with its reproducer)")
    cli.add_solution(p)
    p.add_argument("--examples", type=cli.positive_int, default=DEFAULT_EXAMPLES, metavar="N",
                   help="examples to try before shrinking (default: %(default)s)")
    p.add_argument("--seed", type=int, metavar="N",
                   help="the search's seed, to repeat a search exactly (default: random, after replaying the "
                        "failures that earlier searches kept in the project's .hypothesis/)")
    cli.add_device(p)
    cli.add_batch_size(p, 1, help="the largest batch size an example draws (from the powers of two below it and "
                                  "itself: a kernel must not be careful at one batch size alone)")
    cli.add_definition(p)
    cli.add_solutions_dir(p)
    cli.add_timeout(p)
    p.add_argument("--out", metavar="DIR",
                   help="folder of the reproducers, one sub-folder per solution (default: the project's "
                        "stress_failures/)")
    p.add_argument("--no-database", action="store_true",
                   help="neither replay nor keep failing examples in the project's .hypothesis/")
    p.add_argument("--record", action="store_true",
                   help="write the outcome to <traces>/<definition>/stress_<NAME>.json (read by harness.report)")
    cli.add_traces(p, help="root of --record's file (default: the project's traces/)")


def parse_args(argv=None) -> argparse.Namespace:
    return cli.parse(add_arguments, "python -m harness.stress", argv)


def main(argv=None) -> int:
    return execute(parse_args(argv))


def execute(args: argparse.Namespace) -> int:
    try:
        device = resolve_device(args.device)
        project = cli.project_of(args)
        defn = project_definition(project, args.definition)
        settings = cli.settings_of(args, load_competition(project))
        database = (None if args.no_database or args.seed is not None
                    else project.stress_database / defn.name / args.solution)
        search = Search(defn, args.solution, device, args.batch_size, settings.timeout_s, project, args.solutions,
                        search_salt(args.seed, database))
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = search.sol.name
    print(f"{name}: searching {args.examples} examples at batch sizes {', '.join(map(str, search.sizes))} on "
          f"{device}, " + (f"seed {args.seed}" if args.seed is not None else "random seed"),
          flush=True)
    started = time.perf_counter()
    try:
        failures = search.run(args.examples, args.seed, database)
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - started
    rows = []
    for f in failures:
        path = search.reproducer(f, Path(args.out or project.stress_failures) / name)
        seed = search.values_seed(f.example)
        print(f"FAILED {f.status}: {' '.join(f.log.split())[:200]} | {describe(search.op, f.example, seed)} | "
              f"replay: python -m harness.run --solution {name} --workloads {path}", flush=True)
        rows.append({"status": f.status, "log": f.log, search.op.WORDING.score_key: f.score,
                     "params": params_of(search.op, f.example), "seed": seed, "axes": var_axes(f.example),
                     "reproducer": project_path(project, path)})
    if search.committed_failures:
        print(f"{name}: also not PASSED on {len(search.committed_failures)} committed workload(s) judged between "
              f"examples ({', '.join(w.label for w, _, _ in search.committed_failures)}): `python -m harness.run "
              f"--solution {name}` reports them", flush=True)
    for w, status, log in search.committed_failures:
        rows.append({"status": status, "log": log, search.op.WORDING.score_key: None,
                     "params": {"committed_workload": w.label, "uuid": w.uuid}, "seed": 0,
                     "reproducer": project_path(project, project.workload_file(defn))})
    found = len(failures) + len(search.committed_failures)
    print(f"{name}: {found} distinct failure(s) in {search.calls} calls ({args.examples} examples and "
          f"shrinking), {seconds:.0f} s", flush=True)
    if args.record:
        record = StressRecord(definition=defn.name, solution=name, solution_sha256=search.worker.sha256,
                              environment=traces.environment(device), examples=args.examples, calls=search.calls,
                              batch_size=args.batch_size, seed=args.seed, hypothesis=hypothesis.__version__,
                              seconds=round(seconds, 1),
                              timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"), failures=rows)
        path = Path(args.traces or project.traces) / defn.name / f"stress_{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, json.dumps(record.to_json(), indent=1) + "\n")
        print(f"wrote {path}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
