"""scripts/reference_reorder.py: the reference with its fp32 operations reordered (or in fp64), judged against itself
by the harness's judge on the committed workloads and on fresh ones (--seed)."""
import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("reference_reorder",
                                              Path(__file__).parents[1] / "scripts" / "reference_reorder.py")
reference_reorder = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reference_reorder)


@pytest.mark.parametrize("seed", [[], ["--seed", "1"]], ids=["committed", "fresh"])
def test_every_variant_is_judged_and_the_unchanged_reference_matches_itself(capsys, seed):
    assert reference_reorder.main(["--batch-sizes", "1", "--families", "edge,random", *seed]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:-1]]
    assert len(rows) == 2 * len(reference_reorder.VARIANTS)
    again = [r for r in rows if "again" in r]
    assert len(again) == 2 and all(r[-2:] == ["1.0000", "PASSED"] for r in again)
    # the reorderings and the fp64 form are other runs of the same math: judged, and on these heads within 1%
    assert all(r[-1] == "PASSED" and 0.99 < float(r[-2]) < 1.01 for r in rows)

