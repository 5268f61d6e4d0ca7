// SPDX-License-Identifier: Apache-2.0
// LeapQuant KDA flush (leapquant_kda_flush_r4_int8_h32_v128_k128), CUDA C++ for sm_90a: the launch interface.
// Plain C++ (no torch, no CUDA device headers) so that both the torch binding and the kernel file include it.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

struct FlushParams {
  // The checkpoint, read and written per program record. Dense form (idx == nullptr): record = program, each field a
  // dense [P, ...] tensor, outputs beside the inputs. Deployment form (idx != nullptr): the pool's flat buffer in the
  // published engine layout, record = region 33 slot + head (every field REGION bytes apart; rows u | q interleaved),
  // inputs and outputs the same bytes (in place).
  const int8_t* codes;   // [V, K] int8 per record
  const float* s_k;      // [K]
  const float* s_v;      // [V]
  const void* u;         // [R, K] fp16 (rows TOKEN_ROW elements apart)
  const void* q;         // [R, V] fp16
  int8_t* codes_new;
  float* s_k_new;
  float* s_v_new;
  void* u_new;
  void* q_new;
  // the window, dense [records, ...]: record = program (dense form) or 32 slot + head (deployment form, which resets it)
  const void* kbuf;      // [L, K] bf16
  const void* ubuf;      // [L, V] bf16
  void* gbuf;            // [L, K] fp16
  float* w;              // [L]
  float* pcum;           // [K]
  const float* q0;       // [V, R]
  int n_programs;        // 32 * B (dense) or 32 * N (deployment: N = idx's length)
  // deployment form only: program (n, head) flushes (idx[n], head) when count[idx[n]][head] == L; slot 0 or a slot
  // outside [1, num_slots) means no sequence
  const int32_t* idx;    // [N]
  const int32_t* count;  // [num_slots, 32]
  int num_slots;
};

// Launches the flush on `stream` (asynchronous, graph-capturable). Returns the launch error, if any.
cudaError_t leapquant_flush_launch(const FlushParams& p, cudaStream_t stream);
