// {name}: see rebuild.cuh. One block of K threads per program; thread k owns column k of the state.
#include "rebuild.cuh"

namespace {

__global__ void rebuild_kernel(const int8_t* codes, const float* s_k, const float* s_v, const __half* u,
                               const __half* q, const __nv_bfloat16* kbuf, const __nv_bfloat16* ubuf,
                               const __half* gbuf, const float* w, const float* pcum, float* state, int R, int L,
                               int V, int K) {
  const long p = blockIdx.x;
  const int k = threadIdx.x;
  if (k >= K) return;
  const float decay = expf(pcum[p * K + k]);
  const float column_scale = s_k[p * K + k] / 127.0f;
  for (int v = 0; v < V; ++v) {
    float s = 0.0f;
    for (int r = 0; r < R; ++r) s += __half2float(q[(p * R + r) * V + v]) * __half2float(u[(p * R + r) * K + k]);
    s += float(codes[(p * V + v) * K + k]) * column_scale * s_v[p * V + v];
    s *= decay;
    float d = 1.0f;   // D_j = prod_{i > j} gbuf_i, newest entry first
    for (int j = L - 1; j >= 0; --j) {
      const float key = __bfloat162float(kbuf[(p * L + j) * K + k]) * d;
      s += __bfloat162float(ubuf[(p * L + j) * V + v]) * w[p * L + j] * key;
      d *= __half2float(gbuf[(p * L + j) * K + k]);
    }
    state[(p * V + v) * K + k] = s;
  }
}

}  // namespace

void launch_rebuild(const int8_t* codes, const float* s_k, const float* s_v, const __half* u, const __half* q,
                    const __nv_bfloat16* kbuf, const __nv_bfloat16* ubuf, const __half* gbuf, const float* w,
                    const float* pcum, float* state, int programs, int R, int L, int V, int K, cudaStream_t stream) {
  rebuild_kernel<<<programs, K, 0, stream>>>(codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, state, R, L, V, K);
}
