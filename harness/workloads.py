"""Workloads: FlashInfer-bench workload lines (JSONL) whose tensors live in safetensors blobs.

One line per (batch size, family). Each line records the family and seed the blob is generated from (and, for a
family that takes them, the generator's params, as a search's reproducer does) and the sha256 of its tensor contents:
a missing blob is regenerated from them, a blob whose contents differ is refused.
"""
from __future__ import annotations

import hashlib
import json
import uuid as uuid_lib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from harness import HarnessError
from harness.definition import Definition
from harness.ops import load_op
from harness.records import WorkloadLine, WorkloadSpec, decode_json, parse
from harness.project import write_file

DEFAULT_BATCH_SIZES = (1, 2, 16, 32, 64, 128, 256, 512)   # a family may name fewer (op.FAMILY_BATCH_SIZES)
BASE_SEED = 20261202


class WorkloadError(HarnessError):
    pass


@dataclass
class Workload:
    definition: str
    uuid: str
    axes: dict[str, int]          # the var axes, as FlashInfer-bench records them
    inputs: dict[str, dict]       # name -> {"type": "safetensors", "path": ..., "tensor_key": ...}
    family: str
    seed: int
    sha256: str
    params: dict = field(default_factory=dict)      # the family's generator parameters, if it takes any

    @property
    def blob(self) -> str:
        return next(iter(self.inputs.values()))["path"]

    @property
    def label(self) -> str:
        return f"{self.family} " + " ".join(f"{k}={v}" for k, v in self.axes.items())

    def to_json(self) -> dict:
        """Its line in the workload file (harness.records.WorkloadLine); params only when there are any."""
        spec = WorkloadSpec(uuid=self.uuid, axes=self.axes, inputs=self.inputs, family=self.family, seed=self.seed,
                            sha256=self.sha256, params=self.params)
        return WorkloadLine(definition=self.definition, workload=spec).model_dump(
            mode="json", exclude=None if self.params else {"workload": {"params"}})


def content_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """Hash of names, dtypes, shapes and bytes: independent of the file format's layout."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _seed(defn: Definition, family: str, var_axes: dict, base_seed: int) -> int:
    key = f"{defn.name}/{family}/{sorted(var_axes.items())}/{base_seed}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "little")


def make_workload(defn: Definition, family: str, var_axes: dict[str, int], base_seed: int = BASE_SEED, *,
                  root: str | Path, device="cpu", params: dict | None = None) -> Workload:
    """Generate one workload of the definition's set (its seed derived from the base seed), write its blob under
    root/workloads/blob/ and return its line (with the blob's hash)."""
    stem = "_".join([family] + [f"{k}{v}" for k, v in var_axes.items()])
    return write_workload(defn, family, var_axes, _seed(defn, family, var_axes, base_seed),
                          f"workloads/blob/{defn.name}/{stem}.safetensors", params, root=root, device=device)


def write_workload(defn: Definition, family: str, var_axes: dict[str, int], seed: int, blob: str,
                   params: dict | None = None, *, root: str | Path, device="cpu") -> Workload:
    """Generate the tensors of (family, var_axes, seed, params), write them to `blob` (relative to root, the
    project's root for a project's workloads) and return the workload line."""
    return save_workload(defn, generate_tensors(defn, family, var_axes, seed, device, params), family, var_axes,
                         seed, blob, params, root=root)


def save_workload(defn: Definition, tensors: dict, family: str, var_axes: dict[str, int], seed: int, blob: str,
                  params: dict | None = None, *, root: str | Path) -> Workload:
    """Write `tensors` to `blob` (relative to root) and return their workload line, recorded as drawn from
    (family, var_axes, seed, params); a blob that is not that draw (inputs kept from a timed call) is replayed from
    the file, its seed then only names where it came from."""
    path = Path(root) / blob
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, str(path))
    uid = str(uuid_lib.uuid5(uuid_lib.NAMESPACE_URL, f"{defn.name}/{Path(blob).stem}/{seed}"
                             + (f"/{json.dumps(params, sort_keys=True)}" if params else "")))
    inputs = {name: {"type": "safetensors", "path": blob, "tensor_key": name} for name in defn.inputs}
    return Workload(defn.name, uid, dict(var_axes), inputs, family, seed, content_sha256(tensors), dict(params or {}))


def write_reproducer(defn: Definition, folder: str | Path, stem: str, family: str, var_axes: dict[str, int], seed: int,
                     params: dict | None = None, *, root: str | Path, tensors: dict | None = None) -> Path:
    """Write a one-line workload file folder/stem.jsonl, and its blob beside it, that `harness.run --workloads`
    replays; its path. The blob holds `tensors`, else the family's draw of (var_axes, seed, params); the line names
    it relative to root (the project's, as harness.run reads it) when inside it, absolutely outside it."""
    root = Path(root).resolve()
    blob = Path(folder).resolve() / f"{stem}.safetensors"
    if blob.is_relative_to(root):
        blob = blob.relative_to(root)
    if tensors is None:
        tensors = generate_tensors(defn, family, var_axes, seed, "cpu", params)
    path = Path(folder) / f"{stem}.jsonl"
    save_workloads(path, [save_workload(defn, tensors, family, var_axes, seed, blob.as_posix(), params, root=root)])
    return path


