"""Definition loading: the shipped contract, axis resolution, and one clear line for each malformed field."""
import json

import pytest

from conftest import PROJECT
from harness.definition import DefinitionError, find_definition, load_definition

SHIPPED = PROJECT.definitions / "leapquant_kda_flush" / "leapquant_kda_flush_r4_int8_h32_v128_k128.json"


def test_shipped_definition_is_the_shared_contract(defn):
    shared = PROJECT.root.parent / "shared" / "definition" / SHIPPED.name
    if shared.exists():
        assert shared.read_text() == SHIPPED.read_text()
    assert defn.op_type == "leapquant_kda_flush"
    assert defn.var_axes == ("batch_size",)
    assert list(defn.inputs) == ["codes", "s_k", "s_v", "u", "q", "kbuf", "ubuf", "gbuf", "w", "pcum", "q0"]
    assert list(defn.outputs) == ["codes_new", "s_k_new", "s_v_new", "u_new", "q_new"]


def test_resolve_axes(defn):
    axes = defn.resolve_axes({"batch_size": 3})
    assert axes == {"batch_size": 3, "num_heads": 32, "value_dim": 128, "key_dim": 128, "window": 16, "rank": 4}
    assert defn.shape(defn.inputs["codes"], axes) == (3, 32, 128, 128)
    with pytest.raises(DefinitionError, match="constraint 'batch_size >= 1'"):
        defn.resolve_axes({"batch_size": 0})
    with pytest.raises(DefinitionError, match="do not match var axes"):
        defn.resolve_axes({})
    with pytest.raises(DefinitionError, match="non-negative integer"):
        defn.resolve_axes({"batch_size": 2.5})


def test_reference_runs_on_its_inputs(defn):
    import torch
    from harness.ops import leapquant_kda_flush as op
    x = op.make_inputs("random", defn.resolve_axes({"batch_size": 1}), 0)
    out = defn.reference_run()(**x)
    assert [t.dtype for t in out] == [s.torch_dtype for s in defn.outputs.values()]
    assert torch.isfinite(out[1]).all()


def _mutated(tmp_path, mutate):
    raw = json.loads(open(SHIPPED).read())
    mutate(raw)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    return path


MALFORMED = {
    "unknown dtype": (lambda r: r["inputs"]["codes"].update(dtype="int9"), "inputs.codes.dtype"),
    "unknown axis": (lambda r: r["inputs"]["s_k"].update(shape=["batch_size", "heads"]), "inputs.s_k.shape"),
    "no name": (lambda r: r.pop("name"), "'name'"),
    "bad axis type": (lambda r: r["axes"]["rank"].update(type="fixed"), "axes.rank.type"),
    "const without value": (lambda r: r["axes"]["rank"].pop("value"), "axes.rank.value"),
    "name clash": (lambda r: r["outputs"].update(codes=r["inputs"]["codes"]), "'outputs'"),
    "reference syntax": (lambda r: r.update(reference="def run(:\n"), "'reference'"),
    "reference without run": (lambda r: r.update(reference="x = 1\n"), "'reference'"),
    "reference signature": (lambda r: r.update(reference="def run(a, b):\n    pass\n"), "'reference'"),
    "constraint names": (lambda r: r.update(constraints=["batch >= 1"]), "'constraints'"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_definition_one_line(tmp_path, case):
    mutate, field = MALFORMED[case]
    path = _mutated(tmp_path, mutate)
    with pytest.raises(DefinitionError) as err:
        load_definition(path)
    msg = str(err.value)
    assert str(path) in msg and field in msg and "\n" not in msg


def test_invalid_json_and_missing_file(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{ not json")
    with pytest.raises(DefinitionError, match="not valid JSON"):
        load_definition(bad)
    with pytest.raises(DefinitionError, match="no such definition"):
        load_definition(tmp_path / "missing.json")
    with pytest.raises(DefinitionError, match="no definition named"):
        find_definition("nope", PROJECT.definitions)


def test_definition_is_checked_against_its_pinned_hash_before_its_reference_runs(tmp_path):
    """An edited contract (here the reference, through bf16, and a line that would leave a mark if executed) is
    refused before any of its code runs; so is a definition nobody pinned."""
    import shutil
    root = tmp_path / "definitions"
    shutil.copytree(PROJECT.definitions, root)
    assert find_definition("leapquant_kda_flush_r4_int8_h32_v128_k128", root).name
    path = root / "leapquant_kda_flush" / SHIPPED.name
    raw = json.loads(path.read_text())
    mark = tmp_path / "executed"
    raw["reference"] = f"open({str(mark)!r}, 'w').close()\n" + raw["reference"].replace(
        "S = S.float()", "S = S.bfloat16().float()")
    path.write_text(json.dumps(raw))
    with pytest.raises(DefinitionError, match="differs from the one pinned"):
        find_definition("leapquant_kda_flush_r4_int8_h32_v128_k128", root)
    assert not mark.exists()
    (root / "SHA256SUMS").write_text("")
    with pytest.raises(DefinitionError, match="not pinned"):
        find_definition("leapquant_kda_flush_r4_int8_h32_v128_k128", root)
