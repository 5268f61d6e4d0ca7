"""torch_v1 traces whole under torch.compile (no graph breaks), as its description promises."""
import torch

from harness.ops import leapquant_kda_flush as op
from harness.solutions import load_entry, load_solution


def test_one_graph_no_breaks(defn):
    load_entry(load_solution("torch_v1", defn), defn)       # puts the folder on sys.path
    import flush
    x = op.make_inputs("random", defn.resolve_axes({"batch_size": 1}), 1)
    explained = torch._dynamo.explain(flush.run)(*x.values())
    assert explained.graph_count == 1 and explained.graph_break_count == 0
