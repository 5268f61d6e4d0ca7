"""Solutions: `solutions/<name>/solution.json` (FlashInfer-bench Solution fields) and its sources, loaded into a
callable that returns the outputs in definition order. The definition's reference is the built-in `reference`."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable

import torch
from packaging.requirements import InvalidRequirement, Requirement

from harness import HarnessError, sandbox
from harness.definition import Definition
from harness.records import ENTRY_POINT, NAME_PATTERN, SolutionRecord, parse, read_json

REFERENCE = "reference"
NULL = "<null>"             # the harness's own do-nothing solution: the timed loop's overhead


class SolutionError(HarnessError):
    pass


@dataclass
class Solution:
    name: str
    definition: str
    author: str
    language: str
    entry_file: str
    entry_function: str
    destination_passing_style: bool
    target_hardware: tuple[str, ...] = ()
    dependencies: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()
    description: str = ""
    folder: Path | None = None            # None for the built-in reference
    record: SolutionRecord | None = field(default=None, repr=False)      # solution.json as parsed

    @property
    def is_reference(self) -> bool:
        return self.folder is None


    def files(self, defn: Definition) -> list[tuple[str, bytes]]:
        """(path, bytes) of everything that runs: solution.json and the listed sources (the definition's reference
        code for `reference`). Read once: the worker is given exactly these bytes, and their hash."""
        if self.is_reference:
            return [("reference.py", defn.reference.encode())]
        return sandbox.solution_files(self.folder, self.sources)

    def worker_spec(self) -> dict:
        return {"name": self.name, "language": self.language, "entry_file": self.entry_file,
                "entry_function": self.entry_function, "destination_passing_style": self.destination_passing_style,
                "sources": list(self.sources)}


def unmet_needs(sol: Solution, device: str) -> str | None:
    """Why `sol` cannot run here (None when it can): a CUDA solution on a CPU run, or a dependency (a pip
    requirement in solution.json, e.g. "triton == 3.6.0" for a kernel written against one Triton's API) that this
    Python does not satisfy, nor a program of that name on PATH (a build tool such as ninja). A run skips such a
    solution with this reason rather than judging it a failure."""
    if sol.language == "cuda" and device == "cpu":
        return "a CUDA solution needs a GPU"
    for text in sol.dependencies:
        try:
            need = Requirement(text)
        except InvalidRequirement:
            continue                        # not a pip requirement (a tool, a toolkit): nothing to check it against
        if need.marker is not None and not need.marker.evaluate():
            continue
        try:
            have = metadata.version(need.name)
        except metadata.PackageNotFoundError:
            if not need.specifier and shutil.which(need.name):
                continue
            return f"it needs {text}, not installed here"
        if need.specifier and not need.specifier.contains(have, prereleases=True):
            return f"it needs {text}; this machine has {need.name} {have}"
    return None


def source_sha256(sol: Solution, defn: Definition) -> str:
    """Hash of what runs (Solution.files). Traces record it, so the leaderboard can tell rows measured on older
    sources."""
    return sandbox.files_sha256(sol.files(defn))


def reference_solution(defn: Definition) -> Solution:
    return Solution(REFERENCE, defn.name, "definition", "python", "<definition>", "run", False,
                    description="the definition's reference code")


def is_reference(sol: Solution) -> bool:
    """Whether sol is the definition's own reference (the yardstick, run for its times), not a solution folder."""
    return sol.name == REFERENCE and sol.folder is None


def null_solution(defn: Definition) -> Solution:
    return Solution(NULL, defn.name, "harness", "python", "<harness>", "run", True,
                    description="outputs allocated and left as they are: the timed loop without a flush")


def parse_solution(raw, where: str, folder: Path) -> Solution:
    """Validate a decoded solution.json (harness.records.SolutionRecord) against its folder."""
    record = parse(SolutionRecord, raw, where, SolutionError)
    if record.name != folder.name:
        raise SolutionError(f"{where}: field 'name': is {record.name!r} but the folder is {folder.name!r}")
    for i, source in enumerate(record.sources):
        problem = sandbox.source_problem(folder, source.path)
        if problem:
            raise SolutionError(f"{where}: field 'sources[{i}].path': {problem}")
    entry_file, entry_function = ENTRY_POINT.fullmatch(record.spec.entry_point).groups()
    spec = record.spec
    return Solution(record.name, record.definition, record.author, spec.language, entry_file, entry_function,
                    spec.destination_passing_style, tuple(spec.target_hardware), tuple(spec.dependencies),
                    tuple(s.path for s in record.sources), record.description or "", folder, record)


def load_solution(name: str, defn: Definition, root: str | Path) -> Solution:
    """The solution `name` (a folder under `root`, a project's solutions/, or "reference"), its record checked."""
    if name == REFERENCE:
        return reference_solution(defn)
    if not re.fullmatch(NAME_PATTERN, name):
        raise SolutionError(f"solution {name!a}: not a solution name (a letter or digit, then letters, digits, "
                            "'_', '.' or '-', at most 64)")
    folder = Path(root) / name
    path = folder / "solution.json"
    if not path.is_file():
        known = sorted(p.parent.name for p in Path(root).glob("*/solution.json"))
        raise SolutionError(f"{path}: no such solution (known: {', '.join([REFERENCE] + known)})")
    problem = sandbox.source_problem(folder, "solution.json")
    if problem:
        raise SolutionError(f"solution {name}: {problem}")
    sol = parse_solution(read_json(path, SolutionError), str(path), folder)
    if sol.definition != defn.name:
        raise SolutionError(f"{path}: field 'definition': is {sol.definition!r}, expected {defn.name!r}")
    return sol


def discover(defn: Definition, root: str | Path) -> list[str]:
    """Names of the solutions for `defn`: the reference first, then the folders under `root`, sorted."""
    names = []
    for p in sorted(Path(root).glob("*/solution.json")):
        try:
            if json.loads(p.read_text()).get("definition") == defn.name:
                names.append(p.parent.name)
        except (json.JSONDecodeError, AttributeError):
            names.append(p.parent.name)     # let load_solution report it
    return [REFERENCE] + names


def load_module(sol: Solution, path: str):
    """Import one Python source of a solution folder (its entry file, or another such as a deployment form), with
    the folder on sys.path so that it imports its siblings. Raises whatever the import raises."""
    if sol.is_reference or path not in sol.sources:
        raise SolutionError(f"{sol.name}: no source {path!r} (sources: {', '.join(sol.sources) or 'none'})")
    folder = str(sol.folder.resolve())
    if folder not in sys.path:
        sys.path.insert(0, folder)       # multi-file solutions import their siblings
    for source in sol.sources:
        # siblings are imported afresh from this folder, not taken from a module of that name cached by an earlier
        # load (of this folder's older files or of another solution's)
        sys.modules.pop(Path(source).stem, None)
    module_name = f"solution_{sol.name}_{Path(path).stem}"
    spec = importlib.util.spec_from_file_location(module_name, sol.folder / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def load_entry(sol: Solution, defn: Definition) -> Callable[..., tuple[torch.Tensor, ...]]:
    """Import the solution's entry point and wrap it as call(inputs, axes, fill=True) -> the outputs in definition
    order; a destination-passing call gets its outputs poisoned first unless fill is False (the timed loop poisons
    them itself, outside the timed region). Raises whatever the import raises: the caller reports it as
    COMPILE_ERROR."""
    if sol.name == NULL:
        def null_call(inputs: dict, axes: dict, fill: bool = True):
            device = next(iter(inputs.values())).device
            outs = tuple(torch.empty(defn.shape(s, axes), dtype=s.torch_dtype, device=device)
                         for s in defn.outputs.values())
            # every output written, as a solution's kernel writes them: the timed loop's preparation of the next
            # call measured ~15 us slower after a call that wrote its outputs than after one that did not
            for t in outs:
                t.zero_()
            return outs
        return null_call
    if sol.is_reference:
        fn, dps = defn.reference_run(), False
    else:
        module = load_module(sol, sol.entry_file)
        fn = getattr(module, sol.entry_function, None)
        if not callable(fn):
            raise AttributeError(f"{sol.entry_file} defines no function {sol.entry_function!r}")
        dps = sol.destination_passing_style
    if not dps:
        def call(inputs: dict, axes: dict, fill: bool = True):
            try:
                out = fn(*inputs.values())
            except TypeError as e:
                if f"missing {len(defn.outputs)} required positional argument" in str(e):
                    raise TypeError(f"{e}: it takes the outputs too, so it writes them: set "
                                    "\"destination_passing_style\": true in solution.json") from None
                raise
            return tuple(out) if isinstance(out, (tuple, list)) else (out,)
        return call

    def call_dps(inputs: dict, axes: dict, fill: bool = True):
        device = next(iter(inputs.values())).device
        outs = tuple(torch.empty(defn.shape(s, axes), dtype=s.torch_dtype, device=device)
                     for s in defn.outputs.values())
        if fill:            # NaN (the type's minimum for integers): an output left unwritten cannot pass
            for t in outs:
                t.fill_(float("nan") if t.is_floating_point() else torch.iinfo(t.dtype).min)
        try:
            fn(*inputs.values(), *outs)
        except TypeError as e:
            if f"{len(inputs) + len(outs)} were given" in str(e):
                raise TypeError(f"{e}: it takes the {len(inputs)} inputs only, so it returns its outputs: set "
                                "\"destination_passing_style\": false in solution.json") from None
            raise
        return outs
    return call_dps
