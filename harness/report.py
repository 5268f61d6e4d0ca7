"""python -m harness.report [--check]: rebuild the project's LEADERBOARD.md (and its plot) from its traces/.

Per solution and batch size: status over the families, median latency, its ratio to the memory floor, speedup over
`reference` and the worst of the operator's scores (the verdicts' headline figure); per solution: the geometric-mean
speedup and fast_p (the share of workloads that pass and are more than p times faster than the reference). Only timed
traces (a GPU's) count. Two more sections come from the other records under traces/<definition>/:
`deploy_<solution>.json` (`python -m harness deploy`: the deployment form's timings), `drift_<solution>.json`
(`python -m harness.drift --record`: the worst window) and `stress_<solution>.json` (`python -m harness.stress
--record`: the search for breaking inputs). `--check` exits 1 when the committed LEADERBOARD.md differs from what the
traces give (a stale leaderboard). `--ci-report FILE --cpu-traces DIR` writes CI's report instead: every
solution's verdict in a CPU run, its committed GPU standing and the solutions waiting for a GPU run. The words for
the operator's concepts are its own (harness.ops.Wording): those of the default definition's operator."""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from harness import HarnessError, cli
from harness.competition import Ranking, load_competition
from harness.definition import find_definition, project_definition
from harness.ops import Operator, load_op
from harness.records import (RECORDS, DeployRecord, DriftRecord, EvaluationStatus, SolutionRun, StressRecord, Trace,
                             parse, read_json)
from harness.solutions import discover, load_solution, source_sha256, unmet_needs
from harness.project import LEADERBOARD_FILE, PLOT_FILE, Project, write_file
from harness.traces import load_traces, read_traces
from harness.workloads import load_workloads, select

PASSED = EvaluationStatus.PASSED
FAST_P = (1, 10, 30, 100)


def load_all(root: Path) -> list[Trace]:
    """Every timed trace under root (CPU traces, with no latency, are left out)."""
    return [t for path in sorted(Path(root).glob("*/*.jsonl")) for t in read_traces(path)
            if not t.hardware.startswith("CPU")
            and (t.evaluation.status != PASSED or t.evaluation.performance and t.evaluation.performance.latency_ms)]


def load_records(kind: str, root: Path) -> list[SolutionRun]:
    """Every `<kind>_<solution>.json` record under root (deploy, drift, stress), in path order."""
    return [parse(RECORDS[kind], read_json(path), str(path)) for path in sorted(Path(root).glob(f"*/{kind}_*.json"))]


def leaderboard(op: Operator, project: Project, root: Path | None = None) -> tuple[str, dict]:
    """The leaderboard of everything recorded under root (default: the project's traces/), in the operator's
    words: build() on its traces and records, against the project's solutions as they are now, ranked by the
    project's competition.yaml."""
    root = project.traces if root is None else root
    traces, records = load_all(root), {kind: load_records(kind, root) for kind in ("deploy", "drift", "stress")}
    current = current_hashes([*traces, *(r for rs in records.values() for r in rs)], project)
    competition = load_competition(project)
    ranked = {}
    for name in competition.definitions or sorted(project.definition_names()):
        defn = find_definition(name, project.definitions)
        path = project.workload_file(defn)
        ranked[name] = {w.uuid: w for w in select(load_workloads(defn, path), competition.ranking.batch_sizes,
                                                   competition.ranking.families)} if path.exists() else {}
    return build(traces, op, current, **records, ranking=competition.ranking, ranked=ranked)


def _batch(t: Trace) -> int:
    return t.workload.axes["batch_size"]


def _speedups(traces: list[Trace]) -> list[float]:
    """The speedup of every passed trace (0 where it was not timed against the reference)."""
    return [t.evaluation.performance.speedup_factor for t in traces if t.evaluation.status == PASSED]


