"""A project and the settings of its runs.

`Project` names every file a command reads or writes: definitions/, solutions/, workloads/, traces/, LEADERBOARD.md
and its plot, the search's failures and database. Commands take `--project DIR`; without it the project is found
from the working directory upward (as git finds a repository), else it is the checkout the harness is installed
from, so a command run from any folder of the checkout, or from outside it, reads the same files. The library
functions below the commands take these paths as arguments and resolve none themselves.

`Settings` holds every figure that shapes a run: timeouts, warm-up, the number of timed calls and repeats, and the
copy rate that prices the memory floor. One object travels from the command line down to the timer (and into the
worker, for the parts that run there), so a competition file can fill it in one place.
"""
from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from harness import HarnessError

MARKER = "definitions"      # the folder that makes a folder a project
LEADERBOARD_FILE = "LEADERBOARD.md"
PLOT_FILE = "leaderboard.png"   # beside the leaderboard, which links it by this name


class ProjectError(HarnessError):
    pass


class SettingError(ProjectError, ValueError):
    """A setting out of range (a ValueError too, so that a competition file's validation names its key)."""


def write_file(path: str | Path, text: str) -> None:
    """Replace the file at `path` with `text` in one step (a temporary file beside it, then a rename), so that a full
    disk or a crash leaves the old file whole rather than a truncated one; ProjectError with one line when it cannot
    be written."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "wt") as f:
                f.write(text)
            os.chmod(tmp, 0o644)            # mkstemp's 0600 is for the half-written file only
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        raise ProjectError(f"{path}: cannot be written ({e.strerror or type(e).__name__})") from None


@dataclass(frozen=True)
class Project:
    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root).resolve())

    @classmethod
    def at(cls, root: str | Path) -> Project:
        """The project whose root is `root` (it must hold definitions/)."""
        project = cls(root)
        if not project.definitions.is_dir():
            raise ProjectError(f"{project.root}: not a project (no {MARKER}/ folder)")
        return project

    @classmethod
    def find(cls, start: str | Path | None = None) -> Project:
        """The nearest folder at or above `start` (default: the working directory) that holds definitions/; else
        the checkout this harness package sits in, when it holds one (an editable install)."""
        here = Path.cwd() if start is None else Path(start).resolve()
        for folder in (here, *here.parents):
            if (folder / MARKER).is_dir():
                return cls(folder)
        checkout = Path(__file__).resolve().parents[1]
        if (checkout / MARKER).is_dir():
            return cls(checkout)
        raise ProjectError(f"{here}: no {MARKER}/ folder here or above, and the harness is not installed from a "
                           f"project: give --project DIR")

    @property
    def definitions(self) -> Path:
        return self.root / MARKER

    @property
    def solutions(self) -> Path:
        return self.root / "solutions"

    @property
    def workloads(self) -> Path:
        return self.root / "workloads"

    @property
    def traces(self) -> Path:
        return self.root / "traces"

    @property
    def leaderboard(self) -> Path:
        return self.root / LEADERBOARD_FILE

    @property
    def plot(self) -> Path:
        return self.root / PLOT_FILE

    @property
    def stress_failures(self) -> Path:
        return self.root / "stress_failures"

    @property
    def competition_file(self) -> Path:
        return self.root / "competition.yaml"

    @property
    def stress_database(self) -> Path:
        return self.root / ".hypothesis" / "stress"

    def workload_file(self, defn) -> Path:
        """The workload lines of a definition: workloads/<op_type>/<name>.jsonl."""
        return self.workloads / defn.op_type / f"{defn.name}.jsonl"

    def definition_names(self) -> set[str]:
        return {path.stem for path in self.definitions.rglob("*.json")}

    def default_definition_name(self) -> str | None:
        """The definition a command works on when none is named: the only one in the project, so that no
        operator's name is written into the harness; None when there are several (or none)."""
        names = self.definition_names()
        return names.pop() if len(names) == 1 else None


@dataclass(frozen=True)
class Settings:
    timeout_s: float = 300.0            # seconds a worker may take over one request before TIMEOUT
    warmup_replays: int = 3             # untimed replays of each captured graph before the timed loop
    min_calls: int = 20                 # timed calls per workload: at least this many ...
    max_calls: int = 400                # ... at most this many ...
    timed_programs: int = 1 << 17       # ... and otherwise enough to run this many programs (and loop time for the
                                        # clock check)
    pool_programs: int = 2048           # the fewest programs a fresh pool holds: small batches draw from a larger one
    calibration_repeats: int = 3        # timed null loops per shape (their median is the overhead)
    clock_attempts: int = 2             # timed loops a workload gets before the clock check's refusal stands: a
                                        # hiccup of the harness's own process (ms long) is rare and does not repeat,
                                        # work moved out of the timed events does
    replay_warmup: int = 5              # the deployment benchmark: untimed replays, then ...
    replay_calls: int = 50              # ... timed replays, of which the median is taken
    bandwidth: float | None = None      # bytes/s that price the memory floor; None: measured once per run

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "bandwidth" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                    or not math.isfinite(value):
                raise SettingError(f"setting {field.name}: {value!r} is not a positive number")
        if self.min_calls > self.max_calls:
            raise SettingError(f"setting min_calls: {self.min_calls} is above max_calls {self.max_calls}")

    def timed_calls(self, n_programs: int) -> int:
        """Timed calls for a workload of `n_programs` programs a call."""
        return min(self.max_calls, max(self.min_calls, math.ceil(self.timed_programs / n_programs)))

    def replace(self, **changes) -> Settings:
        return dataclasses.replace(self, **changes)
