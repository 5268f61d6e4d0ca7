"""The records the harness reads and writes, as pydantic models whose JSON is FlashInfer-bench's (Definition,
Solution, Workload, Trace; `tests/test_export.py` reads them back with flashinfer_bench.data), plus the harness's
own extensions: a workload line's family, seed and content hash, a trace's source hash and sandbox, and the drift,
stress and deployment records. Every file is parsed through `parse`, which turns the first validation error into one
line naming the field; `load_*` in definition.py, solutions.py, workloads.py and traces.py are the entry points."""
from __future__ import annotations

import ast
import json
import re
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import torch
from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StringConstraints, ValidationError, field_validator,
                      model_validator)

from harness import HarnessError

NonEmpty = Annotated[str, StringConstraints(min_length=1)]
# a solution's name is a folder name, a file name under traces/ and a table cell: no separators, no control
# characters, no markdown
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
SolutionName = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
NonNegative = Annotated[int, Field(ge=0, strict=True)]
DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int64", "int32",
               "int16", "int8", "uint8", "bool")       # FlashInfer-bench's names: torch's, without "torch."


class EvaluationStatus(str, Enum):
    """FlashInfer-bench's statuses: one per (solution, workload)."""
    PASSED = "PASSED"
    INCORRECT_SHAPE = "INCORRECT_SHAPE"
    INCORRECT_NUMERICAL = "INCORRECT_NUMERICAL"
    INCORRECT_DTYPE = "INCORRECT_DTYPE"
    RUNTIME_ERROR = "RUNTIME_ERROR"
    COMPILE_ERROR = "COMPILE_ERROR"
    TIMEOUT = "TIMEOUT"

    def __str__(self) -> str:
        return self.value


class Record(BaseModel):
    """Fields FlashInfer-bench may add later are kept as they are (extra="allow"); a wrong type is an error."""
    model_config = ConfigDict(extra="allow")

    def to_json(self) -> dict:
        return self.model_dump(mode="json", exclude_none=True)


class Strict(Record):
    """A record written by hand for this harness: an unknown key is a typo, so it is an error."""
    model_config = ConfigDict(extra="forbid")


# ---- Definition --------------------------------------------------------------------------------------------------

class AxisSpec(Record):
    type: Literal["const", "var"]
    value: NonNegative | None = None
    description: str | None = None


class TensorSpec(Record):
    model_config = ConfigDict(extra="allow", frozen=True)
    shape: tuple[str, ...]
    dtype: Literal[DTYPE_NAMES]
    description: str | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


class DefinitionRecord(Record):
    name: NonEmpty
    op_type: NonEmpty
    axes: Annotated[dict[str, AxisSpec], Field(min_length=1)]
    inputs: Annotated[dict[str, TensorSpec], Field(min_length=1)]
    outputs: Annotated[dict[str, TensorSpec], Field(min_length=1)]
    reference: Annotated[str, StringConstraints(strip_whitespace=False, min_length=1, pattern=r"\S")]
    constraints: list[str] = []
    description: str = ""
    tags: list[str] = []

    @model_validator(mode="after")
    def _names_are_declared(self):
        for name, axis in self.axes.items():
            if axis.type == "const" and axis.value is None:
                raise FieldError(f"axes.{name}.value", "a const axis needs a non-negative integer value")
        for kind in ("inputs", "outputs"):
            for name, spec in getattr(self, kind).items():
                unknown = [a for a in spec.shape if a not in self.axes]
                if unknown:
                    raise FieldError(f"{kind}.{name}.shape",
                                     f"unknown axis {unknown[0]!r} (declared: {sorted(self.axes)})")
        both = sorted(set(self.inputs) & set(self.outputs))
        if both:
            raise FieldError("outputs", f"names also used by inputs: {both}")
        for c in self.constraints:
            try:
                names = {n.id for n in ast.walk(ast.parse(c, mode="eval")) if isinstance(n, ast.Name)}
            except SyntaxError as e:
                raise FieldError("constraints", f"{c!r} is not an expression ({e.msg})") from None
            if not names <= set(self.axes):
                raise FieldError("constraints", f"{c!r} uses unknown names {sorted(names - set(self.axes))}")
        return self


