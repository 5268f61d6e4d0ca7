"""Operator packages: everything specific to one `op_type` (input families, decode, criterion, the words for its
concepts) lives in `harness/ops/<op_type>/`. The generic core reaches an operator only through `load_op`, which
returns it as an `Operator`: the names below are all the core may use, and a package lacking one does not load."""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol

from harness import HarnessError


@dataclass
class Verdict:
    passed: bool
    reason: str                                   # one line; empty when passed
    score: float | None                           # the operator's headline figure (WORDING.score_*), higher is
                                                  # worse; None when the inputs leave nothing to score
    max_absolute_error: float
    max_relative_error: float
    extra: dict = field(default_factory=dict)     # op-specific figures that go into the trace


@dataclass(frozen=True)
class Wording:
    """The operator's words in the harness's output, so that the core names none of its concepts."""
    score_key: str          # Verdict.score's key in Verdict.extra, and so in traces and in the stress and drift records
    score_label: str        # Verdict.score's column header
    score_of: str           # what Verdict.score is the worst of, in drift's progress lines
    batch_unit: str         # the programs of one batch element, formatted with the definition's axes
    stress_subject: str     # what the stress grammar draws, in the leaderboard
    drift_intro: str        # the leaderboard's paragraph on the drift records
    deployment_intro: str   # the leaderboard's paragraph on the deployment records


class Operator(Protocol):
    """What an operator package provides; harness/ops/leapquant_kda_flush/ is the one there is."""

    FAMILIES: tuple[str, ...]
    FAMILY_BATCH_SIZES: dict[str, tuple[int, ...]]      # families committed at fewer than the default batch sizes
    # harness.stress: the family whose params {"programs": [...], "call": {...}} name, per program and per call, an
    # option of each axis of these grammars (the first option of each the plainest)
    STRESS_FAMILY: str
    PROGRAM_GRAMMAR: dict[str, tuple]
    CALL_GRAMMAR: dict[str, tuple]
    DRIFT_LIMIT: float                                  # harness.drift: the most a window's error ratio may be
    # the deployment form (harness.deploy, harness.deploy_bench): Pool(num_slots, device) holds the CHECKPOINT and
    # WINDOW fields and `count` per slot; a flush writes WINDOW_RESET into the windows it flushed; a sequence is due
    # for a flush every `DUE_EVERY` (an axis of the definition) decode steps; the inputs POOL_CALL_ARGS, not kept in
    # the pool, are the call's arguments after pool and idx
    Pool: type
    DUE_EVERY: str
    POOL_CALL_ARGS: tuple[str, ...]
    CHECKPOINT: tuple[str, ...]
    WINDOW: tuple[str, ...]
    WINDOW_RESET: dict[str, float]
    WORDING: Wording

    def make_inputs(self, family: str, axes: dict, seed: int, device: Any = "cpu",
                    params: dict | None = None) -> dict:
        """A pure function of its arguments; ValueError for params the family does not take."""

    def judge(self, inputs: dict, outputs: tuple, reference_outputs: tuple, reference_code: str | None = None, *,
              yardstick: bool = False) -> Verdict:
        """Outputs already shape and dtype checked; reference_code is the definition's (the operator may run it in
        other, equivalent forms). A failed verdict may name the failing program's index over the program axes as
        extra["program"] (the timer then keeps that batch element's inputs). yardstick: the outputs are the
        definition's reference's own, judged only where the reference is a valid yardstick of itself."""

    # harness.timing: the batched inputs in groups (every one in exactly one), each moved by a symmetry of its own in
    # a timed call, and taken from pool programs drawn apart in INDEPENDENT_PARTS_FAMILIES: work that depends on two
    # groups cannot be done on the pool before the schedule is known, since they meet only in the timed call
    PROGRAM_PARTS: tuple[tuple[str, ...], ...]
    # the families whose parts are drawn independently inside the domain, so that any two make a program of the
    # family; a timed program of any other family takes all its parts from one pool program (parts drawn together,
    # such as a state scaled into the domain as a whole, leave it when mixed)
    INDEPENDENT_PARTS_FAMILIES: frozenset[str]

    def draw_variants(self, n: int, parts: int, axes: dict, generator: Any) -> dict:
        """harness.timing: the parameters of n x parts symmetries (one for each part of each timed call, related
        as the operator needs to keep the family's structure), drawn from generator: tensors [n, parts, ...]."""

    def apply_variant(self, x: dict, variant: dict) -> dict:
        """harness.timing: the inputs x (any subset of the definition's: one part's) under one symmetry."""

    def parts_movable(self, x: dict) -> Any:
        """harness.timing: per program of x (its batched inputs, any leading dims), whether its parts stay in the
        domain whatever symmetries move them apart; where not, a timed program moves them all by one. A pure
        function of x on one device (the worker and the harness must agree)."""

    def drift(self, flush: Callable, reference: Callable, axes: dict, windows: int, seed: int,
              device: Any = "cpu") -> Iterator[dict]:
        """harness.drift: per window {"window", "error", "reference_error", "ratio", WORDING.score_key}."""

    def check_idx(self, pool: Any, idx: Any) -> None:
        """The caller's contract on a deployment call's slots; ValueError in one line."""


REQUIRED = tuple(sorted({*Operator.__annotations__, *(n for n in vars(Operator) if not n.startswith("_"))}))


def load_op(op_type: str) -> Operator:
    if not re.fullmatch(r"[a-z][a-z0-9_]*", op_type):
        raise HarnessError(f"op_type {op_type!r} is not a module name")
    try:
        module = importlib.import_module(f"harness.ops.{op_type}")
    except ModuleNotFoundError as e:
        if e.name == f"harness.ops.{op_type}":
            raise HarnessError(f"no operator package harness/ops/{op_type}/ for op_type {op_type!r}") from None
        raise
    missing = [name for name in REQUIRED if not hasattr(module, name)]
    if missing:
        raise HarnessError(f"operator {op_type!r} does not provide {', '.join(missing)} (harness.ops.Operator)")
    return module