def generate_tensors(defn: Definition, family: str, var_axes: dict, seed: int, device="cpu",
                     params: dict | None = None) -> dict:
    axes = defn.resolve_axes(var_axes)
    try:
        tensors = load_op(defn.op_type).make_inputs(family, axes, seed, device, params=params or None)
    except ValueError as e:         # params the family does not know
        raise WorkloadError(f"family {family!r}: {e}") from None
    _check_tensors(defn, tensors, axes, f"family {family!r}")
    return tensors


def _check_tensors(defn: Definition, tensors: dict, axes: dict, where: str) -> None:
    for name, spec in defn.inputs.items():
        if name not in tensors:
            raise WorkloadError(f"{where}: input {name!r} missing")
        t, shape = tensors[name], defn.shape(spec, axes)
        if tuple(t.shape) != shape or t.dtype != spec.torch_dtype:
            raise WorkloadError(f"{where}: input {name!r} is {t.dtype} {tuple(t.shape)}, "
                                f"the definition says {spec.dtype} {shape}")


def save_workloads(path: str | Path, workloads: list[Workload]) -> None:
    write_file(path, "".join(json.dumps(w.to_json()) + "\n" for w in workloads))


def _parse_line(raw, defn: Definition, where: str) -> Workload:
    """Validate one decoded line (harness.records.WorkloadLine) against the definition and its operator."""
    line = parse(WorkloadLine, raw, where, WorkloadError)
    w = line.workload
    if line.definition != defn.name:
        raise WorkloadError(f"{where}: field 'definition': is {line.definition!r}, expected {defn.name!r}")
    try:
        defn.resolve_axes(w.axes)
    except HarnessError as e:
        raise WorkloadError(f"{where}: field 'workload.axes': {e}") from None
    if set(w.inputs) != set(defn.inputs):
        raise WorkloadError(f"{where}: field 'workload.inputs': must name exactly the inputs {sorted(defn.inputs)}")
    families = load_op(defn.op_type).FAMILIES
    if w.family not in families:
        raise WorkloadError(f"{where}: field 'workload.family': unknown family {w.family!r} (known: {families})")
    return Workload(defn.name, w.uuid, dict(w.axes), {name: spec.to_json() for name, spec in w.inputs.items()},
                    w.family, w.seed, w.sha256, dict(w.params))


def load_workloads(defn: Definition, path: str | Path) -> list[Workload]:
    """The workloads of a workload file (a project's is Project.workload_file(defn)), each line checked."""
    path = Path(path)
    if not path.exists():
        raise WorkloadError(f"{path}: no workload file (write it with `python -m harness gen-workloads`)")
    workloads = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        workloads.append(_parse_line(decode_json(line, f"{path}:{n}", WorkloadError), defn, f"{path}:{n}"))
    if not workloads:
        raise WorkloadError(f"{path}: no workloads")
    return workloads


def load_inputs(defn: Definition, w: Workload, device="cpu", *, root: str | Path) -> dict[str, torch.Tensor]:
    """A workload's input tensors on `device`, in definition order, its blob under `root` (the project's root for
    a project's workloads). A missing blob is generated from the recorded seed; a blob (present or regenerated)
    whose contents differ from the recorded sha256 is an error."""
    path = Path(root) / w.blob
    if path.exists():
        try:
            tensors = load_file(str(path))
        except Exception as e:  # a truncated or foreign file
            raise WorkloadError(f"{path}: unreadable safetensors blob ({e}); delete it to regenerate") from None
        origin = "on disk"
    else:
        tensors = generate_tensors(defn, w.family, w.axes, w.seed, device, w.params)
        origin = "regenerated from its seed"
    tensors = {name: tensors.get(spec["tensor_key"]) for name, spec in w.inputs.items()}
    missing = [n for n, t in tensors.items() if t is None]
    if missing:
        raise WorkloadError(f"{path}: tensors {missing} missing from the blob; delete it to regenerate")
    digest = content_sha256(tensors)
    if digest != w.sha256:
        raise WorkloadError(f"{path} ({origin}): sha256 {digest[:12]} differs from the recorded {w.sha256[:12]}: "
                            "stale or foreign data; see README 'Workloads' to regenerate")
    if origin != "on disk":
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, str(path))
    _check_tensors(defn, tensors, defn.resolve_axes(w.axes), str(path))
    return {name: tensors[name].to(device) for name in defn.inputs}


def select(workloads: list[Workload], batch_sizes=None, families=None, axis: str = "batch_size") -> list[Workload]:
    """The workloads with the given batch sizes and families (None: all), in file order."""
    chosen = [w for w in workloads
              if (batch_sizes is None or w.axes.get(axis) in batch_sizes)
              and (families is None or w.family in families)]
    for b in batch_sizes or ():
        if not any(w.axes.get(axis) == b for w in workloads):
            present = sorted({w.axes.get(axis) for w in workloads})
            raise WorkloadError(f"no workload with {axis}={b} (present: {present}); "
                                "add it with `python -m harness gen-workloads`")
    for f in families or ():
        if not any(w.family == f for w in workloads):
            raise WorkloadError(f"no workload of family {f!r} (present: {sorted({w.family for w in workloads})})")
    return chosen
