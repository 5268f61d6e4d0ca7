"""The symmetries the timer applies to fresh programs: random signed permutations of the value and key axes."""
from __future__ import annotations

import torch


# The harness times every call on programs no earlier call held: each timed call applies one of these to programs of
# a fresh pool. A signed permutation of the value axis (P_v, D_v) and of the key axis (P_k, D_k) maps every input to
# another input of the same family, exactly in every dtype (a permutation moves values, a sign flip of an int8 code
# in [-127, 127] or of a float is exact), and the state S to D_v P_v S P_k D_k. q0 stays fixed, so the subspace
# iteration starts elsewhere relative to the state and every output changes: no output can be derived from an earlier
# call's without the work.
def draw_variants(n: int, axes: dict, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Parameters of n random signed permutations: perm_v [n, V], perm_k [n, K] (int64), sign_v [n, V],
    sign_k [n, K] (+-1, int8)."""
    V, K = axes["value_dim"], axes["key_dim"]
    device = generator.device

    def perm(m):
        return torch.argsort(torch.rand(n, m, generator=generator, device=device), dim=-1, stable=True)

    def sign(m):
        return torch.where(torch.rand(n, m, generator=generator, device=device) < 0.5, -1, 1).to(torch.int8)
    return {"perm_v": perm(V), "perm_k": perm(K), "sign_v": sign(V), "sign_k": sign(K)}


def apply_variant(x: dict, variant: dict) -> dict:
    """The inputs x under one signed permutation (perm_v [V], perm_k [K], sign_v [V], sign_k [K]): new tensors,
    q0 and w as they were."""
    pv, pk, sv, sk = variant["perm_v"], variant["perm_k"], variant["sign_v"], variant["sign_k"]

    def values(t, signed):      # last dim is the value axis
        t = t.index_select(-1, pv)
        return t * sv.to(t.dtype) if signed else t

    def keys(t, signed):        # last dim is the key axis
        t = t.index_select(-1, pk)
        return t * sk.to(t.dtype) if signed else t
    codes = x["codes"].index_select(-2, pv).index_select(-1, pk) * (sv[:, None] * sk[None, :])
    return {**x, "codes": codes, "s_k": keys(x["s_k"], False), "s_v": values(x["s_v"], False),
            "u": keys(x["u"], True), "q": values(x["q"], True), "kbuf": keys(x["kbuf"], True),
            "ubuf": values(x["ubuf"], True), "gbuf": keys(x["gbuf"], False), "pcum": keys(x["pcum"], False)}

