// SPDX-License-Identifier: Apache-2.0
// torch binding of the cuda_v1 flush: checks, output allocation, launch on torch's current stream.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>   // c10::cuda::getCurrentCUDAStream (= at::cuda::getCurrentCUDAStream)
#include <c10/cuda/CUDAGuard.h>

#include "flush.cuh"

namespace {

void check(const at::Tensor& x, const char* name, at::ScalarType dtype, int64_t numel, const at::Device& dev) {
  TORCH_CHECK(x.device() == dev, "cuda_v1: ", name, " must be on ", dev, ", got ", x.device());
  TORCH_CHECK(x.scalar_type() == dtype, "cuda_v1: ", name, " has dtype ", x.scalar_type(), ", expected ", dtype);
  TORCH_CHECK(x.is_contiguous(), "cuda_v1: ", name, " must be contiguous");
  TORCH_CHECK(x.numel() == numel, "cuda_v1: ", name, " has ", x.numel(), " elements, expected ", numel);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, "cuda_v1: ", name, " must be 16-byte aligned");
}

std::vector<at::Tensor> flush(const at::Tensor& codes, const at::Tensor& s_k, const at::Tensor& s_v,
                              const at::Tensor& u, const at::Tensor& q, const at::Tensor& kbuf,
                              const at::Tensor& ubuf, const at::Tensor& gbuf, const at::Tensor& w,
                              const at::Tensor& pcum, const at::Tensor& q0) {
  TORCH_CHECK(codes.dim() == 4 && codes.size(1) == 32 && codes.size(2) == 128 && codes.size(3) == 128,
              "cuda_v1: codes must be [B, 32, 128, 128]");
  const int64_t B = codes.size(0);
  const int64_t P = B * 32;
  const auto dev = codes.device();
  check(codes, "codes", at::kChar, P * 128 * 128, dev);
  check(s_k, "s_k", at::kFloat, P * 128, dev);
  check(s_v, "s_v", at::kFloat, P * 128, dev);
  check(u, "u", at::kHalf, P * 4 * 128, dev);
  check(q, "q", at::kHalf, P * 4 * 128, dev);
  check(kbuf, "kbuf", at::kBFloat16, P * 16 * 128, dev);
  check(ubuf, "ubuf", at::kBFloat16, P * 16 * 128, dev);
  check(gbuf, "gbuf", at::kHalf, P * 16 * 128, dev);
  check(w, "w", at::kFloat, P * 16, dev);
  check(pcum, "pcum", at::kFloat, P * 128, dev);
  check(q0, "q0", at::kFloat, 128 * 4, dev);

  const c10::cuda::CUDAGuard guard(dev);
  auto codes_new = at::empty_like(codes);
  auto s_k_new = at::empty_like(s_k);
  auto s_v_new = at::empty_like(s_v);
  auto u_new = at::empty_like(u);
  auto q_new = at::empty_like(q);
  TORCH_CHECK(P <= INT32_MAX, "cuda_v1: batch too large");
  if (P == 0) return {codes_new, s_k_new, s_v_new, u_new, q_new};

  FlushParams p;
  p.codes = codes.data_ptr<int8_t>();
  p.s_k = s_k.data_ptr<float>();
  p.s_v = s_v.data_ptr<float>();
  p.u = u.data_ptr();
  p.q = q.data_ptr();
  p.kbuf = kbuf.data_ptr();
  p.ubuf = ubuf.data_ptr();
  p.gbuf = gbuf.data_ptr();
  p.w = w.data_ptr<float>();
  p.pcum = pcum.data_ptr<float>();
  p.q0 = q0.data_ptr<float>();
  p.codes_new = codes_new.data_ptr<int8_t>();
  p.s_k_new = s_k_new.data_ptr<float>();
  p.s_v_new = s_v_new.data_ptr<float>();
  p.u_new = u_new.data_ptr();
  p.q_new = q_new.data_ptr();
  p.n_programs = static_cast<int>(P);
  const cudaError_t err = leapquant_flush_launch(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "cuda_v1: kernel launch failed: ", cudaGetErrorString(err));
  return {codes_new, s_k_new, s_v_new, u_new, q_new};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("flush", &flush, "LeapQuant KDA flush (cuda_v1): returns codes, s_k, s_v, u, q");
}
