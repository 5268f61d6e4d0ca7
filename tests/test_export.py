"""The export loads with flashinfer-bench's own data models (the [fib] extra)."""
import json

import pytest

from conftest import PROJECT
from harness.export import export
from harness.solutions import discover
from harness.workloads import load_workloads, select

fib = pytest.importorskip("flashinfer_bench.data",
                          reason="flashinfer-bench is the [fib] extra: pip install -e \".[fib]\"")


def test_flashinfer_bench_loads_the_export(defn, tmp_path):
    """Self-contained: every trace names a solution and a workload of the dataset (the reference included) and
    every workload's tensors load from the exported blobs, through FlashInfer-bench's own loader."""
    counts = export(tmp_path, PROJECT, batch_sizes=(1,))
    ts = fib.TraceSet.from_path(str(tmp_path))
    assert defn.name in ts.definitions
    assert ts.definitions[defn.name].op_type == "leapquant_kda_flush"
    names = {s.name for s in ts.solutions.get(defn.name, [])}
    assert names == set(discover(defn, PROJECT.solutions))
    workloads = ts.workloads[defn.name]
    committed = select(load_workloads(defn, PROJECT.workload_file(defn)), (1,))
    assert len(workloads) == counts["workloads"] == counts["blobs"] == len(committed)
    uuids = {w.workload.uuid for w in workloads}
    traces = ts.traces.get(defn.name, [])
    assert len(traces) == counts["traces"] and traces
    assert all(t.solution in names and t.workload.uuid in uuids for t in traces)
    for w in workloads:
        paths = {spec.path for spec in w.workload.inputs.values()}
        for path in paths:
            tensors = ts.get_workload_blob_tensor(path)
            assert set(tensors) == set(defn.inputs)
    for s in ts.solutions[defn.name]:
        assert all(src.content for src in s.sources)


def test_cpu_trace_validates(defn, tmp_path):
    """A judged-but-untimed trace and a failing one are valid FlashInfer-bench Trace records."""
    from harness import run
    assert run.main(["--solution", "torch_v1", "--device", "cpu", "--batch-sizes", "1", "--families", "edge",
                     "--traces", str(tmp_path)]) == 0
    for line in (tmp_path / defn.name / "torch_v1.jsonl").read_text().splitlines():
        fib.Trace.model_validate(json.loads(line))
