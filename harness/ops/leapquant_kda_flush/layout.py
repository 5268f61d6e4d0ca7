"""The checkpoint format and the window buffer: field names, definition dtypes and the int8 scale, shared by
every part of the operator."""
from __future__ import annotations

import torch

QMAX = 127.0
EPS = 1e-12
CHECKPOINT = ("codes", "s_k", "s_v", "u", "q")
WINDOW = ("kbuf", "ubuf", "gbuf", "w", "pcum")
# each part of a timed program is moved by a symmetry (symmetries.draw_variants), and in a family whose parts are
# independent (families.INDEPENDENT_PARTS_FAMILIES) taken from a pool program of its own: the state they rebuild
# (which needs no q0, and so follows the symmetries exactly) exists only once the schedule says how the two meet
PROGRAM_PARTS = (CHECKPOINT, WINDOW)
WINDOW_RESET = {"w": 0.0, "pcum": 0.0, "gbuf": 1.0}    # what the deployment form writes after a flush
DUE_EVERY = "window"                                  # a sequence flushes when its window is full
POOL_CALL_ARGS = ("q0",)                              # flush_inplace(pool, idx, q0): q0 is shared, not pooled
DTYPES = {"codes": torch.int8, "s_k": torch.float32, "s_v": torch.float32, "u": torch.float16, "q": torch.float16,
          "kbuf": torch.bfloat16, "ubuf": torch.bfloat16, "gbuf": torch.float16, "w": torch.float32,
          "pcum": torch.float32, "q0": torch.float32}



def dims(axes: dict) -> tuple[int, int, int, int, int, int]:
    return (axes["batch_size"], axes["num_heads"], axes["value_dim"], axes["key_dim"], axes["window"], axes["rank"])


def cast(x: dict) -> dict:
    """Round each tensor to its definition dtype (codes are integral already)."""
    return {k: v.to(DTYPES[k]) for k, v in x.items()}

