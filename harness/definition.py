"""Load and validate a FlashInfer-bench Definition: axes, typed tensor specs, constraints, the reference `run`."""
from __future__ import annotations

import hashlib
import inspect
from pathlib import Path
from typing import Any, Callable

from pydantic import Field, PrivateAttr

from harness import HarnessError
from harness.project import Project
from harness.records import DefinitionRecord, TensorSpec, decode_json, parse

class DefinitionError(HarnessError):
    pass


class Definition(DefinitionRecord):
    """A parsed definition (harness.records.DefinitionRecord, FlashInfer-bench's JSON) and what the harness derives
    from it: its const and var axes, shapes, the checked constraints and the reference `run`."""
    path: Path | None = Field(default=None, exclude=True)
    _reference_run: Callable | None = PrivateAttr(default=None)

    @property
    def const_axes(self) -> dict[str, int]:
        return {a: spec.value for a, spec in self.axes.items() if spec.type == "const"}

    @property
    def var_axes(self) -> tuple[str, ...]:
        return tuple(a for a, spec in self.axes.items() if spec.type == "var")

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


def parse_definition(raw: Any, where: str) -> Definition:
    """Validate a decoded definition JSON; `where` names its source in error messages."""
    defn = parse(Definition, raw, where, DefinitionError)
    try:
        run = defn.reference_run()
    except Exception as e:  # the reference is foreign code: any failure is a definition error
        raise DefinitionError(f"{where}: field 'reference': does not execute ({type(e).__name__}: {e})") from None
    if not callable(run):
        raise DefinitionError(f"{where}: field 'reference': must define a callable 'run'")
    params = list(inspect.signature(run).parameters)
    if params != list(defn.inputs):
        raise DefinitionError(f"{where}: field 'reference': run{tuple(params)} does not take the inputs in order "
                              f"{tuple(defn.inputs)}")
    return defn


PINS = "SHA256SUMS"      # beside the definitions: `sha256sum` lines of every definition file, committed


def load_definition(path: str | Path, pins: str | Path | None = None) -> Definition:
    """The definition at `path`; with `pins` (a sha256sum file), only if the file's bytes hash to the pinned value,
    checked before its reference code is executed."""
    path = Path(path)
    if not path.is_file():
        raise DefinitionError(f"{path}: no such definition file")
    data = path.read_bytes()
    if pins is not None:
        _check_pin(path, data, Path(pins))
    defn = parse_definition(decode_json(data, str(path), DefinitionError), str(path))
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


def find_definition(name: str, root: str | Path) -> Definition:
    """The definition called `name` under `root` (a project's definitions/, searched recursively for `<name>.json`),
    checked against the hashes pinned in `root`/SHA256SUMS."""
    matches = sorted(Path(root).rglob(f"{name}.json"))
    if not matches:
        raise DefinitionError(f"{root}: no definition named {name!r}")
    return load_definition(matches[0], Path(root) / PINS)


def project_definition(project: Project, name: str | None = None) -> Definition:
    """The project's definition called `name`; without a name its only one (Project.default_definition_name), the
    one a command that names none works on."""
    name = name or project.default_definition_name()
    if name is None:
        raise DefinitionError(f"{project.definitions}: not exactly one definition here, so none is the default: "
                              f"name one with --definition")
    return find_definition(name, project.definitions)
