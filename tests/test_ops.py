"""harness.ops: the operator interface, and a core that reaches the operator only through it."""
import ast
import re
import sys
import types
import pytest

from conftest import DEFINITION, PROJECT, ROOT
from harness import HarnessError
from harness.definition import find_definition
from harness.ops import REQUIRED, load_op

CORE = sorted((ROOT / "harness").glob("*.py"))


@pytest.fixture(scope="module")
def op():
    return load_op("leapquant_kda_flush")


def test_the_operator_provides_every_required_name(op):
    assert {"FAMILIES", "judge", "make_inputs", "Pool", "WORDING", "DUE_EVERY", "POOL_CALL_ARGS"} <= set(REQUIRED)
    assert all(hasattr(op, name) for name in REQUIRED)


def test_the_deployment_names_are_the_definitions(op):
    """The pool keeps the checkpoint and window inputs; the call's own arguments are the other inputs; a sequence
    is due after a const axis's count of steps."""
    defn = find_definition(DEFINITION, PROJECT.definitions)
    pooled = {*op.CHECKPOINT, *op.WINDOW}
    assert pooled <= set(defn.inputs) and set(op.POOL_CALL_ARGS) == set(defn.inputs) - pooled
    assert set(op.WINDOW_RESET) <= set(op.WINDOW) and op.DUE_EVERY in defn.const_axes


def test_a_package_missing_a_name_or_a_bad_op_type_is_one_line(op, monkeypatch):
    partial = types.ModuleType("harness.ops.half_done")
    for name in REQUIRED:
        if name != "judge":
            setattr(partial, name, getattr(op, name))
    monkeypatch.setitem(sys.modules, "harness.ops.half_done", partial)
    with pytest.raises(HarnessError, match=r"operator 'half_done' does not provide judge \(harness.ops.Operator\)"):
        load_op("half_done")
    with pytest.raises(HarnessError, match="no operator package harness/ops/nothing_here/"):
        load_op("nothing_here")
    with pytest.raises(HarnessError, match="is not a module name"):
        load_op("../escape")


def test_the_core_imports_no_operator_package():
    for path in CORE:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not any(n.startswith("harness.ops.") for n in names), f"{path} imports {names}"


def test_the_core_names_none_of_the_operators_concepts(op):
    """The operator's fields, its score and the words of its math appear only in harness/ops/<op_type>/: a core
    module that spells one would break for the next operator. A field is looked for as a string literal (the core
    would index a tensor by it); the distinctive names as words anywhere, comments and docstrings included."""
    fields = {*op.CHECKPOINT, *op.WINDOW, *op.POOL_CALL_ARGS, op.WORDING.score_key}
    words = {"leapquant", "kda", "heads", "num_heads", "q0", "decode_checkpoint", "RATIO_LIMIT",
             op.WORDING.score_key, *(f for f in fields if "_" in f or len(f) > 3 and f.endswith("buf"))}
    patterns = [rf"[\"']{re.escape(f)}[\"']" for f in sorted(fields)]
    patterns += [rf"(?<![\w.]){re.escape(w)}(?!\w)" for w in sorted(words)]
    found = []
    for path in CORE:
        text = path.read_text()
        for pattern in patterns:
            for m in re.finditer(pattern, text, re.IGNORECASE):
                found.append(f"{path}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}")
    assert not found, "\n".join(found)