# ---- Solution ----------------------------------------------------------------------------------------------------

LANGUAGES = ("python", "triton", "cuda")
ENTRY_POINT = re.compile(r"([\w./-]+\.py)::([A-Za-z_]\w*)")


class SourceFile(Record):
    path: NonEmpty
    content: str | None = None      # FlashInfer-bench carries the file inline; a solution folder has it on disk

    @field_validator("path")
    @classmethod
    def _inside(cls, p: str) -> str:
        if Path(p).is_absolute() or ".." in Path(p).parts:
            raise ValueError(f"{p!r} must be a relative path inside the folder")
        return p


class BuildSpec(Strict):
    language: Literal[LANGUAGES]
    target_hardware: list[str] = []
    entry_point: Annotated[str, StringConstraints(pattern=ENTRY_POINT.pattern)]
    dependencies: list[str] = []
    destination_passing_style: StrictBool = True
    binding: str | None = None


class SolutionRecord(Strict):
    name: SolutionName
    definition: NonEmpty
    author: NonEmpty
    description: str | None = None
    spec: BuildSpec
    sources: Annotated[list[SourceFile], Field(min_length=1)]

    @model_validator(mode="after")
    def _entry_among_sources(self):
        entry = ENTRY_POINT.fullmatch(self.spec.entry_point).group(1)
        if entry not in [s.path for s in self.sources]:
            raise FieldError("spec.entry_point", f"{entry!r} is not among the sources")
        return self


# ---- Workload ----------------------------------------------------------------------------------------------------

class SafetensorsInput(Strict):
    type: Literal["safetensors"]
    path: NonEmpty
    tensor_key: NonEmpty


class WorkloadSpec(Strict):
    """FlashInfer-bench's Workload, with how this harness made it: the family and seed its blob is generated from,
    the generator's params (a search's reproducer) and the sha256 of the blob's tensors."""
    uuid: NonEmpty
    axes: dict[str, NonNegative]
    inputs: dict[str, SafetensorsInput]
    family: NonEmpty
    seed: Annotated[int, Field(strict=True)]
    sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
    params: dict[str, Any] = {}

    @field_validator("inputs")
    @classmethod
    def _one_blob(cls, inputs: dict) -> dict:
        if len({s.path for s in inputs.values()}) > 1:
            raise ValueError("all inputs must share one blob")
        return inputs


class WorkloadLine(Strict):
    """One line of workloads/<op_type>/<definition>.jsonl: a Trace with no solution and no evaluation."""
    definition: NonEmpty
    workload: WorkloadSpec
    solution: None = None
    evaluation: None = None


# ---- Trace -------------------------------------------------------------------------------------------------------

class Correctness(Record):
    max_relative_error: float = 0.0
    max_absolute_error: float = 0.0
    extra: dict[str, Any] | None = None


class Performance(Record):
    latency_ms: Annotated[float, Field(ge=0)] = 0.0
    reference_latency_ms: Annotated[float, Field(ge=0)] = 0.0
    speedup_factor: Annotated[float, Field(ge=0)] = 0.0
    floor_ms: float | None = None       # every byte once at the measured copy rate (the leaderboard's x floor)
    clock: dict[str, Any] | None = None  # the timed loop against the harness's own clock


class Environment(Record):
    hardware: NonEmpty
    libs: dict[str, str] = {}
    sandbox: str | None = None          # how the solution was isolated (harness.sandbox)
    gpu_other_processes: list[Any] | None = None
    device: str | None = None           # where it ran ("cuda:1" in a run over several GPUs)


class Evaluation(Record):
    status: EvaluationStatus
    environment: Environment
    timestamp: NonEmpty
    log: str = ""
    correctness: Correctness | None = None
    performance: Performance | None = None


