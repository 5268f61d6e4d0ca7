// SPDX-License-Identifier: Apache-2.0
// LeapQuant window flush for Kimi Delta Attention (leapquant_kda_flush_r4_int8_h32_v128_k128), CUDA C++ for the
// H200 (sm_90a). Pure CUDA: no torch headers (the CI test compiles this file alone with nvcc).
//
// One CTA of 256 threads (8 warps) per program (= one (sequence, head)); 2 CTAs per SM (<= 128 registers).
// The state is  S = diag(s_v) C diag(cs) + A B,  C the int8 codes, cs = s_k/127 * exp(pcum), and A B the rank-24 part
// with a factor index j (A [V, 32] exact in bf16, B [32, K] fp32 as a three-way bf16 split hi + mid + lo):
//   j <  16: A[v][j] = ubuf_j[v]                       B[j][k] = w_j kbuf_j[k] D_j[k]
//   j 16-19: A = bf16 hi of q_{j-16} (fp16 = hi + lo)   B = u_{j-16}[k] exp(pcum[k])
//   j 20-23: A = bf16 lo of q_{j-20}                    B = u_{j-20}[k] exp(pcum[k])
//   j 24-31: A = hi / lo of q_new (the new tokens)      B = -u_new (hi split: bf16 hi, mid split: the rest, lo: 0)
// The rows j 24-31 exist only for the rebuild, which therefore yields the residual E = S - q_new^T u_new directly.
//
// flush_program runs, in turn:
//  1. stage_factors: codes rows into registers; A^T, B (three splits) and cs, s_v into shared memory; the per-warp
//     maxima of |cs|, |s_v| and |s_v| max_j |q0[v][j]| (the digit scales below).
//  2. subspace_iteration: the three products from the inputs, never from the state:
//       S z   = s_v o C (cs o z)   + A (B z)        (z = qk)
//       S^T x = cs o C^T (s_v o x) + B^T (A^T x)    (x = q0, qv)
//     The code products are exact on int8 tensor cores (mma m16n8k32 s8.s8.s32): the fp32 vector y = cs o z (or
//     s_v o x) is cut into five signed 7-bit digits under one power-of-two scale 2^E per program, E from the maxima
//     of stage 1 (|z|, |x| <= 1 after Gram-Schmidt and |q0| is known, so no reduction waits on the chain):
//       y = 2^(E-6) (d0 + d1 2^-7 + d2 2^-14 + d3 2^-21 + d4 2^-28) + err,  |d_p| <= 64,  |err| <= 2^(E-35).
//     (Four digits, |err| <= 2^(E-28), are less accurate than fp32 products where s_v spans decades: a hot row sets
//     E, the other rows keep few bits.) The digits of pieces 0 / 2 go in as one n-tile, those of 1 / 3 as the next;
//     the int32 accumulator is shifted by 7 bits between them, so it ends with H = 128 I0 + I1 and L = 128 I2 + I3
//     exactly (|I_p| < 2^20 over a full reduction of 128); piece 4 is a third n-tile into an accumulator of its own.
//     Each warp owns 16 output rows over the whole reduction (no partials): C rows by ldmatrix, C^T by
//     ldmatrix.trans + byte permutes (output rows k0 + 2g and k0 + 2g + 1). The rank part contracts
//     (B z, A^T x: two warps, full reductions, 24 x 4 outputs) and expands (A t, B^T t': every warp, its 16 rows) on
//     bf16 tensor cores, the fp32 operands as three-way bf16 splits. CGS2 in warp 0 (a third pass where the second
//     leaves under 1% of a column; a column the second pass finds dependent becomes zero). u_new, q_new to fp16.
//  3. rebuild_residual: E in the mma accumulator layout (warp w: rows v in [32 (w>>1), +32), columns k in
//     [64 (w&1), +64); lane (g, t): rows 32 wr + 16 mt + 8 h + g, columns 64 wc + 16 t + [0, 16), the columns of
//     n-tile nt permuted: accumulator column c -> k = 64 wc + 16 (c>>1) + 2 nt + (c&1)): the codes term elementwise,
//     then A B (j < 32) on bf16 tensor cores.
//  4. quantize_residual: s_k = sqrt(mean_v |E|), s_v = max_k |E| / s_k (clamped 1e-12), codes = round-half-even(
//     E / (s_k s_v) * 127) by the 1.5 * 2^23 magic add in one FFMA, packed 16 bytes per store.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "flush.cuh"

// Profiling hook: tools/timeline.cu defines STAMP(n) to record the SM clock at a program's entry (n = 0) and
// after its numbered barriers (n = barrier + 1), for per-stage cycle counts. Nothing otherwise.
#ifndef STAMP
#define STAMP(n)
#endif

namespace {

constexpr int V = 128, K = 128, L = 16, R = 4;
constexpr int NTHREADS = 256;
constexpr float DEPENDENT_NORM2 = 0x1p-24f;     // CGS2: (2^-12)^2, the squared share of a column a dependent one keeps
constexpr unsigned FULL = 0xffffffffu;
constexpr float MAGIC = 12582912.0f;            // 1.5 * 2^23: x + MAGIC rounds x (|x| < 2^22) half to even
// Row stride (floats) of the vector-major products [j][row] that warp 0 reads before an orthonormalisation (its
// lanes' float4 reads of 4 consecutive rows are conflict-free)
constexpr int PART = K + 4;
// Row stride (32-bit words) of the bf16 splits [n][i] of a vector (B operands of the contractions): 4 banks apart
constexpr int SPLIT = K / 2 + 4;
// Row stride (bf16) of the splits [n][j] of a contraction's result (B operands of the expansions): 12 words, so that
// the 32 lanes' reads (row 8 nt + g, word t) hit 32 distinct banks
constexpr int TROW = 24;

// One program's inputs, brought in by cp.async while the CTA computes the previous program.
struct __align__(16) Stage {
  uint4 codes[V][K / 16];  // row v, 16-byte chunk c stored at c ^ (v & 7): the 8 rows of an ldmatrix are
                           // conflict-free (16 KB)
  uint4 ubuf[L][V / 8];
  uint4 kbuf[L][K / 8];
  uint4 gbuf[L][K / 8];
  uint4 u[R][K / 8];
  uint4 q[R][V / 8];
  float s_k[K], s_v[V], pcum[K], w[L];
};

struct __align__(16) Smem {
  Stage st;                // 32,320 B
  uint4 bsm[3][K][4];      // B as bf16, per split: [k][chunk of 8 j], chunk swizzled by bsm_chunk (24 KB)
  uint4 asm_[32][V / 8];   // A^T as bf16: [j][chunk of 8 v], chunk swizzled by j & 7 so that ldmatrix's 8 rows hit
                           // 8 bank groups (8 KB)
  float red[6 * K];        // products [j][PART] for warp 0 and store_tokens; |E| column sums, row maxima (3 KB)
  float cs[K];             // s_k / 127 * exp(pcum)
  float sv[V];             // s_v (the staging copy is overwritten by the next program's)
  float isk[K];            // 1 / s_k_new
  float q0f[R][V + 8];     // q0, vector-major
  float q0m[V];            // max_j |q0[v][j]|
  float vf[R][V + 8];      // qk, then qv, in fp32, vector-major (warp 0's output of an orthonormalisation)
  uint32_t qsp[16][SPLIT]; // q0 as bf16 splits [split * 4 + vector][v pair] (the same for every program); rows
                           // 12-15 only feed the mma's unused columns
  uint32_t zsp[16][SPLIT]; // qk, then qv, likewise
  uint16_t tsp[16][TROW];  // B z or A^T x (j < 24) as bf16 splits [split * 4 + vector][j]; rows 12-15 unused
  uint2 dig[4][3][32];     // the digits as mma B fragments [k-step][n-tile][lane] (3 KB; n-tile 2's columns 0-3
                           // stay zero)
  alignas(16) uint32_t emax[3][4];   // per-warp maxima (fp32 bits) of |cs|, |s_v|, |s_v| max_j |q0|
  int2 due[NTHREADS];      // deployment form: this round's due programs (Records)
  int due_in_warp[NTHREADS / 32];
  int n_due;
};

// chunk c (v in [8c, 8c + 8)) of row j of the staged A^T
__device__ __forceinline__ uint4& s_a_chunk(Smem& sm, int j, int c) { return sm.asm_[j][c ^ (j & 7)]; }
__device__ __forceinline__ const uint4& s_a_chunk(const Smem& sm, int j, int c) { return sm.asm_[j][c ^ (j & 7)]; }

// Where chunk c (j in [8c, 8c + 8)) of B's row k is stored: 8 rows k hit 8 distinct 16-byte bank groups when they are
// k0 + 16 a + b (the rebuild: a < 4, b < 2) or 8 consecutive ones (the contraction's ldmatrix.trans); 4 when they are
// k0 + 2 r (the expansion, 2-way)
__device__ __forceinline__ int bsm_chunk(int k, int c) { return c ^ (((k >> 4) ^ (k >> 1)) & 3); }

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(smem_dst)), "l"(gmem_src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// %tid.x read afresh: addresses derived from it are recomputed where they are used instead of being kept alive
// (and spilled) across the whole loop body
__device__ __forceinline__ int fresh_tid() {
  uint32_t tx;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tx));
  return static_cast<int>(tx);
}