def _status_over(traces: list[Trace]) -> str:
    """PASSED, or the statuses that are not and how many of the traces have them."""
    failed = sorted({str(t.evaluation.status) for t in traces} - {PASSED})
    if not failed:
        return PASSED
    return ", ".join(failed) + f" ({sum(t.evaluation.status != PASSED for t in traces)}/{len(traces)})"


def _geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def sources_state(traces: list[Trace | SolutionRun], current: str | None) -> str:
    """Whether a solution's traces were measured on its current sources (by the hash each trace records)."""
    measured = {t.solution_sha256 for t in traces}
    if current is None:
        return "removed"
    if None in measured:
        return "unrecorded"
    return "current" if measured == {current} else "older: re-run"


def isolation_state(traces: list[Trace]) -> str:
    """How the solution's recorded runs were isolated (harness.sandbox): "bwrap", or the downgrade, loudly."""
    states = {t.evaluation.environment.sandbox or "UNSANDBOXED (recorded without isolation)" for t in traces}
    return "bwrap" if states == {"bwrap"} else "; ".join(sorted(s if s == "bwrap" else s.upper() for s in states))


def current_hashes(traces: list[Trace | SolutionRun], project: Project) -> dict[str, str | None]:
    """(definition, solution) -> the sha256 of the project's solution's sources now (None when it no longer
    loads)."""
    out = {}
    for definition, solution in {(t.definition, t.solution) for t in traces}:
        try:
            defn = find_definition(definition, project.definitions)
            out[definition, solution] = source_sha256(load_solution(solution, defn, project.solutions), defn)
        except HarnessError:
            out[definition, solution] = None
    return out


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _records_section(title: str, intro: str, nothing_yet: str, headers: list[str], rows: list[list]) -> list[str]:
    parts = [f"## {title}", "", intro, ""]
    if not rows:
        return parts + [f"Nothing recorded yet: {nothing_yet}", ""]
    return parts + [cli.table(rows, headers, "github"), ""]


def deployment_section(records: list[DeployRecord], current: dict, op: Operator) -> list[str]:
    rows = []
    for r in records:
        state = sources_state([r], current.get((r.definition, r.solution)))
        for row in r.rows:
            rows.append([r.solution, state, r.environment.hardware, row.case, row.batch_size, row.due_programs,
                         f"{row.median_us:.1f}", _fmt(row.floor_us, ".1f"), _fmt(row.x_floor, ".2f"),
                         _fmt(row.target_us, ".1f"), "yes" if row.checked else "FAILED"])
        if r.empty_graph_us is not None:
            rows.append([r.solution, state, r.environment.hardware, "empty kernel (timer floor)", "-", "-",
                         f"{r.empty_graph_us:.1f}", "-", "-", "-", "-"])
    return _records_section(
        "Deployment form", op.WORDING.deployment_intro,
        "run `python -m harness deploy --solution NAME` on a GPU.",
        ["solution", "measured sources", "hardware", "case", "B", "due programs", "latency us", "floor us", "x floor",
         "target us", "checked"], rows)


def drift_section(records: list[DriftRecord], current: dict, op: Operator) -> list[str]:
    rows = []
    for r in records:
        w = r.worst
        rows.append([r.solution, sources_state([r], current.get((r.definition, r.solution))),
                     r.environment.hardware, r.windows, r.batch_size, w.window, f"{w.error:.4g}",
                     f"{w.reference_error:.4g}", f"{w.ratio:.4f}", _fmt(getattr(w, op.WORDING.score_key, None), ".4f"),
                     f"{r.limit}" + ("" if w.ratio <= r.limit else " EXCEEDED")])
    return _records_section(
        "Drift over many windows", op.WORDING.drift_intro,
        "run `python -m harness.drift --solution NAME --windows 64 --batch-size 16 --device cuda --record`.",
        ["solution", "measured sources", "hardware", "windows", "B", "worst window", "error", "reference error",
         "ratio", op.WORDING.score_label, "limit"], rows)


