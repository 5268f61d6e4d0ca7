"""{name}: the LeapQuant KDA flush with the state's rebuild in Triton and the rest in torch, the reference's math in
its simplest form: a correct starting point, not a fast one.

`run` takes the 11 inputs in definition order and returns (codes_new, s_k_new, s_v_new, u_new, q_new). One Triton
program per (sequence, head) rebuilds the fp32 state S [V, K]; the subspace iteration and the requantisation follow
the reference in torch. Runs on a GPU, and on the CPU through TRITON_INTERPRET=1.
"""
import torch
import triton
import triton.language as tl

QMAX = 127.0
EPS = 1e-12


@triton.jit
def _rebuild_kernel(p_codes, p_s_k, p_s_v, p_u, p_q, p_kbuf, p_ubuf, p_gbuf, p_w, p_pcum, p_state,
                    R: tl.constexpr, L: tl.constexpr, V: tl.constexpr, K: tl.constexpr):
    """S = (q^T u + codes * s_k / 127 * s_v) * exp(pcum) + sum_j w_j ubuf_j (kbuf_j * D_j)^T for one program."""
    pid = tl.program_id(0)
    v = tl.arange(0, V)
    k = tl.arange(0, K)
    b_codes = tl.load(p_codes + pid * V * K + v[:, None] * K + k[None, :]).to(tl.float32)
    b_s_k = tl.load(p_s_k + pid * K + k)
    b_s_v = tl.load(p_s_v + pid * V + v)
    b_state = tl.zeros([V, K], dtype=tl.float32)
    for r in tl.static_range(R):
        b_q = tl.load(p_q + (pid * R + r) * V + v).to(tl.float32)
        b_u = tl.load(p_u + (pid * R + r) * K + k).to(tl.float32)
        b_state += b_q[:, None] * b_u[None, :]
    b_state += b_codes * (b_s_k / QMAX)[None, :] * b_s_v[:, None]
    b_state = b_state * tl.exp(tl.load(p_pcum + pid * K + k))[None, :]
    # newest entry first, carrying D_j = prod_{i > j} gbuf_i
    b_decay = tl.full([K], 1.0, dtype=tl.float32)
    for j in tl.static_range(L - 1, -1, -1):
        b_key = tl.load(p_kbuf + (pid * L + j) * K + k).to(tl.float32) * b_decay
        b_value = tl.load(p_ubuf + (pid * L + j) * V + v).to(tl.float32) * tl.load(p_w + pid * L + j)
        b_state += b_value[:, None] * b_key[None, :]
        b_decay = b_decay * tl.load(p_gbuf + (pid * L + j) * K + k).to(tl.float32)
    tl.store(p_state + pid * V * K + v[:, None] * K + k[None, :], b_state)


def _mgs(m):
    """Modified Gram-Schmidt on the columns of m, projections applied twice, as the reference."""
    cols = []
    for j in range(m.shape[-1]):
        x = m[..., j]
        for _ in range(2):
            for c in cols:
                x = x - c * (c * x).sum(-1, keepdim=True)
        cols.append(x / x.norm(dim=-1, keepdim=True).clamp_min(1e-30))
    return torch.stack(cols, -1)


def run(codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, q0):
    B, H, V, K = codes.shape
    R, L = u.shape[-2], kbuf.shape[-2]
    inputs = [t.contiguous() for t in (codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum)]
    state = torch.empty((B, H, V, K), dtype=torch.float32, device=codes.device)
    _rebuild_kernel[(B * H,)](*inputs, state, R=R, L=L, V=V, K=K)
    x = state.transpose(-1, -2)
    qk = _mgs(x @ q0)
    qv = _mgs(x.transpose(-1, -2) @ qk)
    u_new = (x @ qv).transpose(-1, -2).to(torch.float16)
    q_new = qv.transpose(-1, -2).to(torch.float16)
    e = state - torch.einsum("bhrv,bhrk->bhvk", q_new.float(), u_new.float())
    s_k_new = e.abs().mean(-2).sqrt().clamp_min(EPS)
    s_v_new = (e.abs() / s_k_new[..., None, :]).amax(-1).clamp_min(EPS)
    codes_new = torch.round(e / (s_k_new[..., None, :] * s_v_new[..., :, None]) * QMAX).clamp(-QMAX, QMAX)
    return codes_new.to(torch.int8), s_k_new, s_v_new, u_new, q_new