// Where a program's checkpoint and window live: `ck` indexes the checkpoint records (dense: the program; deployment
// form: region 33 slot + head of the pool), `win` the dense window tensors (the program; 32 slot + head).
struct Records {
  int ck, win;
};

constexpr int POOL_REGION = 65536;                // bytes between the pool's (slot, head) regions
constexpr int POOL_REGIONS_PER_SLOT = 33;         // 32 heads and one spare region a slot

// Byte offset of checkpoint record `rec` of a field whose dense per-program size is `dense_bytes`.
template <bool POOL>
__device__ __forceinline__ size_t ck_offset(int rec, int dense_bytes) {
  return static_cast<size_t>(rec) * static_cast<size_t>(POOL ? POOL_REGION : dense_bytes);
}

// Elements between the token rows of u and of q: dense [R, K] / [R, V]; the pool's rows are u | q, K + V long.
template <bool POOL>
__host__ __device__ constexpr int token_row() { return POOL ? K + V : K; }

template <typename T>
__device__ __forceinline__ const T* at_bytes(const void* base, size_t offset) {
  return reinterpret_cast<const T*>(static_cast<const char*>(base) + offset);
}

// Issue the copies of a program's inputs other than the codes into the staging area (3 or 4 16-byte copies per
// thread). They may start once stage_factors has read the staging area.
template <bool POOL>
__device__ __forceinline__ void prefetch_factors(const FlushParams& p, Stage& st, Records rec) {
  const int tid = fresh_tid();
  const size_t win = static_cast<size_t>(rec.win);
  cp_async16(&st.ubuf[0][0] + tid, static_cast<const uint4*>(p.ubuf) + win * (L * V / 8) + tid);
  cp_async16(&st.kbuf[0][0] + tid, static_cast<const uint4*>(p.kbuf) + win * (L * K / 8) + tid);
  cp_async16(&st.gbuf[0][0] + tid, static_cast<const uint4*>(p.gbuf) + win * (L * K / 8) + tid);
  if (tid < 128) {                              // the 4 token rows of u (tid < 64), then of q: 16 chunks a row
    const int i = tid & 63, row = i >> 4, c = i & 15;
    const void* base = tid < 64 ? p.u : p.q;
    const uint4* src = at_bytes<uint4>(base, ck_offset<POOL>(rec.ck, 2 * R * K) + 2 * row * token_row<POOL>());
    cp_async16((tid < 64 ? &st.u[0][0] : &st.q[0][0]) + i, src + c);
  } else {                                      // 32 chunks each of s_k, s_v, pcum, then the 4 of w
    const int i = (tid - 128) & 31;
    auto chunk = [&](float* dst, const void* src) {
      cp_async16(reinterpret_cast<uint4*>(dst) + i, static_cast<const uint4*>(src) + i);
    };
    if (tid < 160) chunk(st.s_k, at_bytes<float>(p.s_k, ck_offset<POOL>(rec.ck, 4 * K)));
    else if (tid < 192) chunk(st.s_v, at_bytes<float>(p.s_v, ck_offset<POOL>(rec.ck, 4 * V)));
    else if (tid < 224) chunk(st.pcum, p.pcum + win * K);
    else if (tid < 228) chunk(st.w, p.w + win * L);
  }
  cp_async_commit();
}

// Issue the copies of a program's codes (4 per thread). They may start once the last code product has read them.
template <bool POOL>
__device__ __forceinline__ void prefetch_codes(const FlushParams& p, Stage& st, Records rec) {
  const int tid = fresh_tid();
  const uint4* codes = at_bytes<uint4>(p.codes, ck_offset<POOL>(rec.ck, V * K));
#pragma unroll
  for (int n = 0; n < 4; ++n) {
    const int i = tid + NTHREADS * n, v = i >> 3, c = i & 7;
    cp_async16(&st.codes[v][c ^ (v & 7)], codes + i);
  }
  cp_async_commit();
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

__device__ __forceinline__ void ldsm_x2(uint32_t addr, uint32_t& r0, uint32_t& r1) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r0), "=r"(r1)
               : "r"(addr)
               : "memory");
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

__device__ __forceinline__ void ldsm_x2_trans(uint32_t addr, uint32_t& r0, uint32_t& r1) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r0), "=r"(r1)
               : "r"(addr)
               : "memory");
}

__device__ __forceinline__ void mma_bf16_k16(float (&c)[4], const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_bf16_k8(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(b0));
}

// int8 x int8 -> int32, exact
__device__ __forceinline__ void mma_s8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// (a, b) rounded to a bf16 pair, a in the low half
__device__ __forceinline__ uint32_t bf16_pair(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return reinterpret_cast<const uint32_t&>(h);
}

// what is left of (a, b) after the bf16 pair hi (exact in fp32)
__device__ __forceinline__ void pair_rest(float a, float b, uint32_t hi, float& ra, float& rb) {
  ra = a - __uint_as_float(hi << 16);
  rb = b - __uint_as_float(hi & 0xffff0000u);
}

// (a, b) = hi + lo, each a bf16 pair (a two-way split: 16 significant bits; exact for fp16 values)
__device__ __forceinline__ void split2_pair(float a, float b, uint32_t& hi, uint32_t& lo) {
  float ra, rb;
  hi = bf16_pair(a, b);
  pair_rest(a, b, hi, ra, rb);
  lo = bf16_pair(ra, rb);
}

__device__ __forceinline__ float bf16_val(uint32_t bits) { return __uint_as_float(bits << 16); }

// (a, b) = hi + mid + lo, each a bf16 pair (24 significant bits in all: the fp32 values up to their last bit or so).
// One cvt.rn.bf16x2 rounds both halves of a part.
__device__ __forceinline__ void split3_pair(float a, float b, uint32_t& h, uint32_t& m, uint32_t& l) {
  float ra, rb;
  h = bf16_pair(a, b);
  pair_rest(a, b, h, ra, rb);
  split2_pair(ra, rb, m, l);
}

// MUFU square root and reciprocal (about 1 ulp): enough for the scales, because the codes are computed with the very
// values that are stored as s_k and s_v (the decoded state is what is judged, not the rounding of a scale)
__device__ __forceinline__ float approx_sqrt(float x) {
  float y;
  asm("sqrt.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float approx_rcp(float x) {
  float y;
  asm("rcp.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float h2f(uint16_t bits) { return __half2float(__ushort_as_half(bits)); }

// 2^e for e in [-126, 127]
__device__ __forceinline__ float exp2i(int e) { return __int_as_float((127 + e) << 23); }

// N sums over the warp at once (butterfly): N independent chains, so N values cost the latency of one
template <int N>
__device__ __forceinline__ void warp_sums(float (&d)[N]) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1)
#pragma unroll
    for (int i = 0; i < N; ++i) d[i] += __shfl_xor_sync(FULL, d[i], m);
}

// One level of a shuffle reduce-scatter: v[0, 2n) -> v[0, n), the upper half kept where `upper`.
template <int N2>
__device__ __forceinline__ void rs_level(float* v, bool upper, int mask) {
  constexpr int N = N2 / 2;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float send = upper ? v[i] : v[i + N];
    const float keep = upper ? v[i + N] : v[i];
    v[i] = keep + __shfl_xor_sync(FULL, send, mask);
  }
}