def stress_section(records: list[StressRecord], current: dict, op: Operator) -> list[str]:
    rows = []
    for r in records:
        first = r.failures[0] if r.failures else None
        rows.append([r.solution, sources_state([r], current.get((r.definition, r.solution))),
                     r.environment.hardware, r.examples, r.calls, r.batch_size,
                     "clean" if not r.failures else f"{len(r.failures)} FAILED",
                     "-" if first is None else f"{first.status}: {' '.join(first.log.split())[:80]}"])
    return _records_section(
        "Search for breaking inputs",
        "`python -m harness.stress --record`: a property-based search (Hypothesis) over the operator's grammar of "
        f"{op.WORDING.stress_subject}, each example judged as `harness.run` judges; examples: those drawn, calls: "
        "with the shrinking of failures.",
        "run `python -m harness.stress --solution NAME --examples 300 --device cuda --record`.",
        ["solution", "measured sources", "hardware", "examples", "calls", "B up to", "outcome", "first failure"], rows)


def best_floors(traces: list[Trace]) -> dict:
    """{(hardware, batch size): memory floor ms} at the fastest copy rate any run on that hardware measured: a copy
    can only come out slow (something else on the GPU, clocks ramping up), so the fastest is the truest ceiling,
    and every solution is then compared against the same floor."""
    floors: dict = {}
    for t in traces:
        perf = t.evaluation.performance
        if t.evaluation.status == PASSED and perf and perf.floor_ms:
            key = (t.hardware, _batch(t))
            floors[key] = min(floors.get(key, math.inf), perf.floor_ms)
    return floors


def _hardware_tables(hardware: str, ts: list[Trace], definition: str, current: dict, op: Operator,
                     series: dict) -> list[str]:
    """The summary and per-batch tables of one definition's traces on one hardware; the plot's series of them
    added to `series`."""
    floors = best_floors(ts)
    summary, rows = [], []
    solutions = sorted({t.solution for t in ts}, key=lambda s: (s != "reference", s))
    for sol in solutions:
        mine = [t for t in ts if t.solution == sol]
        passed_speedups = _speedups(mine)
        fast = [sum(1 for sp in passed_speedups if sp > p) / len(mine) for p in FAST_P]
        g = _geomean([sp for sp in passed_speedups if sp])
        summary.append([sol, sources_state(mine, current.get((definition, sol))), isolation_state(mine), len(mine),
                        len(passed_speedups), f"{g:.2f}" if g else "-"] + [f"{f:.2f}" for f in fast])
        for b in sorted({_batch(t) for t in mine}):
            at = [t for t in mine if _batch(t) == b]
            passed = [t for t in at if t.evaluation.status == PASSED]
            perf = [t.evaluation.performance for t in passed]
            lat = statistics.median(p.latency_ms for p in perf) if perf else None
            floor = floors.get((hardware, b))
            ratios = [t.evaluation.correctness.extra.get(op.WORDING.score_key) for t in passed]
            ratios = [r for r in ratios if r is not None]
            sp = _geomean([p.speedup_factor for p in perf if p.speedup_factor])
            rows.append([sol, b, _status_over(at), f"{lat * 1e3:.1f}" if lat else "-",
                         f"{lat / floor:.2f}" if lat and floor else "-", f"{sp:.1f}" if sp else "-",
                         f"{max(ratios):.4f}" if ratios else "-"])
            if lat:
                series.setdefault(sol, []).append((b, lat))
                series.setdefault("memory floor", [])
                if floor and b not in dict(series["memory floor"]):
                    series["memory floor"].append((b, floor))
    return [f"### {hardware}", "", "#### Summary", "",
            cli.table(summary, ["solution", "measured sources", "isolation", "workloads", "passed",
                                "geomean speedup"] + [f"fast_{p}" for p in FAST_P], "github"), "",
            "#### Per batch size", "",
            cli.table(rows, ["solution", "B", "status", "latency us", "x floor", "speedup",
                             op.WORDING.score_label], "github"), ""]


