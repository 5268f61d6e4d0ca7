"""Load and validate a FlashInfer-bench Definition: axes, typed tensor specs, constraints, the reference `run`."""
from __future__ import annotations

import ast
import hashlib
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from harness import HarnessError, cli

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


class DefinitionError(HarnessError):
    pass


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[str, ...]
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass
class Definition:
    name: str
    op_type: str
    const_axes: dict[str, int]
    var_axes: tuple[str, ...]
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    constraints: tuple[str, ...]
    reference: str
    description: str = ""
    tags: tuple[str, ...] = ()
    path: Path | None = None
    raw: dict = field(default_factory=dict, repr=False)     # the JSON it was parsed from (sent to workers)
    _reference_run: Callable | None = field(default=None, repr=False)

    def resolve_axes(self, var_values: dict[str, int]) -> dict[str, int]:
        """All axis values of one workload: the const axes plus the given var axes, with the constraints checked."""
        missing = [a for a in self.var_axes if a not in var_values]
        unknown = [a for a in var_values if a not in self.var_axes]
        if missing or unknown:
            raise DefinitionError(f"{self.name}: workload axes {sorted(var_values)} do not match var axes "
                                  f"{list(self.var_axes)}")
        for a, v in var_values.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise DefinitionError(f"{self.name}: axis '{a}' must be a non-negative integer, got {v!r}")
        axes = {**self.const_axes, **var_values}
        for c in self.constraints:
            if not eval(compile(c, "<constraint>", "eval"), {"__builtins__": {}}, dict(axes)):
                raise DefinitionError(f"{self.name}: constraint '{c}' fails for axes {var_values}")
        return axes

    def shape(self, spec: TensorSpec, axes: dict[str, int]) -> tuple[int, ...]:
        return tuple(axes[a] for a in spec.shape)

    def reference_run(self) -> Callable:
        """The reference `run` from the definition's code string (executed once, in its own namespace)."""
        if self._reference_run is None:
            namespace: dict[str, Any] = {"__name__": f"reference_{self.name}"}
            exec(compile(self.reference, f"<reference {self.name}>", "exec"), namespace)
            self._reference_run = namespace["run"]
        return self._reference_run


def _require(cond: bool, where: str, field_name: str, message: str) -> None:
    if not cond:
        raise DefinitionError(f"{where}: field '{field_name}': {message}")


def _tensor_specs(raw: Any, where: str, kind: str, axes: set[str]) -> dict[str, TensorSpec]:
    _require(isinstance(raw, dict) and raw, where, kind, "must be a non-empty object of tensor specs")
    specs = {}
    for name, spec in raw.items():
        f = f"{kind}.{name}"
        _require(isinstance(spec, dict), where, f, "must be an object with 'shape' and 'dtype'")
        shape, dtype = spec.get("shape"), spec.get("dtype")
        _require(isinstance(shape, list), where, f"{f}.shape", "must be a list of axis names")
        for a in shape:
            _require(a in axes, where, f"{f}.shape", f"unknown axis {a!r} (declared: {sorted(axes)})")
        _require(dtype in DTYPES, where, f"{f}.dtype", f"unknown dtype {dtype!r}")
        specs[name] = TensorSpec(tuple(shape), dtype)
    return specs