// sum_i x[i][p] y[i][j] over this lane's 4 rows (the warp sum follows)
__device__ __forceinline__ float lane_dot(const float (&x)[4][4], int p, const float (&y)[4][4], int j) {
  float d = x[0][p] * y[0][j];
#pragma unroll
  for (int i = 1; i < 4; ++i) d = fmaf(x[i][p], y[i][j], d);
  return d;
}

__device__ __forceinline__ void subtract(float (&a)[4][4], int j, int p, float coef) {
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i][j] = fmaf(-a[i][p], coef, a[i][j]);
}

// Column J of the orthonormalisation (columns < J final; r[p] = c_p . a_J for p < J, from the previous round). One
// round of warp sums holds the second-pass dots d_p = c_p . v of the first-pass vector v, its squared norm, and the
// dots e = v . a_{J+1}, f_p = c_p . a_{J+1} that give column J + 1's first-pass coefficients once c_J is known:
// c_J . a_{J+1} = (e - sum_p d_p f_p) / n_J. The norm after the second pass is ||v||^2 - sum_p d_p^2; where that
// cancels (v almost in the span of c_0 .. c_{J-1}: rank-deficient heads) it is measured in a round of its own.
template <int J>
__device__ __forceinline__ void cgs2_column(float (&a)[4][4], float (&r)[R]) {
  constexpr bool NEXT = J + 1 < R;
  constexpr int N = 1 + J + (NEXT ? 1 + J : 0);     // ||v||^2, d_p, then e, f_p
  constexpr int JN = NEXT ? J + 1 : J;
#pragma unroll
  for (int p = 0; p < J; ++p) subtract(a, J, p, r[p]);
  float s[N];
  s[0] = lane_dot(a, J, a, J);
#pragma unroll
  for (int p = 0; p < J; ++p) s[1 + p] = lane_dot(a, p, a, J);
  if (NEXT) {
    s[1 + J] = lane_dot(a, J, a, JN);
#pragma unroll
    for (int p = 0; p < J; ++p) s[2 + J + p] = lane_dot(a, p, a, JN);
  }
  warp_sums(s);
  float nn = s[0];
#pragma unroll
  for (int p = 0; p < J; ++p) {
    subtract(a, J, p, s[1 + p]);
    nn = fmaf(-s[1 + p], s[1 + p], nn);
  }
  // The second pass left under 1% of the column (in norm): it is nearly inside the span of c_0 .. c_{J-1}, and the
  // second pass's own rounding (relative to the first-pass vector) can still be 2^-24 / 1% of what remains, along
  // those columns: a third pass restores orthogonality (without it, fp16 rounding of a hot-row head's token kept an
  // overlap of ~1e-3 with the first, whose u row then carried ~1e-3 of the whole state into the residual). Its norm
  // is measured directly, since ||v||^2 - sum_p d_p^2 cancels here. Warp-uniform: every lane holds the same sums.
  if (J > 0 && !(nn > 1e-4f * s[0])) {
    float t[1 + J];
    t[0] = lane_dot(a, J, a, J);
#pragma unroll
    for (int p = 0; p < J; ++p) t[1 + p] = lane_dot(a, p, a, J);
    warp_sums(t);
    nn = t[0];
#pragma unroll
    for (int p = 0; p < J; ++p) {
      subtract(a, J, p, t[1 + p]);
      nn = fmaf(-t[1 + p], t[1 + p], nn);
      if (NEXT) s[1 + J] = fmaf(-t[1 + p], s[2 + J + p], s[1 + J]);   // keeps e = c_J . a_{J+1} (times n_J)
    }
  }
  // A second pass that leaves less than 2^-12 of the column (in norm) found it to be rounding inside the span of
  // c_0 .. c_{J-1} (a rank-deficient state): the column becomes zero, a zero token, rather than normalised rounding,
  // whose direction can lie along an earlier column (the projections' own rounding does) and whose squared norm can
  // flush to zero (a 1e30 "unit" column that overflows q_new's fp16). What is dropped is below the column's rounding.
  const bool dependent = J > 0 && !(nn > DEPENDENT_NORM2 * s[0]);
  const float inv = dependent ? 0.0f : fminf(rsqrtf(nn), 1e30f);   // 1 / max(||c_J||, 1e-30), the reference's clamp
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i][J] *= inv;
  if (NEXT) {
    float e = s[1 + J];
#pragma unroll
    for (int p = 0; p < J; ++p) {
      r[p] = s[2 + J + p];
      e = fmaf(-s[1 + p], s[2 + J + p], e);
    }
    r[J] = e * inv;
  }
}

// Orthonormalise the 4 columns of a [128, 4] matrix held by one warp (lane l holds rows 4 l + i in a[i][0..3]):
// classical Gram-Schmidt with one reorthogonalisation (CGS2: as accurate as the reference's MGS2, "twice is
// enough"), the norm clamped at 1e-30 as in the reference. The warp reductions are the critical path (the other
// 7 warps wait at a barrier), so each column takes one round of warp sums: 4 rounds instead of MGS2's 16.
__device__ __forceinline__ void cgs2(float (&a)[4][4]) {
  float r[R];
  cgs2_column<0>(a, r);
  cgs2_column<1>(a, r);
  cgs2_column<2>(a, r);
  cgs2_column<3>(a, r);
}

// byte `sel` (0..3) of x (int8, pre-xored with 0x80) as an exact fp32: 2^23 + (b ^ 0x80) - (2^23 + 128)
__device__ __forceinline__ float s8_to_f32(uint32_t xored, int sel) {
  return __uint_as_float(__byte_perm(xored, 0x4B000000u, 0x7650u | sel)) - 8388736.0f;
}

// low bytes of four fp32 words -> one 32-bit word (byte 0 from a)
__device__ __forceinline__ uint32_t pack_low_bytes(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  const uint32_t ab = __byte_perm(a, b, 0x0040u);
  const uint32_t cd = __byte_perm(c, d, 0x0040u);
  return __byte_perm(ab, cd, 0x5410u);
}

// This thread's place in the state layout (file header): warp (wr, wc), lane (g, t), its 16 columns from colbase.
struct Place {
  int tid, lane, warp, g, t, wr, wc, colbase;
  // row of (mt, h), ri = 2 mt + h
  __device__ __forceinline__ int row(int ri) const { return 32 * wr + 16 * (ri >> 1) + 8 * (ri & 1) + g; }
};

__device__ __forceinline__ Place this_place() {
  Place at;
  at.tid = fresh_tid();
  at.lane = at.tid & 31;
  at.warp = at.tid >> 5;
  at.g = at.lane >> 2;
  at.t = at.lane & 3;
  at.wr = at.warp >> 1;
  at.wc = at.warp & 1;
  at.colbase = 64 * at.wc + 16 * at.t;
  return at;
}

// ---- 1. factors ------------------------------------------------------------------------------------------------

