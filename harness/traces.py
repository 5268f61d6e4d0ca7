"""FlashInfer-bench Trace records: one JSON line per (solution, workload) in traces/<definition>/<solution>.jsonl."""
from __future__ import annotations

import json
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch

from harness.runner import INCORRECT_NUMERICAL, PASSED, Result

TRACES = Path("traces")


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


def trace_record(r: Result, env: dict, reference_latency_ms: float | None, source_sha256: str) -> dict:
    w = r.workload
    evaluation = {"status": r.status, "environment": {**env, "sandbox": r.isolation},
                  "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"), "log": r.log}
    if r.status in (PASSED, INCORRECT_NUMERICAL) and r.verdict is not None:
        evaluation["correctness"] = {"max_relative_error": r.verdict.max_relative_error,
                                     "max_absolute_error": r.verdict.max_absolute_error,
                                     "extra": {"family": w.family, "fresh_seed": r.fresh_seed,
                                               **r.verdict.extra}}
    if r.status == PASSED:
        timed = r.latency_ms is not None
        ref = reference_latency_ms if timed and reference_latency_ms else 0.0
        evaluation["performance"] = {
            "latency_ms": r.latency_ms if timed else 0.0,
            "reference_latency_ms": ref,
            "speedup_factor": ref / r.latency_ms if timed and ref else 0.0,
            "floor_ms": r.floor_ms if timed else None,    # ignored by flashinfer-bench, read by the leaderboard
            "clock": r.clock or None,                     # the timed loop against the harness's own clock
        }
    return {"definition": w.definition, "workload": {"uuid": w.uuid, "axes": w.axes, "inputs": w.inputs},
            "solution": r.solution, "solution_sha256": source_sha256, "evaluation": evaluation}


def trace_path(definition: str, solution: str, root: Path = TRACES) -> Path:
    return Path(root) / definition / f"{solution}.jsonl"


def load_traces(definition: str, solution: str, root: Path = TRACES) -> list[dict]:
    path = trace_path(definition, solution, root)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def reference_latency(definition: str, uuid: str, hardware: str, root: Path = TRACES) -> float | None:
    for t in load_traces(definition, "reference", root):
        ev = t["evaluation"]
        if t["workload"]["uuid"] == uuid and ev["environment"]["hardware"] == hardware and ev["status"] == PASSED:
            return ev["performance"]["latency_ms"] or None
    return None


def write_traces(records: list[dict], root: Path = TRACES) -> list[Path]:
    """Merge records into their solutions' trace files: a record replaces the one of the same workload and
    hardware; the rest of the file stays. Lines are kept in a stable order (workload uuid, hardware)."""
    by_file: dict[Path, list[dict]] = {}
    for rec in records:
        by_file.setdefault(trace_path(rec["definition"], rec["solution"], root), []).append(rec)
    for path, new in by_file.items():
        key = lambda t: (t["workload"]["uuid"], t["evaluation"]["environment"]["hardware"])  # noqa: E731
        merged = {key(t): t for t in load_traces(new[0]["definition"], new[0]["solution"], root)}
        merged.update({key(t): t for t in new})
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(merged[k]) + "\n" for k in sorted(merged)))
    return sorted(by_file)