def parse_definition(raw: Any, where: str) -> Definition:
    """Validate a decoded definition JSON; `where` names its source in error messages."""
    _require(isinstance(raw, dict), where, "<root>", "must be a JSON object")
    for key in ("name", "op_type", "reference"):
        _require(isinstance(raw.get(key), str) and raw[key].strip(), where, key, "must be a non-empty string")
    axes_raw = raw.get("axes")
    _require(isinstance(axes_raw, dict) and axes_raw, where, "axes", "must be a non-empty object")
    const_axes, var_axes = {}, []
    for a, spec in axes_raw.items():
        _require(isinstance(spec, dict) and spec.get("type") in ("const", "var"), where, f"axes.{a}.type",
                 "must be 'const' or 'var'")
        if spec["type"] == "const":
            v = spec.get("value")
            _require(isinstance(v, int) and not isinstance(v, bool) and v >= 0, where, f"axes.{a}.value",
                     "a const axis needs a non-negative integer value")
            const_axes[a] = v
        else:
            var_axes.append(a)
    axis_names = set(axes_raw)
    inputs = _tensor_specs(raw.get("inputs"), where, "inputs", axis_names)
    outputs = _tensor_specs(raw.get("outputs"), where, "outputs", axis_names)
    both = sorted(set(inputs) & set(outputs))
    _require(not both, where, "outputs", f"names also used by inputs: {both}")
    constraints = raw.get("constraints", [])
    _require(isinstance(constraints, list), where, "constraints", "must be a list of expressions")
    for c in constraints:
        _require(isinstance(c, str), where, "constraints", f"{c!r} is not a string")
        try:
            names = {n.id for n in ast.walk(ast.parse(c, mode="eval")) if isinstance(n, ast.Name)}
        except SyntaxError as e:
            raise DefinitionError(f"{where}: field 'constraints': {c!r} is not an expression ({e.msg})") from None
        _require(names <= axis_names, where, "constraints", f"{c!r} uses unknown names {sorted(names - axis_names)}")
    defn = Definition(
        name=raw["name"], op_type=raw["op_type"], const_axes=const_axes, var_axes=tuple(var_axes),
        inputs=inputs, outputs=outputs, constraints=tuple(constraints), reference=raw["reference"],
        description=raw.get("description", ""), tags=tuple(raw.get("tags", ())), raw=raw,
    )
    try:
        run = defn.reference_run()
    except Exception as e:  # the reference is foreign code: any failure is a definition error
        raise DefinitionError(f"{where}: field 'reference': does not execute ({type(e).__name__}: {e})") from None
    _require(callable(run), where, "reference", "must define a callable 'run'")
    params = list(inspect.signature(run).parameters)
    _require(params == list(inputs), where, "reference",
             f"run{tuple(params)} does not take the inputs in order {tuple(inputs)}")
    return defn


PINS = "SHA256SUMS"      # beside the definitions: `sha256sum` lines of every definition file, committed


def load_definition(path: str | Path, pins: str | Path | None = None) -> Definition:
    """The definition at `path`; with `pins` (a sha256sum file), only if the file's bytes hash to the pinned value,
    checked before its reference code is executed."""
    path = Path(path)
    try:
        data = path.read_bytes()
        raw = json.loads(data)
    except FileNotFoundError:
        raise DefinitionError(f"{path}: no such definition file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DefinitionError(f"{path}: not valid JSON ({getattr(e, 'msg', type(e).__name__)})") from None
    if pins is not None:
        _check_pin(path, data, Path(pins))
    defn = parse_definition(raw, str(path))
    defn.path = path
    return defn


def _check_pin(path: Path, data: bytes, pins: Path) -> None:
    key = path.resolve().relative_to(pins.resolve().parent).as_posix()
    recorded = {}
    if pins.is_file():
        for line in pins.read_text().splitlines():
            digest, _, name = line.partition("  ")
            recorded[name.strip()] = digest.strip()
    if key not in recorded:
        raise DefinitionError(f"{path}: not pinned in {pins} (add the line `sha256sum {key}` prints there, "
                              f"from {pins.parent})")
    if hashlib.sha256(data).hexdigest() != recorded[key]:
        raise DefinitionError(f"{path}: sha256 {hashlib.sha256(data).hexdigest()[:12]} differs from the one pinned "
                              f"in {pins} ({recorded[key][:12]}): the contract was changed")


def find_definition(name: str, root: str | Path = "definitions") -> Definition:
    """The definition called `name` under `root` (searched recursively for `<name>.json`), checked against the
    hashes pinned in `root`/SHA256SUMS."""
    matches = sorted(Path(root).rglob(f"{name}.json"))
    if not matches:
        raise DefinitionError(f"{root}: no definition named {name!r}")
    return load_definition(matches[0], Path(root) / PINS)


def default_definition(root: str | Path = "definitions") -> Definition:
    """The only definition under `root` (cli.default_definition): the one a command that names none works on."""
    name = cli.default_definition(root)
    if name is None:
        raise DefinitionError(f"{root}: not exactly one definition here, so none is the default")
    return find_definition(name, root)
