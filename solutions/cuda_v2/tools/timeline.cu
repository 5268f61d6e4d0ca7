// SPDX-License-Identifier: Apache-2.0
// Where one cuda_v2 program's cycles go, stage by stage: thread 0 of every CTA stamps the 32-bit SM clock at a
// program's entry and after each of its numbered CTA barriers (flush.cu's STAMP hook); this prints the median, 10th
// and 90th percentile cycles of each stage over all programs (B <= 512), and how many output values are not finite
// (a first smoke test; the harness judges correctness). Random in-domain inputs (the numbers barely depend on the
// values: the only data-dependent branches are the rare third Gram-Schmidt pass and the slow paths of IEEE division
// and sqrt).
// Standalone CUDA (no torch), for the H200:
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/cuda_v2_timeline solutions/cuda_v2/tools/timeline.cu
//   /tmp/cuda_v2_timeline 1 64 512          # batch sizes
// B = 1 gives a program alone on its SM, B >= 64 two programs per SM (the kernel's steady state).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

constexpr int MAX_PROGRAMS = 32 * 512, STAMPS = 17;
// a program's stamps by its index (the dense form's record): one compare and one store a stamp, no index arithmetic
// (that would cost the kernel registers, and then spills). Program p runs on CTA p % gridDim.x, after p - gridDim.x.
// Only the dense form is timed, so the deployment form's instantiation carries no stamps (and compiles as in the
// solution).
__device__ unsigned g_stamps[MAX_PROGRAMS][STAMPS];   // clock() (32 bits: one register, differences mod 2^32)
// The row's address is taken afresh each time (cvta of the symbol in an asm volatile): one kept over the program
// costs the kernel registers, and then spills.
#define STAMP(n)                                                                                               \
  do {                                                                                                         \
    unsigned tx_;                                                                                              \
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tx_));                                                          \
    if (!POOL && tx_ == 0 && rec.ck < MAX_PROGRAMS) {                                                          \
      unsigned* base_;                                                                                         \
      asm volatile("cvta.global.u64 %0, g_stamps;" : "=l"(base_));                                            \
      base_[rec.ck * STAMPS + (n)] = static_cast<unsigned>(clock());                                           \
    }                                                                                                          \
  } while (0)
#include "../flush.cu"

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(err));
    std::exit(1);
  }
}

