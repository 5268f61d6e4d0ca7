# SPDX-License-Identifier: Apache-2.0
"""cuda_v2: the LeapQuant KDA flush as hand-written CUDA C++ for the H200 (sm_90a).

`run` takes the 11 inputs in definition order and returns (codes_new, s_k_new, s_v_new, u_new, q_new). The
extension (flush.cu: the kernel, pure CUDA; binding.cpp: the torch binding) is built on the first call on a GPU with
torch.utils.cpp_extension (ninja, -gencode=arch=compute_90a,code=sm_90a, -O3) into a cache directory keyed on the
sources' hash; nothing is built at import. Each call: `.contiguous()` on the inputs (a no-op for the dense tensors
the harness sends), output allocation, one kernel launch on torch's current stream (graph-capturable; no host
synchronisation, nothing that depends on the data).
"""
import hashlib
import os
from pathlib import Path


_HERE = Path(__file__).resolve().parent
_SOURCES = ("flush.cu", "binding.cpp")
_HEADERS = ("flush.cuh",)
_ext = None


def extension():
    """The compiled extension, built on first use."""
    global _ext
    if _ext is not None:
        return _ext
    from torch.utils.cpp_extension import load
    # LEAPQUANT_CUDA_LINEINFO=1 adds a line table for profilers (`python -m harness profile`); a build of its own
    flags = ["-O3", "-gencode=arch=compute_90a,code=sm_90a"]
    if os.environ.get("LEAPQUANT_CUDA_LINEINFO") == "1":
        flags.append("-lineinfo")
    h = hashlib.sha256(" ".join(flags).encode())
    for name in _SOURCES + _HEADERS:
        h.update(name.encode())
        h.update((_HERE / name).read_bytes())
    tag = h.hexdigest()[:16]
    root = Path(os.environ.get("LEAPQUANT_CUDA_CACHE", Path.home() / ".cache" / "leapquant_kda_flush"))
    build_dir = root / f"cuda_v2_{tag}"
    build_dir.mkdir(parents=True, exist_ok=True)
    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"          # only the sm_90a cubin (no extra sm_90 pass)
    try:
        _ext = load(name=f"leapquant_cuda_v2_{tag}", sources=[str(_HERE / s) for s in _SOURCES],
                    extra_include_paths=[str(_HERE)], extra_cflags=["-O3"],
                    extra_cuda_cflags=flags,
                    build_directory=str(build_dir), verbose=False)
    finally:
        if saved is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved
    return _ext


def run(codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, q0):
    if not codes.is_cuda:
        raise RuntimeError("cuda_v2 runs on CUDA tensors only (an H200, sm_90a); got tensors on "
                           f"{codes.device}")
    ext = extension()
    args = []
    for x in (codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, q0):
        x = x.contiguous()
        if x.data_ptr() % 16:                            # the kernel reads 16-byte vectors
            x = x.clone()
        args.append(x)
    return tuple(ext.flush(*args))
