// {name}: the state's rebuild, the only part of the flush written in CUDA here (pure CUDA, no torch headers, so
// it compiles on a machine without a GPU).
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

// S = (q^T u + codes * s_k / 127 * s_v) * exp(pcum) + sum_j w_j ubuf_j (kbuf_j * D_j)^T, one block per
// (sequence, head), fp32, written to state [programs, V, K].
void launch_rebuild(const int8_t* codes, const float* s_k, const float* s_v, const __half* u, const __half* q,
                    const __nv_bfloat16* kbuf, const __nv_bfloat16* ubuf, const __half* gbuf, const float* w,
                    const float* pcum, float* state, int programs, int R, int L, int V, int K, cudaStream_t stream);
