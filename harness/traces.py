"""FlashInfer-bench Trace records: one JSON line per (solution, workload) in <root>/<definition>/<solution>.jsonl, root
being a project's traces/ (Project.traces) or any folder a command names."""
from __future__ import annotations

import json
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch

from harness.records import (Correctness, Environment, Evaluation, Performance, Trace, TraceWorkload, decode_json,
                             parse)
from harness.runner import INCORRECT_NUMERICAL, PASSED, Result
from harness.project import write_file


def environment(device: str) -> dict:
    if device == "cuda":
        hardware = torch.cuda.get_device_name().replace(" ", "_")
    else:
        hardware = f"CPU_{platform.machine()}"
    libs = {"torch": torch.__version__, "cuda": torch.version.cuda or "none"}
    try:
        import triton
        libs["triton"] = triton.__version__
    except ImportError:
        libs["triton"] = "none"
    return {"hardware": hardware, "libs": libs}


def trace_record(r: Result, env: dict, reference_latency_ms: float | None, source_sha256: str) -> Trace:
    w = r.workload
    correctness = performance = None
    if r.status in (PASSED, INCORRECT_NUMERICAL) and r.verdict is not None:
        correctness = Correctness(max_relative_error=r.verdict.max_relative_error,
                                  max_absolute_error=r.verdict.max_absolute_error,
                                  extra={"family": w.family, "fresh_seed": r.fresh_seed, **r.verdict.extra})
    if r.status == PASSED:
        timed = r.latency_ms is not None
        ref = reference_latency_ms if timed and reference_latency_ms else 0.0
        performance = Performance(latency_ms=r.latency_ms if timed else 0.0, reference_latency_ms=ref,
                                  speedup_factor=ref / r.latency_ms if timed and ref else 0.0,
                                  floor_ms=r.floor_ms if timed else None, clock=r.clock or None)
    environment = Environment(**env, sandbox=r.isolation, device=r.device or None)
    evaluation = Evaluation(status=r.status, environment=environment,
                            timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"), log=r.log,
                            correctness=correctness, performance=performance)
    return Trace(definition=w.definition, workload=TraceWorkload(uuid=w.uuid, axes=w.axes, inputs=w.inputs),
                 solution=r.solution, solution_sha256=source_sha256, evaluation=evaluation)


def trace_path(definition: str, solution: str, root: Path) -> Path:
    return Path(root) / definition / f"{solution}.jsonl"


def read_traces(path: Path) -> list[Trace]:
    """The traces of one file; a malformed line is a one-line error naming the file, line and field."""
    return [parse(Trace, decode_json(line, f"{path}:{n}"), f"{path}:{n}")
            for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]


def load_traces(definition: str, solution: str, root: Path) -> list[Trace]:
    path = trace_path(definition, solution, root)
    return read_traces(path) if path.exists() else []


def reference_latencies(definition: str, hardware: str, root: Path) -> dict[str, float]:
    """{workload uuid: the reference's recorded latency (ms) on that hardware}, for the workloads it passed timed."""
    return {t.workload.uuid: t.evaluation.performance.latency_ms for t in load_traces(definition, "reference", root)
            if t.hardware == hardware and t.evaluation.status == PASSED and t.evaluation.performance.latency_ms}


def write_traces(records: list[Trace], root: Path) -> list[Path]:
    """Merge records into their solutions' trace files: a record replaces the one of the same workload and
    hardware; the rest of the file stays. Lines are kept in a stable order (workload uuid, hardware)."""
    by_file: dict[Path, list[Trace]] = {}
    for rec in records:
        by_file.setdefault(trace_path(rec.definition, rec.solution, root), []).append(rec)
    for path, new in by_file.items():
        merged = {(t.workload.uuid, t.hardware): t for t in [*load_traces(new[0].definition, new[0].solution, root),
                                                            *new]}
        write_file(path, "".join(json.dumps(merged[k].to_json()) + "\n" for k in sorted(merged)))
    return sorted(by_file)