// From the staging area, before it is released to the next program's copies (the codes stay until the last code
// product): this lane's codes rows (16 B a row) into registers; A^T (ubuf, hi / lo of q), B (three bf16 splits), cs
// and s_v into shared memory, and the per-warp maxima that set the digit scales.
__device__ __forceinline__ void stage_factors(Smem& sm, uint4 (&cw)[4]) {
  const Place at = this_place();
  const int tid = at.tid;
  const Stage& st = sm.st;
#pragma unroll
  for (int ri = 0; ri < 4; ++ri) {
    const int v = at.row(ri);
    cw[ri] = st.codes[v][(at.colbase >> 4) ^ (v & 7)];
  }
  {
    const int j = tid >> 4, c = tid & 15;
    s_a_chunk(sm, j, c) = st.ubuf[j][c];
    if (tid < 64) {
      const uint4 q8 = st.q[j][c];                       // q_j[8c .. 8c + 7]
      const uint32_t qw[4] = {q8.x, q8.y, q8.z, q8.w};
      uint32_t hi[4], lo[4];                           // an fp16 value is exactly hi + lo
#pragma unroll
      for (int i = 0; i < 4; ++i)
        split2_pair(h2f(static_cast<uint16_t>(qw[i])), h2f(static_cast<uint16_t>(qw[i] >> 16)), hi[i], lo[i]);
      s_a_chunk(sm, L + j, c) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
      s_a_chunk(sm, L + R + j, c) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    }
  }
  {
    const uint16_t* kbuf = reinterpret_cast<const uint16_t*>(st.kbuf);
    const uint16_t* gbuf = reinterpret_cast<const uint16_t*>(st.gbuf);
    const uint16_t* u = reinterpret_cast<const uint16_t*>(st.u);
    const int idx = tid & 127, half = tid >> 7;
    // a permutation of the columns so that 8 consecutive lanes store to 8 distinct 16-byte bank groups
    const int k = (idx & 1) | (((idx >> 1) & 3) << 4) | (((idx >> 3) & 7) << 1) | ((idx >> 6) << 6);
    const float dec = expf(st.pcum[k]);
    float D = 1.0f;                                    // D_j = prod_{i > j} gbuf_i, in the reference's order
    if (half == 0) {
#pragma unroll
      for (int j = L - 1; j >= 8; --j) D *= h2f(gbuf[j * K + k]);
    }
    const int jtop = half ? 15 : 7;
    uint32_t hw[4], mw[4], lw[4];                      // packed bf16 pairs: word i holds j&7 = 2i (low), 2i + 1
#pragma unroll
    for (int pp = 0; pp < 4; ++pp) {                   // pairs from the top: j = jtop - 2 pp, jtop - 2 pp - 1
      float val[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = jtop - 2 * pp - e;
        const float kv = bf16_val(kbuf[j * K + k]);
        val[1 - e] = st.w[j] * (kv * D);
        D *= h2f(gbuf[j * K + k]);
      }
      split3_pair(val[0], val[1], hw[3 - pp], mw[3 - pp], lw[3 - pp]);
    }
    const int chunk = bsm_chunk(k, half);              // logical chunk = half (j >> 3)
    sm.bsm[0][k][chunk] = make_uint4(hw[0], hw[1], hw[2], hw[3]);
    sm.bsm[1][k][chunk] = make_uint4(mw[0], mw[1], mw[2], mw[3]);
    sm.bsm[2][k][chunk] = make_uint4(lw[0], lw[1], lw[2], lw[3]);
    if (half == 1) {
      // j 16..23: u_r exp(pcum) twice (against the hi and the lo of q)
      uint32_t uh[2], um[2], ul[2];                  // pairs (r 0, 1) and (r 2, 3)
#pragma unroll
      for (int r = 0; r < R; r += 2)
        split3_pair(h2f(u[r * K + k]) * dec, h2f(u[(r + 1) * K + k]) * dec, uh[r / 2], um[r / 2], ul[r / 2]);
      const int c2 = bsm_chunk(k, 2);
      sm.bsm[0][k][c2] = make_uint4(uh[0], uh[1], uh[0], uh[1]);
      sm.bsm[1][k][c2] = make_uint4(um[0], um[1], um[0], um[1]);
      sm.bsm[2][k][c2] = make_uint4(ul[0], ul[1], ul[0], ul[1]);
    } else {
      // warps 0-3: cs[k] and s_v[tid], and the warp maxima of |cs|, |s_v|, |s_v| max_j |q0| (fp32 bits of
      // non-negative values order as the values)
      const float c = (st.s_k[k] * (1.0f / 127.0f)) * dec;
      const float s = st.s_v[tid];
      sm.cs[k] = c;
      sm.sv[tid] = s;
      const uint32_t m_cs = __reduce_max_sync(FULL, __float_as_uint(fabsf(c)));
      const uint32_t m_sv = __reduce_max_sync(FULL, __float_as_uint(fabsf(s)));
      const uint32_t m_y0 = __reduce_max_sync(FULL, __float_as_uint(fabsf(s) * sm.q0m[tid]));
      if (at.lane == 0) {
        sm.emax[0][at.warp] = m_cs;
        sm.emax[1][at.warp] = m_sv;
        sm.emax[2][at.warp] = m_y0;
      }
    }
  }
}

// ---- 2. subspace iteration -------------------------------------------------------------------------------------

// The digit exponent E of maximum `which` (0: cs, 1: s_v, 2: s_v |q0|): the least power of two 2^E at or above it,
// within [2^-100, 2^100] (a zero or subnormal maximum gives 2^-100, whose digits are all zero or nearly)
__device__ __forceinline__ int digit_exponent(const Smem& sm, int which) {
  const uint4 m4 = *reinterpret_cast<const uint4*>(sm.emax[which]);
  const uint32_t m = max(max(m4.x, m4.y), max(m4.z, m4.w));
  const int e = static_cast<int>(m >> 23) - 127 + ((m & 0x7fffffu) != 0u);
  return min(max(e, -100), 100);
}

// The five 7-bit digits of y = scale o x (vector x [R][V + 8], the thread's two consecutive entries i, i + 1 of
// vector tid >> 6) into the mma B fragments `dig`, and x's three bf16 splits into `splits` (unless null).
// Piece p < 4 of column (vector) n sits in n-tile p & 1, fragment column n + 4 (p >> 1); piece 4 in n-tile 2,
// column n + 4 (beside L = 128 I2 + I3 in the lanes that hold it). Fragment row kk of a k-step
// (32 reduction indices) is index 32 s + kk for C z (TRANS false); for C^T y (TRANS true) rows kk = 4 t + e and
// 16 + 4 t + e stand for v = 32 s + {2t, 2t + 1, 8 + 2t, 9 + 2t}[e] and 16 more (the byte transpose's order).
template <bool TRANS>
__device__ __forceinline__ void stage_digits(Smem& sm, const float (*x)[V + 8], int E, uint32_t (*splits)[SPLIT]) {
  const int tid = fresh_tid();
  const int n = tid >> 6, i = 2 * (tid & 63);
  const float2 xv = *reinterpret_cast<const float2*>(&x[n][i]);
  const float2 sc = *reinterpret_cast<const float2*>((TRANS ? sm.sv : sm.cs) + i);
  const float scl = exp2i(6 - E);                    // |y| <= 2^E -> |r| <= 64 (exact scaling)
  float r0 = (sc.x * xv.x) * scl, r1 = (sc.y * xv.y) * scl;
  const int s = i >> 5, half = (i >> 4) & 1;
  const int t = TRANS ? (i & 7) >> 1 : (i >> 2) & 3;
  const int e0 = TRANS ? 2 * ((i >> 3) & 1) : i & 3;
  unsigned char* frag = reinterpret_cast<unsigned char*>(&sm.dig[s][0][4 * n + t]) + 4 * half + e0;
#pragma unroll
  for (int p = 0; p < 5; ++p) {
    const float m0 = r0 + MAGIC, m1 = r1 + MAGIC;   // low bytes: the digits rint(r0), rint(r1) (two's complement)
    *reinterpret_cast<uint16_t*>(frag + (p < 4 ? 256 * (p & 1) + 128 * (p >> 1) : 512 + 128)) =
        static_cast<uint16_t>(__byte_perm(__float_as_uint(m0), __float_as_uint(m1), 0x0040u));
    if (p < 4) {                                     // the rest, exactly, 7 bits up
      r0 = (r0 - (m0 - MAGIC)) * 128.0f;
      r1 = (r1 - (m1 - MAGIC)) * 128.0f;
    }
  }
  if (splits != nullptr) {
    uint32_t h, m, l;
    split3_pair(xv.x, xv.y, h, m, l);
    splits[n][i >> 1] = h;
    splits[R + n][i >> 1] = m;
    splits[2 * R + n][i >> 1] = l;
  }
}

// The two shifted passes over the k-steps: H = 128 I0 + I1 in columns 0-3, L = 128 I2 + I3 in columns 4-7; then
// I4 in columns 4-7 of d4 (its columns 0-3 are zero).
__device__ __forceinline__ void digit_passes(const Smem& sm, int lane, const uint32_t (&a)[4][4], int (&d)[4],
                                             int (&d4)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) d[i] = 0;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const uint2 b = sm.dig[s][0][lane];
    mma_s8(d, a[s], b.x, b.y);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) d[i] <<= 7;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const uint2 b = sm.dig[s][1][lane];
    mma_s8(d, a[s], b.x, b.y);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) d4[i] = 0;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const uint2 b = sm.dig[s][2][lane];
    mma_s8(d4, a[s], b.x, b.y);
  }
}

