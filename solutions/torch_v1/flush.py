"""LeapQuant window flush in plain torch, restructured for speed.

Against the reference: the checkpoint's rank-R part and the window are one [V, R+L] x [R+L, K] product (the decay
exp(pcum) folded into its right-hand side and into the column scale), Gram-Schmidt projects against all previous
columns in one product (twice, as MGS2 does), and the residual is rebuilt in place. No data-dependent Python
control flow, so `torch.compile(run)` traces it whole.
"""
import torch

QMAX = 127.0
EPS = 1e-12


DEPENDENT = 2.0 ** -12      # a second projection pass leaving less of a column than this (max-abs) is rounding


def _unit(v: torch.Tensor) -> torch.Tensor:
    """v / ||v|| over dim -2, scaled by its largest entry first: a remainder of ~1e-25 has squares that flush to
    zero in fp32, and v / 1e-30 would be an overflowing "unit" column; a zero column stays zero."""
    t = v / v.abs().amax(-2, keepdim=True).clamp_min(1e-30)
    return t / torch.linalg.vector_norm(t, dim=-2, keepdim=True).clamp_min(1e-30)


def _orthonormalize(m: torch.Tensor) -> torch.Tensor:
    """Columns of m [..., n, R] made orthonormal in order, each projected three times against the previous ones (the
    reference's MGS2 projects twice: where the second pass leaves little of a nearly dependent column, its own
    rounding is a large share of the rest and lies along the earlier columns, which the third pass removes). A
    column that the second pass finds dependent (DEPENDENT) becomes zero, a token that decodes to nothing, rather
    than normalised rounding."""
    cols = [_unit(m[..., :1])]
    for j in range(1, m.shape[-1]):
        prev = torch.cat(cols, -1)
        passes = [m[..., j:j + 1]]
        for _ in range(3):
            passes.append(passes[-1] - prev @ (prev.transpose(-1, -2) @ passes[-1]))
        dependent = passes[2].abs().amax(-2, keepdim=True) <= passes[1].abs().amax(-2, keepdim=True) * DEPENDENT
        cols.append(torch.where(dependent, 0.0, _unit(passes[3])))
    return torch.cat(cols, -1)


def run(codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, q0):
    decay = torch.exp(pcum)                                                       # [B, H, K]
    after = torch.cumprod(gbuf.float().flip(-2), -2).flip(-2)                     # prod_{i >= j} gbuf_i
    d = torch.cat([after[..., 1:, :], torch.ones_like(after[..., :1, :])], -2)   # prod_{i > j} gbuf_i
    left = torch.cat([q.float(), ubuf.float()], -2).transpose(-1, -2)            # [B, H, V, R+L]
    right = torch.cat([u.float() * decay[..., None, :], kbuf.float() * d * w[..., None]], -2)
    s = torch.matmul(left, right)
    s += codes.float() * (s_k * decay * (1.0 / QMAX))[..., None, :] * s_v[..., :, None]

    st = s.transpose(-1, -2)
    qk = _orthonormalize(torch.matmul(st, q0))
    qv = _orthonormalize(torch.matmul(s, qk))
    u_new = torch.matmul(st, qv).transpose(-1, -2).to(torch.float16)
    q_new = qv.transpose(-1, -2).to(torch.float16)

    s -= torch.matmul(q_new.transpose(-1, -2).float(), u_new.float())           # s is now the residual E
    mag = s.abs()
    s_k_new = mag.mean(-2).sqrt().clamp_min(EPS)
    s_v_new = (mag / s_k_new[..., None, :]).amax(-1).clamp_min(EPS)
    step = QMAX / (s_k_new[..., None, :] * s_v_new[..., :, None])
    codes_new = torch.round(s * step).clamp_(-QMAX, QMAX).to(torch.int8)
    return codes_new, s_k_new, s_v_new, u_new, q_new