def ranking_section(traces: list[Trace], ranking: Ranking, ranked: dict, stress: list[StressRecord],
                    current: dict) -> list[str]:
    """The standings by competition.yaml's ranking, one table per (definition, hardware): a solution is ranked when
    it passes every gate (harness.competition.Ranking), by its score over the ranking workloads (`ranked`:
    {definition: {uuid: workload}}); the others are listed with the first gate they miss."""
    parts = ["## Ranking", "",
             f"From `competition.yaml`: score {ranking.score} over the workloads of batch sizes "
             f"{', '.join(map(str, ranking.batch_sizes)) if ranking.batch_sizes else 'all'} and families "
             f"{', '.join(ranking.families) if ranking.families else 'all'}; gates: {', '.join(ranking.gates)}.", ""]
    # a search anyone can make vacuous (one example, on a CPU) does not count
    clean = {(r.definition, r.solution) for r in stress
             if not r.failures and sources_state([r], current.get((r.definition, r.solution))) == "current"
             and r.examples >= ranking.stress_examples and r.batch_size >= ranking.stress_batch_size
             and not r.environment.hardware.startswith("CPU")}
    tables = 0
    for definition, chosen in sorted(ranked.items()):
        mine = [t for t in traces if t.definition == definition and t.workload.uuid in chosen]
        for hardware in sorted({t.hardware for t in mine}):
            rows = []
            on = [t for t in mine if t.hardware == hardware]
            for sol in sorted({t.solution for t in on} - {"reference"}):
                ts = [t for t in on if t.solution == sol]
                passed = [t for t in ts if t.evaluation.status == PASSED]
                speedups = [t.evaluation.performance.speedup_factor for t in passed]
                missing = len(chosen) - len({t.workload.uuid for t in ts})
                state = sources_state(ts, current.get((definition, sol)))
                why = None
                if "workloads" in ranking.gates:
                    why = (f"{len(ts) - len(passed)} workload(s) not PASSED" if len(passed) < len(ts) else
                           f"{missing} workload(s) not measured" if missing else
                           f"sources {state}" if state != "current" else
                           "a workload without a speedup" if not all(speedups) else None)
                if why is None and "stress" in ranking.gates and (definition, sol) not in clean:
                    why = (f"no clean stress record of its current sources (on a GPU, "
                           f">= {ranking.stress_examples} examples, batch sizes up to {ranking.stress_batch_size})")
                score = _geomean([sp for sp in speedups if sp])
                rows.append([sol, f"{score:.2f}" if score and why is None else "-", f"{len(passed)}/{len(chosen)}",
                             why or "ranked"])
            rows.sort(key=lambda r: (r[3] != "ranked", -float(r[1]) if r[1] != "-" else 0.0, r[0]))
            rank = 0
            for row in rows:
                rank += row[3] == "ranked"
                row.insert(0, str(rank) if row[3] == "ranked" else "-")
            parts += [f"### {definition} on {hardware}", "",
                      cli.table(rows, ["rank", "solution", "score", "passed", "gates"], "github"), ""]
            tables += 1
    if not tables:
        parts += ["Nothing to rank yet: no timed traces of the ranking workloads.", ""]
    return parts