// C (digits) for this warp's rows v = 16 warp + g (+8): A fragments straight from the staged codes by ldmatrix.
__device__ __forceinline__ void codes_times(const Smem& sm, int (&d)[4], int (&d4)[4]) {
  const int tx = fresh_tid(), warp = tx >> 5, lane = tx & 31;
  const int v = 16 * warp + 8 * ((lane >> 3) & 1) + (lane & 7);
  uint32_t a[4][4];
#pragma unroll
  for (int s = 0; s < 4; ++s) ldsm_x4(smem_u32(&sm.st.codes[v][(2 * s + (lane >> 4)) ^ (v & 7)]), a[s]);
  digit_passes(sm, lane, a, d, d4);
}

// C^T (digits) for this warp's rows k = 16 warp + 2 g (d[0], d[1]) and + 1 (d[2], d[3]). ldmatrix.trans of 8 rows v
// x 16 bytes gives lane (g, t) the bytes (v0 + 2t, k0 + 2g), (v0 + 2t, k0 + 2g + 1), (v0 + 2t + 1, k0 + 2g),
// (v0 + 2t + 1, k0 + 2g + 1); two such words (v0 and v0 + 8) permuted give the 4 v of columns k0 + 2g, k0 + 2g + 1.
__device__ __forceinline__ void codes_t_times(const Smem& sm, int (&d)[4], int (&d4)[4]) {
  const int tx = fresh_tid(), warp = tx >> 5, lane = tx & 31;
  const int vr = 8 * (lane >> 3) + (lane & 7);      // matrix lane >> 3 covers v = 32 s + 8 (lane >> 3) + [0, 8)
  uint32_t a[4][4];
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    uint32_t x[4];
    ldsm_x4_trans(smem_u32(&sm.st.codes[32 * s + vr][warp ^ (lane & 7)]), x);
    a[s][0] = __byte_perm(x[0], x[1], 0x6420u);
    a[s][1] = __byte_perm(x[0], x[1], 0x7531u);
    a[s][2] = __byte_perm(x[2], x[3], 0x6420u);
    a[s][3] = __byte_perm(x[2], x[3], 0x7531u);
  }
  digit_passes(sm, lane, a, d, d4);
}

// A contraction's result (24 rows j of 4 vectors, 16 mt + g (+8) in this warp's e[n-tile]: the columns are (split of
// the vector, vector)) summed over the splits and stored as three bf16 splits in tsp.
__device__ __forceinline__ void store_contraction(Smem& sm, int mt, int lane, const float (&e)[2][4]) {
  const int g = lane >> 2, t = lane & 3;
  float sh[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) sh[i] = __shfl_xor_sync(FULL, e[0][i], 2);   // lane t + 2: the mid split's columns
  if (t < 2) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int j = 16 * mt + 8 * h + g;
      if (j < 24) {
        const float a = (e[1][2 * h] + sh[2 * h]) + e[0][2 * h];            // (lo + mid) + hi, vector 2t
        const float b = (e[1][2 * h + 1] + sh[2 * h + 1]) + e[0][2 * h + 1];
        uint32_t hw, mw, lw;
        split3_pair(a, b, hw, mw, lw);
        const uint32_t w3[3] = {hw, mw, lw};
#pragma unroll
        for (int sp = 0; sp < 3; ++sp) {
          sm.tsp[4 * sp + 2 * t][j] = static_cast<uint16_t>(w3[sp]);
          sm.tsp[4 * sp + 2 * t + 1][j] = static_cast<uint16_t>(w3[sp] >> 16);
        }
      }
    }
  }
}

// t = B z (warps 0, 1: m-tile mt of rows j; rows 24-31 are not stored) on bf16 tensor cores, B's three splits each
// against z's three (the n-tiles' columns), one accumulator chain per split of B.
__device__ __forceinline__ void window_times(Smem& sm) {
  const int tx = fresh_tid(), mt = tx >> 5, lane = tx & 31;
  const int g = lane >> 2, t = lane & 3, m = lane >> 3;
  float d[3][2][4] = {};
  const uint32_t bbase = smem_u32(&sm.bsm[0][0][0]);
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    uint32_t b[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      b[nt][0] = sm.zsp[8 * nt + g][8 * s + t];
      b[nt][1] = sm.zsp[8 * nt + g][8 * s + 4 + t];
    }
    // matrix m: rows k = 16 s + 8 (m >> 1) + [0, 8), chunk 2 mt + (m & 1), transposed
    const int k = 16 * s + 8 * (m >> 1) + (lane & 7);
    const uint32_t off = static_cast<uint32_t>(k * 64 + (bsm_chunk(k, 2 * mt + (m & 1)) << 4));
#pragma unroll
    for (int sp = 0; sp < 3; ++sp) {
      uint32_t a[4];
      ldsm_x4_trans(bbase + sp * K * 64 + off, a);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) mma_bf16_k16(d[sp][nt], a, b[nt][0], b[nt][1]);
    }
  }
  float e[2][4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) e[nt][i] = (d[2][nt][i] + d[1][nt][i]) + d[0][nt][i];
  store_contraction(sm, mt, lane, e);
}

// t' = A^T x (warps 0, 1: m-tile mt of rows j) on bf16 tensor cores: A exact, x as three splits (the columns).
__device__ __forceinline__ void factors_t_times(Smem& sm, const uint32_t (*xs)[SPLIT]) {
  const int tx = fresh_tid(), mt = tx >> 5, lane = tx & 31;
  const int g = lane >> 2, t = lane & 3, m = lane >> 3;
  float d[2][4] = {};
  const int j = 16 * mt + 8 * (m & 1) + (lane & 7);  // matrix m: rows j, v chunk 2 s + (m >> 1)
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    uint32_t a[4];
    ldsm_x4(smem_u32(&s_a_chunk(sm, j, 2 * s + (m >> 1))), a);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
      mma_bf16_k16(d[nt], a, xs[8 * nt + g][8 * s + t], xs[8 * nt + g][8 * s + 4 + t]);
  }
  store_contraction(sm, mt, lane, d);
}

// A t for this warp's rows v = 16 warp + g (+8) (A exact, t as three splits: columns (split, vector)).
__device__ __forceinline__ void factors_times(const Smem& sm, float (&r)[2][4]) {
  const int tx = fresh_tid(), warp = tx >> 5, lane = tx & 31;
  const int g = lane >> 2, t = lane & 3, m = (lane >> 3) & 3, r8 = lane & 7;
  const int vc = 2 * warp + (m & 1);
  uint32_t afr[6];
  ldsm_x4_trans(smem_u32(&s_a_chunk(sm, r8 + 8 * (m >> 1), vc)), reinterpret_cast<uint32_t(&)[4]>(afr[0]));
  ldsm_x2_trans(smem_u32(&s_a_chunk(sm, L + r8, vc)), afr[4], afr[5]);
  const uint32_t* tw = reinterpret_cast<const uint32_t*>(&sm.tsp[0][0]);
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const uint32_t* row = tw + (8 * nt + g) * (TROW / 2);
    r[nt][0] = r[nt][1] = r[nt][2] = r[nt][3] = 0.0f;
    mma_bf16_k16(r[nt], afr, row[t], row[4 + t]);
    mma_bf16_k8(r[nt], afr[4], afr[5], row[8 + t]);
  }
}

