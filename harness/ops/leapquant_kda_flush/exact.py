"""The operator's math in fp64: the state a checkpoint decodes to, the state a flush must quantize, and the
reference's flush evaluated exactly (the checkpoint feedback of the `second_window` and `trajectory` families)."""
from __future__ import annotations

import torch

from harness.ops.leapquant_kda_flush.draws import exact_exp, ordered_matmul, ordered_sum
from harness.ops.leapquant_kda_flush.layout import CHECKPOINT, EPS, QMAX, WINDOW

DEPENDENT_COLUMN = 1e-9  # generator's Gram-Schmidt: a remainder below this fraction of column 0 is noise


def decay_history(gbuf: torch.Tensor) -> torch.Tensor:
    """D_j = prod_{i > j} gbuf_i over the window axis (-2), multiplied from the end in a fixed order."""
    d = torch.ones_like(gbuf)
    for j in range(gbuf.shape[-2] - 2, -1, -1):
        d[..., j, :] = d[..., j + 1, :] * gbuf[..., j + 1, :]
    return d


def decode_checkpoint(codes, s_k, s_v, u, q) -> torch.Tensor:
    """The state a checkpoint stands for, in fp64: q^T u + codes * s_k / 127 * s_v."""
    low_rank = torch.einsum("...rv,...rk->...vk", q.double(), u.double())
    return low_rank + codes.double() * (s_k.double() / QMAX)[..., None, :] * s_v.double()[..., :, None]


def served_checkpoint(codes, s_k, s_v, u, q) -> torch.Tensor:
    """The state as a consumer decodes it: in fp32, the formula left to right, q^T u + ((codes * s_k) / 127) * s_v.
    It differs from the exact decode by fp32 rounding alone, unless the scales only work out in fp64 (a product that
    overflows or sinks below fp32's range)."""
    low_rank = torch.einsum("...rv,...rk->...vk", q.float(), u.float())
    return low_rank + codes.float() * s_k.float()[..., None, :] / QMAX * s_v.float()[..., :, None]


def exact_state(inputs: dict) -> torch.Tensor:
    """The state the flush must quantize, rebuilt in fp64 from the inputs."""
    return advance(decode_checkpoint(*(inputs[k] for k in CHECKPOINT)), inputs)


def advance(state: torch.Tensor, window: dict) -> torch.Tensor:
    """An fp64 state decayed over one window and given its updates: S exp(pcum) + sum_j w_j ubuf_j (kbuf_j D_j)^T."""
    x = {k: window[k].double() for k in WINDOW}
    kd = x["kbuf"] * decay_history(x["gbuf"])
    updates = torch.einsum("...j,...jv,...jk->...vk", x["w"], x["ubuf"], kd)
    return state * torch.exp(x["pcum"])[..., None, :] + updates


def mgs2(m: torch.Tensor) -> torch.Tensor:
    """Modified Gram-Schmidt on the columns of m [..., n, R], projections applied twice (the reference's `_mgs`),
    except that a column left with less than DEPENDENT_COLUMN of the first column's norm becomes zero instead of
    being normalised: the direction of such a remainder is rounding noise, and noise would make the generated
    checkpoint of a rank-deficient head depend on the last bit of every operation before it."""
    cols, first = [], None
    for j in range(m.shape[-1]):
        v = m[..., j]
        for _ in range(2):
            for c in cols:
                v = v - c * ordered_sum(c * v, -1)[..., None]
        norm = torch.sqrt(ordered_sum(v * v, -1))
        first = norm if first is None else first
        keep = norm > DEPENDENT_COLUMN * first
        cols.append(torch.where(keep[..., None], v / norm.clamp_min(1e-30)[..., None], 0.0))
    return torch.stack(cols, -1)


def subspace_fp64(s: torch.Tensor, q0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference's round of subspace iteration on an fp64 state s [.., V, K], in a fixed order: (qk, z, qv) with
    qk = MGS2(S^T q0) [.., K, R], z = S qk [.., V, R], qv = MGS2(z)."""
    qk = mgs2(ordered_matmul(s.transpose(-1, -2), q0.double()))
    z = ordered_matmul(s, qk)
    return qk, z, mgs2(z)


def flush_fp64(inputs: dict, q0: torch.Tensor) -> dict:
    """The reference's flush evaluated in fp64 in a fixed order: the checkpoint feedback of the `second_window` and
    `trajectory` families."""
    x = {k: inputs[k].double() for k in CHECKPOINT + WINDOW}
    low_rank = ordered_matmul(x["q"].transpose(-1, -2), x["u"])
    old = low_rank + x["codes"] * (x["s_k"] * (1.0 / QMAX))[..., None, :] * x["s_v"][..., :, None]
    decay = exact_exp(x["pcum"])
    kd = (x["kbuf"] * decay_history(x["gbuf"])).transpose(-1, -2)          # [.., K, L]
    uw = (x["ubuf"] * x["w"][..., None]).transpose(-1, -2)                  # [.., V, L]
    s = old * decay[..., None, :] + ordered_matmul(uw, kd.transpose(-1, -2))
    st = s.transpose(-1, -2)
    _, _, qv = subspace_fp64(s, q0)
    uk = ordered_matmul(st, qv)
    u_new, q_new = uk.transpose(-1, -2).half(), qv.transpose(-1, -2).half()
    e = s - ordered_matmul(q_new.double().transpose(-1, -2), u_new.double())
    s_k = torch.sqrt(ordered_sum(e.abs(), -2) * (1.0 / s.shape[-2])).clamp_min(EPS)      # 1/V: a power of 2
    s_v = (e.abs() / s_k[..., None, :]).amax(-1).clamp_min(EPS)
    codes = torch.round(e / (s_k[..., None, :] * s_v[..., :, None]) * QMAX).clamp(-QMAX, QMAX)
    return {"codes": codes.to(torch.int8), "s_k": s_k.float(), "s_v": s_v.float(), "u": u_new, "q": q_new}