template <typename T>
T* to_device(const std::vector<T>& host) {
  T* dev = nullptr;
  check(cudaMalloc(&dev, host.size() * sizeof(T)), "cudaMalloc");
  check(cudaMemcpy(dev, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
  return dev;
}

template <typename T>
T* output(size_t bytes) {
  T* dev = nullptr;
  check(cudaMalloc(&dev, bytes), "cudaMalloc");
  return dev;
}

// what each stage ends with: stage n runs from stamp n to stamp n + 1 (flush.cu's barrier n after the entry)
const char* const STAGE[STAMPS] = {
    "wait for the staged inputs (#0)", "factors, maxima (#1)", "digits, A^T q0 (#2)", "S^T q0 (#3)",
    "CGS2 #1 (#4)", "digits, splits of qk (#5)", "B qk, C (digits) (#6)", "S qk (#7)", "CGS2 #2 (#8)",
    "digits, splits of qv (#9)", "A^T qv, C^T (digits) (#10)", "S^T qv (#11)", "tokens (#12)",
    "rebuild, abs(E) column sums (#13)", "s_k (#14)", "s_v (#15)", "codes, to the next entry"};

void timeline(int batch, std::mt19937& rng) {
  const int programs = 32 * batch;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  const size_t P = static_cast<size_t>(programs);
  std::vector<int8_t> codes(P * 128 * 128);
  for (auto& c : codes) c = static_cast<int8_t>(static_cast<int>(unit(rng) * 254.0f) - 127);
  std::vector<float> s_k(P * 128), s_v(P * 128), w(P * 16), pcum(P * 128), q0(128 * 4);
  for (auto& x : s_k) x = 0.5f + unit(rng);
  for (auto& x : s_v) x = 0.5f + unit(rng);
  for (auto& x : w) x = unit(rng);
  for (auto& x : pcum) x = -20.0f * unit(rng);
  for (auto& x : q0) x = normal(rng);
  std::vector<__half> u(P * 4 * 128), q(P * 4 * 128), gbuf(P * 16 * 128);
  for (auto& x : u) x = __float2half(normal(rng));
  for (auto& x : q) x = __float2half(0.1f * normal(rng));
  for (auto& x : gbuf) x = __float2half(0.5f + 0.5f * unit(rng));
  std::vector<__nv_bfloat16> kbuf(P * 16 * 128), ubuf(P * 16 * 128);
  for (auto& x : kbuf) x = __float2bfloat16(0.09f * normal(rng));
  for (auto& x : ubuf) x = __float2bfloat16(normal(rng));

  FlushParams p{};
  p.codes = to_device(codes);
  p.s_k = to_device(s_k);
  p.s_v = to_device(s_v);
  p.u = to_device(u);
  p.q = to_device(q);
  p.codes_new = output<int8_t>(codes.size());
  p.s_k_new = output<float>(P * 512);
  p.s_v_new = output<float>(P * 512);
  p.u_new = output<void>(P * 1024);
  p.q_new = output<void>(P * 1024);
  p.kbuf = to_device(kbuf);
  p.ubuf = to_device(ubuf);
  p.gbuf = to_device(gbuf);
  p.w = to_device(w);
  p.pcum = to_device(pcum);
  p.q0 = to_device(q0);
  p.n_programs = programs;

  for (int i = 0; i < 3; ++i) check(leapquant_flush_launch(p, 0), "launch");   // warm-up (and module load)
  check(cudaDeviceSynchronize(), "warm-up");
  static unsigned stamps[MAX_PROGRAMS][STAMPS];
  std::fill(&stamps[0][0], &stamps[0][0] + MAX_PROGRAMS * STAMPS, 0u);
  check(cudaMemcpyToSymbol(g_stamps, stamps, sizeof(stamps)), "clear stamps");
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  check(cudaEventRecord(start), "event");
  check(leapquant_flush_launch(p, 0), "launch");
  check(cudaEventRecord(stop), "event");
  check(cudaDeviceSynchronize(), "run");
  float ms = 0.0f;
  check(cudaEventElapsedTime(&ms, start, stop), "event");
  check(cudaMemcpyFromSymbol(stamps, g_stamps, sizeof(stamps)), "read stamps");

  // outputs: every value finite (fp32 scales, fp16 tokens)
  std::vector<float> sk_out(P * 128), sv_out(P * 128);
  std::vector<__half> tok(P * 4 * 128 * 2);
  check(cudaMemcpy(sk_out.data(), p.s_k_new, P * 512, cudaMemcpyDeviceToHost), "read s_k");
  check(cudaMemcpy(sv_out.data(), p.s_v_new, P * 512, cudaMemcpyDeviceToHost), "read s_v");
  check(cudaMemcpy(tok.data(), p.u_new, P * 1024, cudaMemcpyDeviceToHost), "read u");
  check(cudaMemcpy(tok.data() + P * 512, p.q_new, P * 1024, cudaMemcpyDeviceToHost), "read q");
  size_t bad = 0;
  for (float x : sk_out) bad += !std::isfinite(x);
  for (float x : sv_out) bad += !std::isfinite(x);
  for (__half x : tok) bad += !std::isfinite(__half2float(x));

  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "attribute");
  const int ctas = std::min(programs, 2 * sms);                       // leapquant_flush_launch's grid
  const int stamped = std::min(programs, MAX_PROGRAMS);
  std::vector<std::vector<double>> stage(STAMPS + 1);                 // the last: a whole program, entry to entry
  for (int prog = 0; prog < stamped; ++prog) {
    const unsigned* s = stamps[prog];
    for (int n = 0; n + 1 < STAMPS; ++n) stage[n].push_back(static_cast<double>(s[n + 1] - s[n]));
    if (prog + ctas < stamped) {                                       // the same CTA's next program
      const unsigned next = stamps[prog + ctas][0];
      stage[STAMPS - 1].push_back(static_cast<double>(next - s[STAMPS - 1]));
      stage[STAMPS].push_back(static_cast<double>(next - s[0]));
    }
  }
  std::printf("B=%d: %d programs on %d CTAs, %.1f us (one launch after warm-up), %zu non-finite outputs\n", batch,
              programs, ctas, ms * 1e3, bad);
  for (int n = 0; n <= STAMPS; ++n) {
    auto& v = stage[n];
    const char* name = n < STAMPS ? STAGE[n] : "whole program, entry to entry";
    if (v.empty()) {
      std::printf("  %-34s -\n", name);
      continue;
    }
    std::sort(v.begin(), v.end());
    std::printf("  %-34s %7.0f  (p10 %7.0f, p90 %7.0f) cycles, n=%zu\n", name, v[v.size() / 2], v[v.size() / 10],
                v[v.size() * 9 / 10], v.size());
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s BATCH [BATCH ...]\n", argv[0]);
    return 2;
  }
  std::mt19937 rng(1);
  for (int a = 1; a < argc; ++a) {
    const int batch = std::atoi(argv[a]);
    if (batch < 1) {
      std::fprintf(stderr, "batch size must be >= 1, got %s\n", argv[a]);
      return 2;
    }
    timeline(batch, rng);
  }
  return 0;
}
