import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _honest import flush  # noqa: E402


def run(*inputs):
    out = flush(*inputs)
    inputs[0].zero_()
    return out
