"""competition.yaml at the project's root: the competition in one file. The definitions in play, the workloads a plain
`harness.run` judges, the ranking (which workloads count, the score, the gates a solution must pass to be ranked)
and the run's Settings (timeouts, warm-up, timed calls, ...). `harness.run`, `harness.report` and the other commands
read it; their flags override it. Without the file every default holds. A malformed file is one line naming the
key."""
from __future__ import annotations

from typing import Annotated, Literal

import yaml
from pydantic import Field, field_validator

from harness import HarnessError
from harness.project import Project, Settings
from harness.records import NonEmpty, Strict, parse

BatchSize = Annotated[int, Field(ge=1, strict=True)]
GATES = ("workloads", "stress")


class CompetitionError(HarnessError):
    pass


class Selection(Strict):
    """Workloads by batch size and family; None: all."""
    batch_sizes: list[BatchSize] | None = None
    families: list[NonEmpty] | None = None

    @field_validator("batch_sizes", "families")
    @classmethod
    def _not_empty(cls, value):
        if value is not None and not value:
            raise ValueError("an empty list: leave the key out (or null) for all")
        return value


class Ranking(Selection):
    """How the leaderboard ranks solutions on each hardware: by `score` over the selected workloads, only those
    that pass every gate. workloads: every selected workload PASSED on the solution's current sources (its committed
    and fresh inputs, and on a GPU every timed call); stress: a clean `harness.stress --record` on them, on a GPU,
    of at least `stress_examples` examples drawn at batch sizes up to at least `stress_batch_size` (a search at one
    small batch size would judge a path the ranking never times)."""
    score: Literal["geomean_speedup"] = "geomean_speedup"
    gates: list[Literal[GATES]] = list(GATES)
    stress_examples: Annotated[int, Field(gt=0, strict=True)] = 300
    stress_batch_size: Annotated[int, Field(gt=0, strict=True)] = 512


class Competition(Strict):
    definitions: list[NonEmpty] | None = None       # None: every definition of the project
    run: Selection = Selection()                    # what `harness.run` judges without --batch-sizes / --families
    ranking: Ranking = Ranking()
    settings: Settings = Settings()


def load_competition(project: Project) -> Competition:
    """The project's competition.yaml, checked; the defaults when there is none."""
    path = project.competition_file
    if not path.exists():
        return Competition()
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise CompetitionError(f"{path}: not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
    return parse(Competition, {} if raw is None else raw, str(path), CompetitionError)
