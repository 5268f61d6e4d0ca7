"""Definition-driven harness: definition -> workloads -> solution -> judge / timing -> trace -> report."""
import importlib.abc
import importlib.machinery
import re
import sys

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+")


class HarnessError(Exception):
    """A user-facing error: its message is one line that names the file and the field at fault."""


def one_line(text, limit: int | None = None) -> str:
    """Anything a solution can put into a message (an exception's text, a name, its output) as one printable line:
    control characters (terminal escapes, carriage returns, line separators) as spaces, runs of whitespace as one,
    at most `limit` characters."""
    return " ".join(_CONTROL.sub(" ", str(text)).split())[:limit]


class _SourceLoader(importlib.machinery.SourceFileLoader):
    def get_code(self, fullname):
        path = self.get_filename(fullname)
        return self.source_to_code(self.get_data(path), path)


class _SourceFinder(importlib.abc.MetaPathFinder):
    """The harness's modules (the judge, the operator module) compiled from their sources on every import, never
    loaded from a __pycache__ file that someone else may have written."""

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith(f"{__name__}."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and type(spec.loader) is importlib.machinery.SourceFileLoader:
            spec.loader = _SourceLoader(spec.loader.name, spec.loader.path)
        return spec


if not any(isinstance(f, _SourceFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _SourceFinder())