// B^T t' for this warp's rows k = 16 warp + 2 g (+1) (the order of codes_t_times): B's three splits against t'
// as three splits.
__device__ __forceinline__ void window_t_times(const Smem& sm, float (&r)[2][4]) {
  const int tx = fresh_tid(), warp = tx >> 5, lane = tx & 31;
  const int g = lane >> 2, t = lane & 3, m = lane >> 3;
  const int k = 16 * warp + 2 * (lane & 7) + (m & 1);   // matrix m: row k, chunk m >> 1; the x2: chunk 2
  const uint32_t bbase = smem_u32(&sm.bsm[0][0][0]);
  const uint32_t off01 = static_cast<uint32_t>(k * 64 + (bsm_chunk(k, m >> 1) << 4));
  const uint32_t off2 = static_cast<uint32_t>(k * 64 + (bsm_chunk(k, 2) << 4));
  const uint32_t* tw = reinterpret_cast<const uint32_t*>(&sm.tsp[0][0]);
  uint32_t b[2][3];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const uint32_t* row = tw + (8 * nt + g) * (TROW / 2);
    b[nt][0] = row[t];
    b[nt][1] = row[4 + t];
    b[nt][2] = row[8 + t];
    r[nt][0] = r[nt][1] = r[nt][2] = r[nt][3] = 0.0f;
  }
#pragma unroll
  for (int sp = 2; sp >= 0; --sp) {                  // lo, mid, hi
    uint32_t a[4], a2[2];
    ldsm_x4(bbase + sp * K * 64 + off01, a);
    ldsm_x2(bbase + sp * K * 64 + off2, a2[0], a2[1]);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      mma_bf16_k16(r[nt], a, b[nt][0], b[nt][1]);
      mma_bf16_k8(r[nt], a2[0], a2[1], b[nt][2]);
    }
  }
}

// One product's rows into red[vector][row]: scale[row] * 2^(E-6) (H 2^-7 + (L 2^-21 + I4 2^-28)) + the rank part
// (columns (split, vector): (lo + mid) + hi). Lanes t < 2 hold H and the hi split of vectors 2t, 2t + 1; lane t + 2
// L, I4 and mid.
template <bool TRANS>
__device__ __forceinline__ void store_product(Smem& sm, int E, const int (&d)[4], const int (&d4)[4],
                                              const float (&r)[2][4]) {
  const int tx = fresh_tid(), warp = tx >> 5, lane = tx & 31;
  const int g = lane >> 2, t = lane & 3;
  const float w_hi = exp2i(E - 13);
  const float wgt = t < 2 ? w_hi : w_hi * 0x1p-14f;  // exact scalings (the conversions of H and L may round)
  const float w4 = w_hi * 0x1p-21f;
  float f[4], sh[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[i] = fmaf(__int2float_rn(d4[i]), w4, __int2float_rn(d[i]) * wgt);
    f[i] += __shfl_xor_sync(FULL, f[i], 2);
    sh[i] = __shfl_xor_sync(FULL, r[0][i], 2);
  }
  if (t < 2) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = TRANS ? 16 * warp + 2 * g + (i >> 1) : 16 * warp + 8 * (i >> 1) + g;
      const float scale = TRANS ? sm.cs[row] : sm.sv[row];
      sm.red[(2 * t + (i & 1)) * PART + row] = fmaf(scale, f[i], (r[1][i] + sh[i]) + r[0][i]);
    }
  }
}

// Warp 0: the [128, 4] product in red orthonormalised (CGS2) into vf.
__device__ __forceinline__ void orthonormalise(Smem& sm) {
  const int lane = fresh_tid() & 31;
  float a[4][4];
#pragma unroll
  for (int j = 0; j < R; ++j) {
    const float4 s = *reinterpret_cast<const float4*>(sm.red + j * PART + 4 * lane);
    a[0][j] = s.x; a[1][j] = s.y; a[2][j] = s.z; a[3][j] = s.w;
  }
  cgs2(a);
#pragma unroll
  for (int n = 0; n < R; ++n)
    *reinterpret_cast<float4*>(&sm.vf[n][4 * lane]) = make_float4(a[0][n], a[1][n], a[2][n], a[3][n]);
}

// u_new = fp16(S^T qv) and q_new = fp16(qv), each thread two values of each: to global memory, and into the rebuild's
// factors j 24-31 (A^T rows: hi / lo of q_new; B chunk 3: -u_new as hi | rest | 0, exact for fp16 values).
template <bool POOL>
__device__ __forceinline__ void store_tokens(const FlushParams& p, Smem& sm, Records rec) {
  const int tx = fresh_tid();                        // (from tid, it spills in the deployment form)
  const int k = tx >> 1, hf = tx & 1, jp = 2 * hf;
  const __half h0 = __float2half_rn(sm.red[jp * PART + k]), h1 = __float2half_rn(sm.red[(jp + 1) * PART + k]);
  __half* u_new = reinterpret_cast<__half*>(static_cast<char*>(p.u_new) + ck_offset<POOL>(rec.ck, 2 * R * K));
  u_new[jp * token_row<POOL>() + k] = h0;
  u_new[(jp + 1) * token_row<POOL>() + k] = h1;
  {
    uint32_t hi, lo;
    split2_pair(-__half2float(h0), -__half2float(h1), hi, lo);
    const int c3 = bsm_chunk(k, 3);
    uint32_t* b0 = reinterpret_cast<uint32_t*>(&sm.bsm[0][k][c3]);
    uint32_t* b1 = reinterpret_cast<uint32_t*>(&sm.bsm[1][k][c3]);
    uint32_t* b2 = reinterpret_cast<uint32_t*>(&sm.bsm[2][k][c3]);
    b0[hf] = hi; b0[2 + hf] = hi;                    // j 24 + jp, 25 + jp (against hi(q_new)), 28 + jp, 29 + jp (lo)
    b1[hf] = lo; b1[2 + hf] = lo;
    b2[hf] = 0u; b2[2 + hf] = 0u;
  }
  // q_new = fp16(qv): thread (v, pair) rounds qv_{jp}[v], qv_{jp + 1}[v]
  const int v = k;
  const __half q0h = __float2half_rn(sm.vf[jp][v]), q1h = __float2half_rn(sm.vf[jp + 1][v]);
  __half* q_new = reinterpret_cast<__half*>(static_cast<char*>(p.q_new) + ck_offset<POOL>(rec.ck, 2 * R * V));
  q_new[jp * token_row<POOL>() + v] = q0h;
  q_new[(jp + 1) * token_row<POOL>() + v] = q1h;
  {
    uint32_t hi, lo;
    split2_pair(__half2float(q0h), __half2float(q1h), hi, lo);
    auto put = [&](int j, uint32_t bits) {
      reinterpret_cast<uint16_t*>(&s_a_chunk(sm, j, v >> 3))[v & 7] = static_cast<uint16_t>(bits);
    };
    put(24 + jp, hi); put(25 + jp, hi >> 16);
    put(28 + jp, lo); put(29 + jp, lo >> 16);
  }
}

// S^T q0, CGS2, S qk, CGS2, S^T qv from the inputs; u_new, q_new stored. Barriers #2-#12. The next program's codes
// are requested once the last code product has read this one's (#10).
template <bool POOL>
__device__ __forceinline__ void subspace_iteration(const FlushParams& p, Smem& sm, Records rec, Records next,
                                                   bool has_next) {
  // the warp index read afresh at each use (addresses derived from one kept over the program spill)
  auto warp = [] { return fresh_tid() >> 5; };
  int d[4], d4[4];
  float r[2][4];
  // S^T q0
  stage_digits<true>(sm, sm.q0f, digit_exponent(sm, 2), nullptr);
  if (warp() < 2) factors_t_times(sm, sm.qsp);
  __syncthreads();                                                                                   // #2
  STAMP(3);
  codes_t_times(sm, d, d4);
  window_t_times(sm, r);
  store_product<true>(sm, digit_exponent(sm, 2), d, d4, r);
  __syncthreads();                                                                                   // #3
  STAMP(4);
  if (warp() == 0) orthonormalise(sm);                                                               // qk
  __syncthreads();                                                                                   // #4
  STAMP(5);
  // S qk
  stage_digits<false>(sm, sm.vf, digit_exponent(sm, 0), sm.zsp);
  __syncthreads();                                                                                   // #5
  STAMP(6);
  if (warp() < 2) window_times(sm);
  codes_times(sm, d, d4);
  __syncthreads();                                                                                   // #6
  STAMP(7);
  factors_times(sm, r);
  store_product<false>(sm, digit_exponent(sm, 0), d, d4, r);
  __syncthreads();                                                                                   // #7
  STAMP(8);
  if (warp() == 0) orthonormalise(sm);                                                               // qv
  __syncthreads();                                                                                   // #8
  STAMP(9);
  // S^T qv
  stage_digits<true>(sm, sm.vf, digit_exponent(sm, 1), sm.zsp);
  __syncthreads();                                                                                   // #9
  STAMP(10);
  if (warp() < 2) factors_t_times(sm, sm.zsp);
  codes_t_times(sm, d, d4);
  __syncthreads();                                                                                   // #10
  STAMP(11);
  if (has_next) prefetch_codes<POOL>(p, sm.st, next);
  window_t_times(sm, r);
  store_product<true>(sm, digit_exponent(sm, 1), d, d4, r);
  __syncthreads();                                                                                   // #11
  STAMP(12);
  store_tokens<POOL>(p, sm, rec);
  __syncthreads();                                                                                   // #12
}

