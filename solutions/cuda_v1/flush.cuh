// SPDX-License-Identifier: Apache-2.0
// LeapQuant KDA flush (leapquant_kda_flush_r4_int8_h32_v128_k128), CUDA C++ for sm_90a: the launch interface.
// Plain C++ (no torch, no CUDA device headers) so that both the torch binding and the kernel file include it.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

struct FlushParams {
  // inputs, contiguous, in definition order ([B, 32, ...] with one program = one (sequence, head))
  const int8_t* codes;   // [P, 128, 128] int8
  const float* s_k;      // [P, 128]
  const float* s_v;      // [P, 128]
  const void* u;         // [P, 4, 128] fp16
  const void* q;         // [P, 4, 128] fp16
  const void* kbuf;      // [P, 16, 128] bf16
  const void* ubuf;      // [P, 16, 128] bf16
  const void* gbuf;      // [P, 16, 128] fp16
  const float* w;        // [P, 16]
  const float* pcum;     // [P, 128]
  const float* q0;       // [128, 4]
  // outputs
  int8_t* codes_new;     // [P, 128, 128]
  float* s_k_new;        // [P, 128]
  float* s_v_new;        // [P, 128]
  void* u_new;           // [P, 4, 128] fp16
  void* q_new;           // [P, 4, 128] fp16
  int n_programs;        // 32 * B
};

// Launches the flush on `stream` (asynchronous, graph-capturable). Returns the launch error, if any.
cudaError_t leapquant_flush_launch(const FlushParams& p, cudaStream_t stream);
