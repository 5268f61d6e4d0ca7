"""Operator modules: everything specific to one `op_type` (input families, decode, criterion) lives in
`harness/ops/<op_type>.py`. The generic core reaches them only through `load_op` and this interface:

    FAMILIES: tuple[str, ...]
    FAMILY_BATCH_SIZES: dict[str, tuple[int, ...]]   # families committed at fewer than the default batch sizes
    make_inputs(family, axes, seed, device, params=None) -> dict[str, Tensor]   # pure function of its arguments;
                                                                 # ValueError for params the family does not take
    judge(inputs, outputs, reference_outputs) -> Verdict         # outputs already shape/dtype checked
    STRESS_FAMILY, PROGRAM_GRAMMAR, CALL_GRAMMAR                 # harness.stress: the family whose params
                                                                 # {"programs": [...], "call": {...}} name, per
                                                                 # program and per call, an option of each axis
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from types import ModuleType

from harness import HarnessError


@dataclass
class Verdict:
    passed: bool
    reason: str                                   # one line; empty when passed
    worst_head_ratio: float | None                # max over judged heads of err_candidate / err_reference
    max_absolute_error: float
    max_relative_error: float
    extra: dict = field(default_factory=dict)     # op-specific figures that go into the trace


def load_op(op_type: str) -> ModuleType:
    if not re.fullmatch(r"[a-z][a-z0-9_]*", op_type):
        raise HarnessError(f"op_type {op_type!r} is not a module name")
    try:
        return importlib.import_module(f"harness.ops.{op_type}")
    except ModuleNotFoundError as e:
        if e.name == f"harness.ops.{op_type}":
            raise HarnessError(f"no operator module harness/ops/{op_type}.py for op_type {op_type!r}") from None
        raise