// ---- 3. rebuild ------------------------------------------------------------------------------------------------

// E = S - q_new^T u_new into the accumulators: the codes term elementwise, then A B (j < 32, the new tokens'
// factors included) on bf16 tensor cores.
__device__ __forceinline__ void rebuild_residual(Smem& sm, const Place& at, const uint4 (&cw)[4],
                                                 float (&acc)[2][8][4]) {
  {
    float csr[16];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 c4 = reinterpret_cast<const float4*>(sm.cs + at.colbase)[i];
      csr[4 * i] = c4.x; csr[4 * i + 1] = c4.y; csr[4 * i + 2] = c4.z; csr[4 * i + 3] = c4.w;
    }
#pragma unroll
    for (int ri = 0; ri < 4; ++ri) {
      const float svr = sm.sv[at.row(ri)];
      const uint32_t x[4] = {cw[ri].x ^ 0x80808080u, cw[ri].y ^ 0x80808080u, cw[ri].z ^ 0x80808080u,
                             cw[ri].w ^ 0x80808080u};
#pragma unroll
      for (int b = 0; b < 16; ++b) {                  // byte b of the row chunk = column colbase + b
        const float c = s8_to_f32(x[b >> 2], b & 3);
        acc[ri >> 1][b >> 1][2 * (ri & 1) + (b & 1)] = (c * csr[b]) * svr;
      }
    }
  }
  // mt outer: only one m-tile's A fragments (8 registers) are live next to the 64 accumulators; the B fragments are
  // read once per m-tile (registers, not shared-memory bandwidth, are the limit here)
  const uint32_t bbase = smem_u32(&sm.bsm[0][0][0]);
  const int ltid = fresh_tid();                       // recomputed here: kept over the loop, it spills
  const int m = (ltid >> 3) & 3, r8 = ltid & 7;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    // A fragments (rows v, columns j) from the transposed staging: matrix m of an x4 covers
    // (v + 8 (m & 1), j + 8 (m >> 1)), the second x4 j + 16
    uint32_t afr[8];
    const int vc = (32 * at.wr + 16 * mt) / 8 + (m & 1);
    ldsm_x4_trans(smem_u32(&s_a_chunk(sm, r8 + 8 * (m >> 1), vc)), reinterpret_cast<uint32_t(&)[4]>(afr[0]));
    ldsm_x4_trans(smem_u32(&s_a_chunk(sm, 16 + r8 + 8 * (m >> 1), vc)), reinterpret_cast<uint32_t(&)[4]>(afr[4]));
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int k = 64 * at.wc + 16 * (r8 >> 1) + 2 * nt + (r8 & 1);
      const uint32_t off = static_cast<uint32_t>(k * 64 + (bsm_chunk(k, m) << 4));
#pragma unroll
      for (int sp = 2; sp >= 0; --sp) {              // lo, mid, hi
        uint32_t b[4];
        ldsm_x4(bbase + sp * K * 64 + off, b);
        mma_bf16_k16(acc[mt][nt], afr, b[0], b[1]);
        mma_bf16_k16(acc[mt][nt], afr + 4, b[2], b[3]);
      }
    }
  }
}

// ---- 4. scales, codes ------------------------------------------------------------------------------------------

// This warp's column sums of |E| over its 32 rows, into red[wr][k].
__device__ __forceinline__ void abs_column_sums(Smem& sm, const Place& at, const float (&acc)[2][8][4]) {
  const int g = at.g;
  float cp[16];
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e)
      cp[2 * nt + e] = (fabsf(acc[0][nt][e]) + fabsf(acc[0][nt][2 + e])) +
                       (fabsf(acc[1][nt][e]) + fabsf(acc[1][nt][2 + e]));
  rs_level<16>(cp, (g >> 2) & 1, 16);
  rs_level<8>(cp, (g >> 1) & 1, 8);
  rs_level<4>(cp, g & 1, 4);                           // lane keeps nt = g, e = 0, 1
  *reinterpret_cast<float2*>(sm.red + at.wr * 128 + at.colbase + 2 * g) = make_float2(cp[0], cp[1]);
}

// s_k = sqrt(mean_v |E|) (threads k < 128), stored, and 1 / s_k into isk.
template <bool POOL>
__device__ __forceinline__ void store_s_k(const FlushParams& p, Smem& sm, Records rec, int tid) {
  if (tid < K) {
    const float s = (sm.red[tid] + sm.red[128 + tid]) + (sm.red[256 + tid] + sm.red[384 + tid]);
    const float sk = fmaxf(approx_sqrt(s / 128.0f), 1e-12f);
    reinterpret_cast<float*>(reinterpret_cast<char*>(p.s_k_new) + ck_offset<POOL>(rec.ck, 4 * K))[tid] = sk;
    sm.isk[tid] = approx_rcp(sk);
  }
}

// E / s_k in place (the codes need the same products), and this warp's row maxima of |E / s_k| into red[512 + wc
// 128 + v].
__device__ __forceinline__ void scale_rows(Smem& sm, const Place& at, float (&acc)[2][8][4]) {
  float isk[16];
  {
    // the lane's column base read afresh: kept from the rebuild, it spills
    const int tx = fresh_tid();
    const float4* isk4 = reinterpret_cast<const float4*>(sm.isk + 64 * ((tx >> 5) & 1) + 16 * (tx & 3));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 c4 = isk4[i];
      isk[4 * i] = c4.x; isk[4 * i + 1] = c4.y; isk[4 * i + 2] = c4.z; isk[4 * i + 3] = c4.w;
    }
  }
  float rm[4];
#pragma unroll
  for (int ri = 0; ri < 4; ++ri) {
    float m = 0.0f;
#pragma unroll
    for (int b = 0; b < 16; ++b) {
      float& e = acc[ri >> 1][b >> 1][2 * (ri & 1) + (b & 1)];
      e *= isk[b];
      m = fmaxf(m, fabsf(e));
    }
    m = fmaxf(m, __shfl_xor_sync(FULL, m, 1));
    m = fmaxf(m, __shfl_xor_sync(FULL, m, 2));
    rm[ri] = m;
  }
  if (at.t == 0) {
#pragma unroll
    for (int ri = 0; ri < 4; ++ri) sm.red[512 + at.wc * 128 + at.row(ri)] = rm[ri];
  }
}

// s_v = the row max of |E / s_k| over both column-warps, stored; codes = round-half-even(E / s_k * 127 / s_v), 16
// bytes a row.
template <bool POOL>
__device__ __forceinline__ void store_codes(const FlushParams& p, const Smem& sm, Records rec, const Place& at,
                                            const float (&acc)[2][8][4]) {
  int8_t* codes_new = p.codes_new + ck_offset<POOL>(rec.ck, V * K);
  float* s_v_new = reinterpret_cast<float*>(reinterpret_cast<char*>(p.s_v_new) + ck_offset<POOL>(rec.ck, 4 * V));
#pragma unroll
  for (int ri = 0; ri < 4; ++ri) {
    const int v = at.row(ri);
    const float sv = fmaxf(fmaxf(sm.red[512 + v], sm.red[640 + v]), 1e-12f);
    if (at.wc == 0 && at.t == 0) s_v_new[v] = sv;
    const float step = 127.0f / sv;
    uint32_t y[16];
#pragma unroll
    for (int b = 0; b < 16; ++b) {
      const float x = acc[ri >> 1][b >> 1][2 * (ri & 1) + (b & 1)];
      y[b] = __float_as_uint(__fmaf_rn(x, step, MAGIC));   // round half to even; low byte = the code
    }
    uint4 o;
    o.x = pack_low_bytes(y[0], y[1], y[2], y[3]);
    o.y = pack_low_bytes(y[4], y[5], y[6], y[7]);
    o.z = pack_low_bytes(y[8], y[9], y[10], y[11]);
    o.w = pack_low_bytes(y[12], y[13], y[14], y[15]);
    *reinterpret_cast<uint4*>(codes_new + v * K + at.colbase) = o;
  }
}