class TraceWorkload(Record):
    uuid: NonEmpty
    axes: dict[str, NonNegative]
    inputs: dict[str, SafetensorsInput]


class Trace(Record):
    definition: NonEmpty
    workload: TraceWorkload
    solution: NonEmpty
    solution_sha256: str | None = None  # of what ran (harness.solutions.source_sha256)
    evaluation: Evaluation

    @property
    def hardware(self) -> str:
        return self.evaluation.environment.hardware


# ---- the harness's own records: traces/<definition>/<kind>_<solution>.json ------------------------------------------

class SolutionRun(Record):
    """What every record of a solution's run says: which sources ran (their hash) and where."""
    definition: NonEmpty
    solution: NonEmpty
    solution_sha256: str | None = None
    environment: Environment


class DriftWindow(Record):
    window: NonNegative
    error: float
    reference_error: float
    ratio: float


class DriftRecord(SolutionRun):
    """`python -m harness.drift --record`: one row per window, the worst of them, the limit on its ratio; a window's
    row also carries the operator's score (Wording.score_key)."""
    windows: NonNegative
    batch_size: NonNegative
    seed: int
    limit: float
    worst: DriftWindow
    rows: list[DriftWindow]


class StressFailure(Record):
    """One distinct failure (its score under Wording.score_key) and the workload file that replays it (relative to
    the project's root when inside it); the example's var axes, with params and seed, rebuild it without that file."""
    status: EvaluationStatus
    log: str
    params: dict[str, Any]
    seed: int
    axes: dict[str, int] = {}
    reproducer: str


class StressRecord(SolutionRun):
    """`python -m harness.stress --record`."""
    examples: NonNegative
    calls: NonNegative
    batch_size: NonNegative
    seed: int | None = None
    hypothesis: str
    seconds: float
    timestamp: NonEmpty
    failures: list[StressFailure]


class DeployRow(Record):
    case: NonEmpty
    batch_size: NonNegative
    due_programs: NonNegative
    median_us: float
    floor_us: float | None = None
    x_floor: float | None = None
    target_us: float | None = None
    checked: bool
    status: EvaluationStatus | None = None     # with log: absent in records made before they were kept
    log: str = ""


class DeployRecord(SolutionRun):
    """`python -m harness deploy`: the deployment form's cases."""
    sandbox: str | None = None          # how the solution was isolated (absent in records made before the sandbox)
    family: NonEmpty
    copy_bandwidth: float
    bytes_per_program: NonNegative
    timed_calls: NonNegative
    empty_graph_us: float | None = None
    rows: list[DeployRow]


RECORDS = {"drift": DriftRecord, "stress": StressRecord, "deploy": DeployRecord}


# ---- parsing -----------------------------------------------------------------------------------------------------

class FieldError(ValueError):
    """Raised inside a validator that knows the field better than its position does."""
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field, self.message = field, message


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], raw: Any, where: str, error: type[HarnessError] = HarnessError) -> M:
    """`raw` as a `model`, or `error` with one line: "<where>: field '<dotted.path>': <what is wrong>"."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        cause = first.get("ctx", {}).get("error")
        if isinstance(cause, FieldError):
            field, message = cause.field, cause.message
        else:
            field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".")
            message = first["msg"].removeprefix("Value error, ")
            if first["type"] == "missing":
                message = "missing"
            elif first["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
                message = "unknown field (a typo?)"
        raise error(f"{where}: field '{field or '<root>'}': {message}") from None


def decode_json(data: bytes | str, where: str, error: type[HarnessError] = HarnessError) -> Any:
    """A file's or a line's bytes decoded, or `error` with one line naming `where`."""
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        at = f" ({e.msg}, line {e.lineno} column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
        raise error(f"{where}: not valid JSON{at}") from None


def read_json(path: Path, error: type[HarnessError] = HarnessError) -> Any:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    return decode_json(data, str(path), error)
