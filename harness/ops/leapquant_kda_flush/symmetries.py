"""The symmetries the timer applies to fresh programs: random signed permutations of the value and key axes."""
from __future__ import annotations

import torch


# The harness times every call on programs no earlier call held: each part (layout.PROGRAM_PARTS) of a timed call is
# moved by one of these, from programs of a fresh pool. A signed permutation of the value axis
# (P_v, D_v) and of the key axis (P_k, D_k) maps every input to another input of the same family, exactly in every
# dtype (a permutation moves values, a sign flip of an int8 code in [-127, 127] or of a float is exact), and a part's
# share of the state S to D_v P_v S P_k D_k. q0 stays fixed, so the subspace iteration starts elsewhere relative to
# the state and every output changes, and the checkpoint and the window, moved apart on the value axis, rebuild a
# state no pool program had: no output can be derived from an earlier call's, nor the state from the pool's,
# without the work.
def draw_variants(n: int, parts: int, axes: dict, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Parameters of n x parts random signed permutations, [n, parts, ...]: perm_v [V], perm_k [K] (int64), sign_v
    [V], sign_k [K] (+-1, int8). The parts of one call share the key axis's (the decay pcum, in the window part,
    stays on the checkpoint's columns it was drawn for) and each has a value axis's of its own, which puts the
    checkpoint's rows and the window's in a relative position no pool program had."""
    V, K = axes["value_dim"], axes["key_dim"]
    device = generator.device

    def perm(m, k):
        return torch.argsort(torch.rand(n, k, m, generator=generator, device=device), dim=-1, stable=True)

    def sign(m, k):
        return torch.where(torch.rand(n, k, m, generator=generator, device=device) < 0.5, -1, 1).to(torch.int8)
    return {"perm_v": perm(V, parts), "perm_k": perm(K, 1).expand(n, parts, K).contiguous(),
            "sign_v": sign(V, parts), "sign_k": sign(K, 1).expand(n, parts, K).contiguous()}


# how each input moves: its value-axis and key-axis dims (counted from the end) and whether their signs flip it
_MOVES = {"codes": ((-2, True), (-1, True)), "s_k": ((None, False), (-1, False)), "s_v": ((-1, False), (None, False)),
          "u": ((None, False), (-1, True)), "q": ((-1, True), (None, False)), "kbuf": ((None, False), (-1, True)),
          "ubuf": ((-1, True), (None, False)), "gbuf": ((None, False), (-1, False)),
          "pcum": ((None, False), (-1, False))}


def apply_variant(x: dict, variant: dict) -> dict:
    """The inputs x (any of the definition's) under one signed permutation (perm_v [V], perm_k [K], sign_v [V],
    sign_k [K]): new tensors; q0 and w as they were."""
    axes = ((variant["perm_v"], variant["sign_v"]), (variant["perm_k"], variant["sign_k"]))

    def move(t, how):
        for (dim, signed), (perm, sign) in zip(how, axes):
            if dim is not None:
                t = t.index_select(dim, perm)
                if signed:
                    t = t * sign.to(t.dtype).view(-1, *(1,) * (-1 - dim))
        return t
    return {name: move(t, _MOVES[name]) if name in _MOVES else t for name, t in x.items()}
