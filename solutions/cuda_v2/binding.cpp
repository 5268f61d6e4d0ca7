// SPDX-License-Identifier: Apache-2.0
// torch binding of the cuda_v2 flush: checks, output allocation, launch on torch's current stream.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>   // c10::cuda::getCurrentCUDAStream (= at::cuda::getCurrentCUDAStream)
#include <c10/cuda/CUDAGuard.h>

#include "flush.cuh"

namespace {

void check(const at::Tensor& x, const char* name, at::ScalarType dtype, int64_t numel, const at::Device& dev) {
  TORCH_CHECK(x.device() == dev, "cuda_v2: ", name, " must be on ", dev, ", got ", x.device());
  TORCH_CHECK(x.scalar_type() == dtype, "cuda_v2: ", name, " has dtype ", x.scalar_type(), ", expected ", dtype);
  TORCH_CHECK(x.is_contiguous(), "cuda_v2: ", name, " must be contiguous");
  TORCH_CHECK(x.numel() == numel, "cuda_v2: ", name, " has ", x.numel(), " elements, expected ", numel);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, "cuda_v2: ", name, " must be 16-byte aligned");
}

// The window (dense over `records`), pcum and q0: checked, then into p.
void set_window(FlushParams& p, const at::Tensor& kbuf, const at::Tensor& ubuf, const at::Tensor& gbuf,
                const at::Tensor& w, const at::Tensor& pcum, const at::Tensor& q0, int64_t records,
                const at::Device& dev) {
  check(kbuf, "kbuf", at::kBFloat16, records * 16 * 128, dev);
  check(ubuf, "ubuf", at::kBFloat16, records * 16 * 128, dev);
  check(gbuf, "gbuf", at::kHalf, records * 16 * 128, dev);
  check(w, "w", at::kFloat, records * 16, dev);
  check(pcum, "pcum", at::kFloat, records * 128, dev);
  check(q0, "q0", at::kFloat, 128 * 4, dev);
  p.kbuf = kbuf.data_ptr();
  p.ubuf = ubuf.data_ptr();
  p.gbuf = gbuf.data_ptr();
  p.w = w.data_ptr<float>();
  p.pcum = pcum.data_ptr<float>();
  p.q0 = q0.data_ptr<float>();
}

void launch(const FlushParams& p) {
  const cudaError_t err = leapquant_flush_launch(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "cuda_v2: kernel launch failed: ", cudaGetErrorString(err));
}

std::vector<at::Tensor> flush(const at::Tensor& codes, const at::Tensor& s_k, const at::Tensor& s_v,
                              const at::Tensor& u, const at::Tensor& q, const at::Tensor& kbuf,
                              const at::Tensor& ubuf, const at::Tensor& gbuf, const at::Tensor& w,
                              const at::Tensor& pcum, const at::Tensor& q0) {
  TORCH_CHECK(codes.dim() == 4 && codes.size(1) == 32 && codes.size(2) == 128 && codes.size(3) == 128,
              "cuda_v2: codes must be [B, 32, 128, 128]");
  const int64_t B = codes.size(0);
  const int64_t P = B * 32;
  const auto dev = codes.device();
  check(codes, "codes", at::kChar, P * 128 * 128, dev);
  check(s_k, "s_k", at::kFloat, P * 128, dev);
  check(s_v, "s_v", at::kFloat, P * 128, dev);
  check(u, "u", at::kHalf, P * 4 * 128, dev);
  check(q, "q", at::kHalf, P * 4 * 128, dev);
  FlushParams p{};
  set_window(p, kbuf, ubuf, gbuf, w, pcum, q0, P, dev);

  const c10::cuda::CUDAGuard guard(dev);
  auto codes_new = at::empty_like(codes);
  auto s_k_new = at::empty_like(s_k);
  auto s_v_new = at::empty_like(s_v);
  auto u_new = at::empty_like(u);
  auto q_new = at::empty_like(q);
  TORCH_CHECK(P <= INT32_MAX, "cuda_v2: batch too large");
  if (P == 0) return {codes_new, s_k_new, s_v_new, u_new, q_new};

  p.codes = codes.data_ptr<int8_t>();
  p.s_k = s_k.data_ptr<float>();
  p.s_v = s_v.data_ptr<float>();
  p.u = u.data_ptr();
  p.q = q.data_ptr();
  p.codes_new = codes_new.data_ptr<int8_t>();
  p.s_k_new = s_k_new.data_ptr<float>();
  p.s_v_new = s_v_new.data_ptr<float>();
  p.u_new = u_new.data_ptr();
  p.q_new = q_new.data_ptr();
  p.n_programs = static_cast<int>(P);
  launch(p);
  return {codes_new, s_k_new, s_v_new, u_new, q_new};
}

