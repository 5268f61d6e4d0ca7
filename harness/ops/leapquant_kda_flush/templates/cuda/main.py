"""{name}: the LeapQuant KDA flush with the state's rebuild in CUDA (rebuild.cu) and the rest in torch, the
reference's math in its simplest form: a correct starting point, not a fast one.

`run` takes the 11 inputs in definition order and returns (codes_new, s_k_new, s_v_new, u_new, q_new). The
extension is built with torch.utils.cpp_extension on the first call on a GPU (sm_90a), into a cache directory keyed
on the sources' hash.
"""
import hashlib
from pathlib import Path

import torch

QMAX = 127.0
EPS = 1e-12
_HERE = Path(__file__).resolve().parent
_SOURCES = ("rebuild.cu", "binding.cpp", "rebuild.cuh")
_ext = None


def _extension():
    global _ext
    if _ext is None:
        from torch.utils.cpp_extension import load
        tag = hashlib.sha256(b"".join((_HERE / s).read_bytes() for s in _SOURCES)).hexdigest()[:16]
        build = Path.home() / ".cache" / "leapquant_kda_flush" / f"{name}_{tag}"
        build.mkdir(parents=True, exist_ok=True)
        _ext = load(name=f"{name}_{tag}", sources=[str(_HERE / s) for s in _SOURCES[:2]],
                    extra_include_paths=[str(_HERE)], build_directory=str(build),
                    extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"])
    return _ext


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
    if not codes.is_cuda:
        raise RuntimeError(f"{name} runs on CUDA tensors only; got tensors on {codes.device}")
    state = _extension().rebuild(*(t.contiguous() for t in (codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum)))
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
