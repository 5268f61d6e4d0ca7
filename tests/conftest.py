import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.chdir(ROOT)   # the harness resolves definitions/, solutions/ and workloads/ from the repository root

DEFINITION = "leapquant_kda_flush_r4_int8_h32_v128_k128"


@pytest.fixture(scope="session")
def defn():
    from harness.definition import find_definition
    return find_definition(DEFINITION)


def axes_for(defn, batch_size):
    return defn.resolve_axes({"batch_size": batch_size})