// The deployment form: flush in place every (idx[n], head) of the pool whose window is full (count == 16) and reset
// its window. `buffer` is the pool's flat byte buffer in the published engine layout (region of (slot, head) at
// HEADER + (33 slot + head) * 65,536: codes +0, s_k +16,384, s_v +16,896, fp16 rows u | q +17,408); the window, pcum
// and count are dense [slots, 32, ...]. Only metadata is checked here (no host synchronisation): idx's values are
// the caller's contract (in range, no slot twice); the kernel skips a slot outside [1, slots).
void flush_inplace(const at::Tensor& buffer, const at::Tensor& kbuf, const at::Tensor& ubuf, const at::Tensor& gbuf,
                   const at::Tensor& w, const at::Tensor& pcum, const at::Tensor& count, const at::Tensor& idx,
                   const at::Tensor& q0) {
  constexpr int64_t HEADER = 49152, REGION = 65536, REGIONS_PER_SLOT = 33;
  constexpr int64_t CODES_AT = 0, S_K_AT = 16384, S_V_AT = 16896, TOKENS_AT = 17408;
  const auto dev = buffer.device();
  const int64_t slots = count.dim() == 2 ? count.size(0) : 0;
  TORCH_CHECK(slots >= 2 && count.size(1) == 32, "cuda_v2: count must be [slots >= 2, 32]");
  TORCH_CHECK(idx.dim() == 1, "cuda_v2: idx must be 1-D");
  check(buffer, "pool buffer", at::kByte, HEADER + slots * REGIONS_PER_SLOT * REGION, dev);
  check(count, "count", at::kInt, slots * 32, dev);
  check(idx, "idx", at::kInt, idx.numel(), dev);
  FlushParams p{};
  set_window(p, kbuf, ubuf, gbuf, w, pcum, q0, slots * 32, dev);
  TORCH_CHECK(idx.numel() * 32 <= INT32_MAX && slots * REGIONS_PER_SLOT <= INT32_MAX, "cuda_v2: pool too large");
  if (idx.numel() == 0) return;

  const c10::cuda::CUDAGuard guard(dev);
  // in place: each checkpoint field is read and written at the same bytes of the region
  uint8_t* base = buffer.data_ptr<uint8_t>() + HEADER;
  p.codes = p.codes_new = reinterpret_cast<int8_t*>(base + CODES_AT);
  p.s_k = p.s_k_new = reinterpret_cast<float*>(base + S_K_AT);
  p.s_v = p.s_v_new = reinterpret_cast<float*>(base + S_V_AT);
  p.u = p.u_new = base + TOKENS_AT;
  p.q = p.q_new = base + TOKENS_AT + 2 * 128;          // each fp16 row is u (128) | q (128)
  p.n_programs = static_cast<int>(idx.numel() * 32);
  p.idx = idx.data_ptr<int32_t>();
  p.count = count.data_ptr<int32_t>();
  p.num_slots = static_cast<int>(slots);
  launch(p);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("flush", &flush, "LeapQuant KDA flush (cuda_v2): returns codes, s_k, s_v, u, q");
  m.def("flush_inplace", &flush_inplace, "LeapQuant KDA flush (cuda_v2), deployment form: in place on a pool");
}