def build(traces: list[Trace], op: Operator, current: dict, deploy: list[DeployRecord] = (),
          drift: list[DriftRecord] = (), stress: list[StressRecord] = (), ranking: Ranking | None = None,
          ranked: dict | None = None) -> tuple[str, dict]:
    """The leaderboard's markdown and the plot's series {solution: [(batch, median latency ms)]} (+ 'floor'), from
    the traces and the deploy and drift records, in the words of the operator `op`. `current` maps (definition,
    solution) to its sources' hash now (current_hashes); with a `ranking` (competition.yaml's) and the workloads it
    selects per definition (`ranked`), the standings come first."""
    by_def = defaultdict(list)
    for t in traces:
        by_def[t.definition].append(t)
    series: dict = {}
    parts = ["# Leaderboard", "",
                     "Rebuilt from `traces/` by `python -m harness.report`; CI fails when this file is stale. "
                     "Latency: median over the input families of each family's median kernel time (L2-cold, "
                     "`harness/timing.py`); x floor: latency over the memory floor (every byte read and written once "
                     "at the fastest copy rate measured on that hardware by the recorded runs); speedup: over "
                     "`reference` on the same workloads. Measured sources: whether the traces were taken on the "
                     "solution's sources as they are now; isolation: how its runs were sandboxed "
                     "(`harness/sandbox.py`).", ""]
    if ranking is not None:
        parts += ranking_section(traces, ranking, ranked or {}, list(stress), current)

    for definition, ts in sorted(by_def.items()):
        by_hardware = defaultdict(list)
        for t in ts:
            by_hardware[t.hardware].append(t)
        # the plot shows the hardware with the most solutions on it; every hardware gets tables of its own, since a
        # latency, a floor or a speedup means something only beside others measured on the same card
        plotted = max(by_hardware, key=lambda h: (len({t.solution for t in by_hardware[h]}), len(by_hardware[h]), h))
        parts += [f"## {definition}", "", f"![latency against batch size on {plotted}]({PLOT_FILE})", ""]
        for hardware in sorted(by_hardware, key=lambda h: (h != plotted, h)):
            parts += _hardware_tables(hardware, by_hardware[hardware], definition, current, op,
                                      series if hardware == plotted else {})
        envs = {(t.hardware, tuple(sorted(t.evaluation.environment.libs.items()))) for t in ts}
        parts += ["### Environment", ""]
        for line in sorted({f"- {hardware}: " + ", ".join(f"{k} {v}" for k, v in libs) for hardware, libs in envs}):
            parts.append(line)
        parts.append("")
    if not traces:
        parts += ["No timed traces yet: run `python -m harness.run --device cuda` on a GPU.", ""]
    parts += (deployment_section(deploy, current, op) + drift_section(drift, current, op)
              + stress_section(stress, current, op))
    return "\n".join(parts), series


def ci_report(defn, cpu_root: Path, project: Project, root: Path | None = None) -> str:
    """What CI says about every solution folder: its verdict on the CPU (from the traces a CPU run of
    `harness.run` wrote under cpu_root; a CUDA solution is skipped there, a folder that does not load is a
    COMPILE_ERROR), its committed GPU standing, and whether it waits for a GPU run (no GPU traces, or traces of
    other sources than it has now). The GPU traces are those under root (default: the project's traces/)."""
    gpu = [t for t in load_all(project.traces if root is None else root) if t.definition == defn.name]
    verdicts, standings, pending = [], [], []
    for name in discover(defn, project.solutions):
        try:
            sol = load_solution(name, defn, project.solutions)
        except HarnessError as e:
            verdicts.append([name, "-", f"{EvaluationStatus.COMPILE_ERROR}: {' '.join(str(e).split())[:120]}"])
            pending.append([name, "does not load"])
            continue
        cpu = load_traces(defn.name, name, cpu_root)
        why_not = unmet_needs(sol, "cpu")
        if why_not and not cpu:
            verdict = f"skipped: {why_not}"
        elif not cpu:
            verdict = "not run on the CPU"
        else:
            verdict = _status_over(cpu)
            verdict += f" ({len(cpu)}/{len(cpu)})" if verdict == PASSED else ""
        verdicts.append([name, sol.language, verdict])
        mine = [t for t in gpu if t.solution == name]
        state = sources_state(mine, source_sha256(sol, defn)) if mine else "no GPU traces"
        speedups = _speedups(mine)
        g = _geomean([sp for sp in speedups if sp])
        standings.append([name, state, len(mine), len(speedups),
                          f"{g:.2f}" if g else "-"])
        if state != "current" and name != "reference":
            pending.append([name, state])
    parts = [f"# CI report: {defn.name}", "", "## CPU verdicts", "",
             "`python -m harness.run --device cpu`: every family at the small batch sizes a CPU run takes (Triton "
             "through its interpreter).",
             "", cli.table(verdicts, ["solution", "language", "CPU verdict"], "github"), "",
             "## Committed GPU standings", "", "From the committed traces (LEADERBOARD.md has the detail).", "",
             cli.table(standings, ["solution", "measured sources", "workloads", "passed", "geomean speedup"],
                       "github"), "",
             "## Pending GPU", ""]
    if pending:
        parts += ["These need `bash scripts/gpu_session.sh NAME` on a GPU and the traces it writes committed:", "",
                  cli.table(pending, ["solution", "why"], "github"), ""]
    else:
        parts += ["None: every solution's GPU traces were measured on its current sources.", ""]
    return "\n".join(parts)


