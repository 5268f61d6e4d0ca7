// {name}: the torch binding of launch_rebuild (built by main.py on a GPU).
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

#include "rebuild.cuh"

torch::Tensor rebuild(torch::Tensor codes, torch::Tensor s_k, torch::Tensor s_v, torch::Tensor u, torch::Tensor q,
                      torch::Tensor kbuf, torch::Tensor ubuf, torch::Tensor gbuf, torch::Tensor w, torch::Tensor pcum) {
  const int B = codes.size(0), H = codes.size(1), V = codes.size(2), K = codes.size(3);
  const int R = u.size(2), L = kbuf.size(2);
  auto state = torch::empty({B, H, V, K}, codes.options().dtype(torch::kFloat32));
  launch_rebuild(codes.data_ptr<int8_t>(), s_k.data_ptr<float>(), s_v.data_ptr<float>(),
                 reinterpret_cast<const __half*>(u.data_ptr<at::Half>()),
                 reinterpret_cast<const __half*>(q.data_ptr<at::Half>()),
                 reinterpret_cast<const __nv_bfloat16*>(kbuf.data_ptr<at::BFloat16>()),
                 reinterpret_cast<const __nv_bfloat16*>(ubuf.data_ptr<at::BFloat16>()),
                 reinterpret_cast<const __half*>(gbuf.data_ptr<at::Half>()), w.data_ptr<float>(),
                 pcum.data_ptr<float>(), state.data_ptr<float>(), B * H, R, L, V, K,
                 at::cuda::getCurrentCUDAStream());
  return state;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("rebuild", &rebuild, "the flush's fp32 state"); }