// s_k, s_v and codes from the residual in registers (overwritten by E / s_k). Barriers #13-#15.
template <bool POOL>
__device__ __forceinline__ void quantize_residual(const FlushParams& p, Smem& sm, Records rec, const Place& at,
                                                  float (&acc)[2][8][4]) {
  abs_column_sums(sm, at, acc);
  __syncthreads();                                                                                   // #13
  STAMP(14);
  store_s_k<POOL>(p, sm, rec, at.tid);
  __syncthreads();                                                                                   // #14
  STAMP(15);
  scale_rows(sm, at, acc);
  __syncthreads();                                                                                   // #15
  STAMP(16);
  store_codes<POOL>(p, sm, rec, at, acc);
}

// One program: wait for its staged inputs, flush it, and (after barrier #1, when the staging area but the codes is
// free) start the copies of the next program's inputs but the codes; the deployment form also resets the program's
// window there.
template <bool POOL>
__device__ __forceinline__ void flush_program(const FlushParams& p, Smem& sm, Records rec, Records next,
                                              bool has_next) {
  STAMP(0);
  cp_async_wait_all();
  __syncthreads();                                                                                   // #0
  STAMP(1);
  uint4 cw[4];
  stage_factors(sm, cw);
  __syncthreads();                                                                                   // #1
  STAMP(2);
  if (has_next) prefetch_factors<POOL>(p, sm.st, next);
  if (POOL) {
    // reset the window (its staged copy is complete): w = 0, pcum = 0, gbuf = 1
    const int tid = fresh_tid();
    const size_t win = static_cast<size_t>(rec.win);
    const uint4 ones = make_uint4(0x3C003C00u, 0x3C003C00u, 0x3C003C00u, 0x3C003C00u);   // fp16 1.0 pairs
    static_cast<uint4*>(p.gbuf)[win * (L * K / 8) + tid] = ones;
    if (tid < 32) reinterpret_cast<uint4*>(p.pcum + win * K)[tid] = make_uint4(0, 0, 0, 0);
    else if (tid < 36) reinterpret_cast<uint4*>(p.w + win * L)[tid - 32] = make_uint4(0, 0, 0, 0);
  }
  subspace_iteration<POOL>(p, sm, rec, next, has_next);
  // the thread's place read afresh: kept from stage_factors over the products, it spills
  const Place at = this_place();
  STAMP(13);                                         // (after #12: here the stamp build stays spill-free)
  float acc[2][8][4];
  rebuild_residual(sm, at, cw, acc);
  quantize_residual<POOL>(p, sm, rec, at, acc);
}

// q0 into shared memory (once per CTA, or per round with work in the deployment form): vector-major, its row
// maxima, and its three bf16 splits (the B operands of A^T q0).
__device__ __forceinline__ void load_q0(const FlushParams& p, Smem& sm, int tid) {
  if (tid < V) {
    const float4 x = __ldg(reinterpret_cast<const float4*>(p.q0) + tid);
    sm.q0f[0][tid] = x.x; sm.q0f[1][tid] = x.y; sm.q0f[2][tid] = x.z; sm.q0f[3][tid] = x.w;
    sm.q0m[tid] = fmaxf(fmaxf(fabsf(x.x), fabsf(x.y)), fmaxf(fabsf(x.z), fabsf(x.w)));
  }
  const int n = tid >> 6, v = 2 * (tid & 63);
  uint32_t h, m, l;
  split3_pair(__ldg(p.q0 + v * R + n), __ldg(p.q0 + (v + 1) * R + n), h, m, l);
  sm.qsp[n][v >> 1] = h;
  sm.qsp[R + n][v >> 1] = m;
  sm.qsp[2 * R + n][v >> 1] = l;
}

// Persistent CTAs, 2 per SM: each flushes its share of the programs one after the other; the next program's inputs
// are copied into the staging area while the current one computes, so only the first waits for HBM.
// Dense form: programs blockIdx.x, + gridDim.x, ... Deployment form: the same candidates, 256 at a time, are checked
// by all threads at once (slot in range, window full) and the due ones flushed in order; a call with none due costs
// each CTA one round of two dependent loads.
template <bool POOL>
__global__ void __launch_bounds__(NTHREADS, 2) leapquant_flush_kernel(const FlushParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int tid = threadIdx.x;
  const int stride = gridDim.x;
  if (tid < static_cast<int>(sizeof(sm.dig) / 16)) reinterpret_cast<uint4*>(sm.dig)[tid] = make_uint4(0, 0, 0, 0);
  if constexpr (!POOL) {
    load_q0(p, sm, tid);
    const Records first{static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.x)};
    prefetch_factors<POOL>(p, sm.st, first);
    prefetch_codes<POOL>(p, sm.st, first);
    for (int prog = blockIdx.x; prog < p.n_programs; prog += stride) {
      const int next = prog + stride;
      flush_program<POOL>(p, sm, Records{prog, prog}, Records{next, next}, next < p.n_programs);
    }
  } else {
  for (int first = blockIdx.x; first < p.n_programs; first += NTHREADS * stride) {
    // candidate tid of this round: program (n, head) = first + tid * stride
    const int prog = first + tid * stride;
    bool due = false;
    Records rec{0, 0};
    if (prog < p.n_programs) {
      const int n = prog / 32, head = prog % 32;
      const int slot = __ldg(p.idx + n);
      if (slot > 0 && slot < p.num_slots) {
        due = __ldg(p.count + slot * 32 + head) == L;
        rec = Records{POOL_REGIONS_PER_SLOT * slot + head, 32 * slot + head};
      }
    }
    // order-preserving compaction of the due candidates into sm.due
    const unsigned ballot = __ballot_sync(FULL, due);
    if ((tid & 31) == 0) sm.due_in_warp[tid >> 5] = __popc(ballot);
    __syncthreads();
    int before = __popc(ballot & ((1u << (tid & 31)) - 1u)), n_due = 0;
#pragma unroll
    for (int w8 = 0; w8 < NTHREADS / 32; ++w8) {
      before += w8 < (tid >> 5) ? sm.due_in_warp[w8] : 0;
      n_due += sm.due_in_warp[w8];
    }
    if (due) sm.due[before] = make_int2(rec.ck, rec.win);
    if (tid == 0) sm.n_due = n_due;
    __syncthreads();
    if (n_due == 0) continue;
    load_q0(p, sm, tid);                               // only when there is work: none due stays two loads a thread
    auto due_records = [&](int i) { const int2 r = sm.due[i]; return Records{r.x, r.y}; };
    prefetch_factors<POOL>(p, sm.st, due_records(0));
    prefetch_codes<POOL>(p, sm.st, due_records(0));
    // the count is re-read from shared memory each time rather than held (and spilled) over the flush
    for (int i = 0; i < sm.n_due; ++i) {
      const bool more = i + 1 < sm.n_due;
      flush_program<POOL>(p, sm, due_records(i), due_records(more ? i + 1 : i), more);
    }
    __syncthreads();                                   // sm.due is rewritten by the next round
  }
  }
}

}  // namespace

cudaError_t leapquant_flush_launch(const FlushParams& p, cudaStream_t stream) {
  if (p.n_programs <= 0) return cudaSuccess;
  const bool pool = p.idx != nullptr;
  auto kernel = pool ? leapquant_flush_kernel<true> : leapquant_flush_kernel<false>;
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, sizeof(Smem));
  if (err != cudaSuccess) return err;
  const int ctas = p.n_programs < 2 * sms ? p.n_programs : 2 * sms;   // 2 resident per SM
  kernel<<<ctas, NTHREADS, sizeof(Smem), stream>>>(p);
  return cudaGetLastError();
}