def plot(series: dict, batch_unit: str, path: Path) -> None:
    """The latencies against the batch size, whose unit (the programs of one batch element) the operator names."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for name, points in sorted(series.items()):
        points = sorted(points)
        style = dict(color="black", linestyle="--") if name == "memory floor" else dict(marker="o")
        ax.plot([b for b, _ in points], [ms * 1e3 for _, ms in points], label=name, **style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"batch size (x {batch_unit})")
    ax.set_ylabel("median latency (us)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


def has_gpu_rows(text: str) -> bool:
    return "### Per batch size" in text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = cli.description(__doc__)
    p.epilog = cli.epilog("(--check) the committed LEADERBOARD.md differs from what the traces give")
    p.add_argument("--check", action="store_true", help="exit 1 if LEADERBOARD.md is stale; write nothing")
    cli.add_definition(p)
    cli.add_traces(p, help="the traces to read (default: the project's traces/)")
    p.add_argument("--out", metavar="DIR", help="where LEADERBOARD.md and its plot go (default: the project's root "
                                                "for its own traces, else the traces folder itself)")
    p.add_argument("--force", action="store_true",
                   help="replace a leaderboard that has GPU results with one that has none")
    p.add_argument("--ci-report", metavar="FILE",
                   help="write (and print) CI's report instead: every solution's CPU verdict from --cpu-traces, its "
                        "committed GPU standing and whether it waits for a GPU run")
    p.add_argument("--cpu-traces", metavar="DIR", help="with --ci-report: the traces of a CPU run of harness.run")


def main(argv=None) -> int:
    return execute(cli.parse(add_arguments, "python -m harness.report", argv))


def execute(args: argparse.Namespace) -> int:
    try:
        project = cli.project_of(args)
        traces_root = Path(args.traces).resolve() if args.traces else project.traces
        out = Path(args.out) if args.out else project.root if traces_root == project.traces else traces_root
        board, picture = out / LEADERBOARD_FILE, out / PLOT_FILE
        defn = project_definition(project, args.definition)
        op = load_op(defn.op_type)
        text, series = leaderboard(op, project, traces_root)
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.ci_report:
        if not args.cpu_traces:
            print("error: --ci-report needs --cpu-traces DIR", file=sys.stderr)
            return 2
        try:
            text = ci_report(defn, Path(args.cpu_traces), project, traces_root)
        except HarnessError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        write_file(args.ci_report, text)
        print(text)
        return 0
    if args.check:
        current = board.read_text() if board.exists() else ""
        if current != text:
            print(f"{board} is stale: run `python -m harness.report` and commit it", file=sys.stderr)
            return 1
        print(f"{board} is up to date")
        return 0
    if board.exists() and has_gpu_rows(board.read_text()) and not has_gpu_rows(text) and not args.force:
        print(f"error: {board} has GPU results and the traces in {traces_root} have none: not replaced "
              "(--out elsewhere, or --force)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    write_file(board, text)
    if series:
        plot(series, op.WORDING.batch_unit.format(**defn.const_axes), picture)
    print(f"wrote {board}" + (f" and {picture}" if series else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
