"""Workload lines, on-demand blobs and their hashes."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import PROJECT
from harness.ops import leapquant_kda_flush as op
from harness.workloads import (DEFAULT_BATCH_SIZES, WorkloadError, load_inputs, load_workloads, save_workloads,
                               select, write_workload)


@pytest.fixture(scope="module")
def workloads(defn):
    return load_workloads(defn, PROJECT.workload_file(defn))


def test_every_batch_size_and_family_listed(workloads):
    got = {(w.axes["batch_size"], w.family) for w in workloads}
    assert got == {(b, f) for b in DEFAULT_BATCH_SIZES for f in op.FAMILIES
                   if b in op.FAMILY_BATCH_SIZES.get(f, DEFAULT_BATCH_SIZES)}
    assert len({w.uuid for w in workloads}) == len(workloads)
    assert all(w.blob.startswith("workloads/blob/") for w in workloads)


@pytest.mark.parametrize("family", op.FAMILIES)
def test_missing_blob_regenerated_from_seed(defn, workloads, tmp_path, family):
    """Regenerating from the recorded seed on this machine reproduces the recorded hash (recorded elsewhere)."""
    w = select(workloads, [1], [family])[0]
    first = load_inputs(defn, w, root=tmp_path)
    assert (tmp_path / w.blob).exists()
    again = load_inputs(defn, w, root=tmp_path)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert list(first) == list(defn.inputs)


def test_blob_with_other_contents_refused(defn, workloads, tmp_path):
    w = select(workloads, [1], ["random"])[0]
    load_inputs(defn, w, root=tmp_path)
    path = tmp_path / w.blob
    tensors = load_file(str(path))
    tensors["w"][0, 0, 0] += 0.25
    save_file(tensors, str(path))
    with pytest.raises(WorkloadError, match="sha256 .* differs from the recorded"):
        load_inputs(defn, w, root=tmp_path)
    path.write_bytes(b"garbage")
    with pytest.raises(WorkloadError, match="unreadable safetensors blob"):
        load_inputs(defn, w, root=tmp_path)


def _line(defn):
    return json.loads(PROJECT.workload_file(defn).read_text().splitlines()[0])


MALFORMED = {
    "other definition": (lambda r: r.update(definition="other"), "'definition'"),
    "bad axes": (lambda r: r["workload"].update(axes={"batch_size": 0}), "'workload.axes'"),
    "missing input": (lambda r: r["workload"]["inputs"].pop("q0"), "'workload.inputs'"),
    "unknown family": (lambda r: r["workload"].update(family="gaussian"), "'workload.family'"),
    "bad sha": (lambda r: r["workload"].update(sha256="abc"), "'workload.sha256'"),
    "no uuid": (lambda r: r["workload"].pop("uuid"), "'workload.uuid'"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_workload_line(defn, tmp_path, case):
    mutate, field = MALFORMED[case]
    raw = _line(defn)
    mutate(raw)
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps(_line(defn)) + "\n" + json.dumps(raw) + "\n")
    with pytest.raises(WorkloadError) as err:
        load_workloads(defn, path)
    assert f"{path}:2" in str(err.value) and field in str(err.value) and "\n" not in str(err.value)


def test_not_json_and_missing_file(defn, tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text("{oops\n")
    with pytest.raises(WorkloadError, match=r"w.jsonl:1: not valid JSON"):
        load_workloads(defn, path)
    with pytest.raises(WorkloadError, match="no workload file"):
        load_workloads(defn, tmp_path / "none.jsonl")


def test_select(workloads):
    assert {w.family for w in select(workloads, [2], ["edge", "random"])} == {"edge", "random"}
    with pytest.raises(WorkloadError, match="no workload with batch_size=3"):
        select(workloads, [3], None)
    with pytest.raises(WorkloadError, match="no workload of family 'gauss'"):
        select(workloads, None, ["gauss"])


def test_params_recorded_and_regenerated(defn, tmp_path):
    """A workload with generator params (a search's reproducer) round-trips through its line and regenerates from
    seed and params when its blob is gone; params a family does not take are one line."""
    params = {"programs": [{}, {"rank": 0, "window": "one"}], "call": {"q0": "half"}}
    w = write_workload(defn, "stress", {"batch_size": 1}, 5, "repro/x.safetensors", params, root=tmp_path)
    save_workloads(tmp_path / "repro.jsonl", [w])
    [again] = load_workloads(defn, tmp_path / "repro.jsonl")
    assert again.params == params and again.sha256 == w.sha256
    first = load_inputs(defn, again, root=tmp_path)
    (tmp_path / "repro/x.safetensors").unlink()
    assert all(torch.equal(first[k], v) for k, v in load_inputs(defn, again, root=tmp_path).items())
    plain = write_workload(defn, "stress", {"batch_size": 1}, 5, "repro/y.safetensors", root=tmp_path)
    assert plain.sha256 != w.sha256 and "params" not in plain.to_json()["workload"]
    with pytest.raises(WorkloadError, match="family 'random' takes no parameters"):
        write_workload(defn, "random", {"batch_size": 1}, 5, "repro/z.safetensors", params, root=tmp_path)
    with pytest.raises(WorkloadError, match="stress axis 'rank' has no option 9"):
        write_workload(defn, "stress", {"batch_size": 1}, 5, "repro/z.safetensors", {"programs": [{"rank": 9}]},
                       root=tmp_path)
