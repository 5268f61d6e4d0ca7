// SPDX-License-Identifier: Apache-2.0
// LeapQuant window flush for Kimi Delta Attention (leapquant_kda_flush_r4_int8_h32_v128_k128), CUDA C++ for the
// H200 (sm_90a). Pure CUDA: no torch headers (the CI test compiles this file alone with nvcc).
//
// One CTA of 256 threads (8 warps) per program (= one (sequence, head)); 2 CTAs per SM (<= 128 registers).
// The whole 128 x 128 fp32 state S lives in registers, in the accumulator layout of mma.sync m16n8: warp w owns rows
// v in [32 (w>>1), +32) and columns k in [64 (w&1), +64); lane (g = lane>>2, t = lane&3) holds rows
// v = 32 wr + 16 mt + 8 h + g (mt, h in {0,1}) and the 16 contiguous columns k = 64 wc + 16 t + [0, 16).
// (The columns of each n-tile are permuted: n-tile nt, accumulator column c -> k = 64 wc + 16 (c>>1) + 2 nt + (c&1),
// so that a lane's columns are contiguous and the int8 codes come and go as 16-byte vectors.)
//
// flush_program runs the three stages below in turn, each a function: stage_factors and rebuild_state (1.),
// subspace_iteration (2.), quantize_residual (3.).
//  1. Rebuild  S = diag(s_v) codes diag(cs) + A B,  cs = s_k/127 * exp(pcum):
//     the codes term elementwise in fp32 (int8 -> fp32 by the 2^23 magic), then A B on bf16 tensor cores
//     (m16n8k16 + m16n8k8, fp32 accumulation) with a 24-wide factor index j:
//       j <  16: A[v][j] = ubuf_j[v] (bf16, exact)       B[j][k] = w_j kbuf_j[k] D_j[k]
//       j 16-19: A = bf16 hi of q_{j-16} (fp16 = hi + lo exactly)   B = u_{j-16}[k] exp(pcum[k])
//       j 20-23: A = bf16 lo of q_{j-20}                            B = u_{j-20}[k] exp(pcum[k])
//     B is fp32 and goes in as a three-way bf16 split (hi + mid + lo = 24 bits, which the hot-row heads need).
//  2. Subspace iteration from the registers: S^T q0 in fp32 on CUDA cores (column partials reduced across the 8
//     lanes of a column by a shuffle reduce-scatter, then across the 4 row-warps in shared memory); CGS2 in warp 0
//     (as accurate as the reference's MGS2; norm clamp 1e-30; a column the second pass finds dependent becomes
//     zero); S qk on tf32 tensor cores (3xTF32, the accumulator tiles are A fragments as they stand); CGS2; S^T qv on
//     tf32 tensor cores (3xTF32, the tiles' 8 x 8 blocks transposed by movmatrix on their 16-bit halves). u_new,
//     q_new rounded to fp16.
//  3. Residual E = S - q_new^T u_new by one fp16 m16n8k8 mma per tile (exact fp16 products onto the fp32 state),
//     s_k = sqrt(mean_v |E|), s_v = max_k |E| / s_k (clamped 1e-12), codes = round-half-even(E / (s_k s_v) * 127)
//     by the 1.5 * 2^23 magic add in one FFMA (|value| <= 127 by construction, see NOTES.md), packed 16 bytes per
//     store.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "flush.cuh"

// Profiling hook: tools/timeline.cu defines STAMP(n) to record clock64() at a program's entry (n = 0) and
// after its numbered barriers (n = barrier + 1), for the per-stage cycle counts in NOTES.md. Nothing otherwise.
#ifndef STAMP
#define STAMP(n)
#endif

namespace {

constexpr int V = 128, K = 128, L = 16, R = 4;
constexpr int NTHREADS = 256;
constexpr float DEPENDENT_NORM2 = 0x1p-24f;     // CGS2: (2^-12)^2, the squared share of a column a dependent one keeps
constexpr unsigned FULL = 0xffffffffu;
// Row stride (floats) of the vector-major partials [warp][j][row] that warp 0 sums before an orthonormalisation:
// 4 mod 32 banks apart, so that its lanes' float4 reads of 4 consecutive rows are conflict-free and the producers'
// scalar stores conflict at most 2-way
constexpr int PART = K + 4;
// S^T qv's per-warp partials [warp][k][j] with 8 floats of padding after every 16 k: the 16 storing lanes of a
// warp (k = 16 (g >> 1) + 2 n + (g & 1) + const, j = 2 t, 2 t + 1) hit 32 distinct banks
constexpr int UPART = 4 * K + 8 * (K / 16);
__device__ __forceinline__ int upart_at(int k) { return 4 * k + 8 * (k >> 4); }
// -u_new^T pairs with 4 words of padding after every 16 k, so that the residual's B-fragment reads (k = 16 (g >> 1)
// + 2 nt + (g & 1) + const) are conflict-free
constexpr int UN16 = 2 * K + 4 * (K / 16);
__device__ __forceinline__ int un16_at(int k, int pair) { return 2 * k + pair + 4 * (k >> 4); }
static_assert(4 * R * PART <= 4 * UPART, "red holds the orthonormalisations' partials");

// One program's inputs, brought in by cp.async while the CTA computes the previous program.
struct __align__(16) Stage {
  uint4 codes[V][K / 16];  // row v, 16-byte chunk c stored at c ^ 4 (v & 1): a quarter-warp's 8 row reads are
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
  uint4 bsm[3][K][4];      // B as bf16, per split: [k][chunk of 8 j], chunk swizzled by (k >> 4) & 3 (24 KB)
  uint4 asm_[24][V / 8];   // A^T as bf16: rows j < 16 ubuf_j, 16-19 hi(q_r), 20-23 lo(q_r); [j][chunk of 8 v],
                           // chunk swizzled by j & 7 so that ldmatrix's 8 rows hit 8 bank groups (6 KB)
  float red[4 * UPART];    // reduction scratch (9 KB), reused by every stage
  float cs[K];             // s_k / 127 * exp(pcum)
  float isk[K];            // 1 / s_k_new
  float4 q0p[4][V];        // q0 rows, components permuted: q0p[m][v] holds q0[v][p ^ m] at p (the lanes of
                           // S^T q0 with (g >> 1) & 3 = m read theirs, so that the reduce-scatter's vector levels
                           // need no selects)
  float zs[8][K + 4];      // qk as tf32 B operands of S qk: row n < 4 the tf32 part of qk_n, n >= 4 the rest
  int2 due[NTHREADS];      // deployment form: this round's due programs (Records)
  int due_in_warp[NTHREADS / 32];
  int n_due;
  alignas(16) float qvf[R][V + 8];   // qv in fp32, vector-major (rows 8 banks apart): warp 0 hands it on in 4
                                     // conflict-free float4 stores; S^T qv's lanes split their own values into a
                                     // tf32 part and the rest, and every thread rounds two into q_new, off warp 0's
                                     // path
  uint32_t qn16[V][2];     // q_new^T as fp16 pairs (r 0,1 | r 2,3)
  uint32_t un16[UN16];     // -u_new^T as fp16 pairs (r 0,1 | r 2,3) at un16_at(k, pair)
};

// chunk c (v in [8c, 8c + 8)) of row j of the staged A^T
__device__ __forceinline__ uint4& s_a_chunk(Smem& sm, int j, int c) { return sm.asm_[j][c ^ (j & 7)]; }

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

// Issue the copies of a program's inputs into the staging area (7 or 8 16-byte copies per thread).
template <bool POOL>
__device__ __forceinline__ void prefetch_program(const FlushParams& p, Stage& st, Records rec) {
  const int tid = fresh_tid();
  const size_t win = static_cast<size_t>(rec.win);
  const uint4* codes = at_bytes<uint4>(p.codes, ck_offset<POOL>(rec.ck, V * K));
#pragma unroll
  for (int n = 0; n < 4; ++n) {
    const int i = tid + NTHREADS * n, v = i >> 3, c = i & 7;
    cp_async16(&st.codes[v][c ^ ((v & 1) << 2)], codes + i);
  }
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

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
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

__device__ __forceinline__ void mma_f16_k8(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(b0));
}

__device__ __forceinline__ void mma_tf32_k8(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                            uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// The 8 x 8 block of fp32 values that thread (g, t) holds as row g, columns 2 t and 2 t + 1 (an m16n8 accumulator's
// half), transposed: thread (g, t) gets column g, rows 2 t and 2 t + 1. movmatrix moves 16-bit halves, so the low
// and the high halves go separately.
__device__ __forceinline__ void movmatrix_trans32(float x0, float x1, float& y0, float& y1) {
  const uint32_t a = __float_as_uint(x0), b = __float_as_uint(x1);
  const uint32_t lo = movmatrix_trans(__byte_perm(a, b, 0x5410u));
  const uint32_t hi = movmatrix_trans(__byte_perm(a, b, 0x7632u));
  y0 = __uint_as_float(__byte_perm(lo, hi, 0x5410u));
  y1 = __uint_as_float(__byte_perm(lo, hi, 0x7632u));
}

// fp32 = tf32 part (the low 13 bits cleared, exact) + the rest (exact; the tensor core keeps its top 11 bits)
__device__ __forceinline__ uint32_t tf32_part(float x) { return __float_as_uint(x) & 0xffffe000u; }
__device__ __forceinline__ uint32_t tf32_rest(float x) {
  return __float_as_uint(x - __uint_as_float(tf32_part(x)));
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

// (a, b) = hi + lo, each a bf16 pair (a two-way split: 16 significant bits)
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

// two halves as one 32-bit word, a in the low half
__device__ __forceinline__ uint32_t half_pair(__half a, __half b) {
  return static_cast<uint32_t>(__half_as_ushort(a)) | (static_cast<uint32_t>(__half_as_ushort(b)) << 16);
}

__device__ __forceinline__ float h2f(uint16_t bits) { return __half2float(__ushort_as_half(bits)); }

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

// Warp 0's input to an orthonormalisation: rows 4 lane + i of the [128, 4] matrix, summed in order over the N
// per-warp partials that red holds vector-major, [N][j][PART].
template <int N>
__device__ __forceinline__ void sum_partials(const float* red, int lane, float (&a)[4][4]) {
#pragma unroll
  for (int j = 0; j < R; ++j) {
    float4 s = *reinterpret_cast<const float4*>(red + j * PART + 4 * lane);
#pragma unroll
    for (int r = 1; r < N; ++r) {
      const float4 o = *reinterpret_cast<const float4*>(red + (r * R + j) * PART + 4 * lane);
      s.x += o.x; s.y += o.y; s.z += o.z; s.w += o.w;
    }
    a[0][j] = s.x; a[1][j] = s.y; a[2][j] = s.z; a[3][j] = s.w;
  }
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
  at.tid = threadIdx.x;
  at.lane = at.tid & 31;
  at.warp = at.tid >> 5;
  at.g = at.lane >> 2;
  at.t = at.lane & 3;
  at.wr = at.warp >> 1;
  at.wc = at.warp & 1;
  at.colbase = 64 * at.wc + 16 * at.t;
  return at;
}

// ---- 1. rebuild ------------------------------------------------------------------------------------------------

// From the staging area, before it is released to the next program's copies: this lane's codes rows (16 B a row) and
// s_v into registers; A^T (ubuf, hi / lo of q), B (three bf16 splits) and cs into shared memory.
__device__ __forceinline__ void stage_factors(Smem& sm, const Place& at, uint4 (&cw)[4], float (&svr)[4]) {
  const int tid = at.tid;
  const Stage& st = sm.st;
#pragma unroll
  for (int ri = 0; ri < 4; ++ri) {
    const int v = at.row(ri);
    cw[ri] = st.codes[v][(at.colbase >> 4) ^ ((v & 1) << 2)];
    svr[ri] = st.s_v[v];
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
    const int sw = (k >> 4) & 3;
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
    const int chunk = half ^ sw;                       // logical chunk = half (j >> 3)
    sm.bsm[0][k][chunk] = make_uint4(hw[0], hw[1], hw[2], hw[3]);
    sm.bsm[1][k][chunk] = make_uint4(mw[0], mw[1], mw[2], mw[3]);
    sm.bsm[2][k][chunk] = make_uint4(lw[0], lw[1], lw[2], lw[3]);
    if (half == 1) {
      // j 16..23: u_r exp(pcum) twice (against the hi and the lo of q)
      uint32_t uh[2], um[2], ul[2];                  // pairs (r 0, 1) and (r 2, 3)
#pragma unroll
      for (int r = 0; r < R; r += 2)
        split3_pair(h2f(u[r * K + k]) * dec, h2f(u[(r + 1) * K + k]) * dec, uh[r / 2], um[r / 2], ul[r / 2]);
      const int c2 = 2 ^ sw;
      sm.bsm[0][k][c2] = make_uint4(uh[0], uh[1], uh[0], uh[1]);
      sm.bsm[1][k][c2] = make_uint4(um[0], um[1], um[0], um[1]);
      sm.bsm[2][k][c2] = make_uint4(ul[0], ul[1], ul[0], ul[1]);
    } else {
      sm.cs[k] = (st.s_k[k] * (1.0f / 127.0f)) * dec;
    }
  }
}

// S into the accumulators: the codes term elementwise, then A B onto it on bf16 tensor cores.
__device__ __forceinline__ void rebuild_state(Smem& sm, const Place& at, const uint4 (&cw)[4], const float (&svr)[4],
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
      const uint32_t x[4] = {cw[ri].x ^ 0x80808080u, cw[ri].y ^ 0x80808080u, cw[ri].z ^ 0x80808080u,
                             cw[ri].w ^ 0x80808080u};
#pragma unroll
      for (int b = 0; b < 16; ++b) {                  // byte b of the row chunk = column colbase + b
        const float c = s8_to_f32(x[b >> 2], b & 3);
        acc[ri >> 1][b >> 1][2 * (ri & 1) + (b & 1)] = (c * csr[b]) * svr[ri];
      }
    }
  }
  // mt outer: only one m-tile's A fragments (6 registers) are live next to the 64 accumulators; the B fragments are
  // read once per m-tile (registers, not shared-memory bandwidth, are the limit here)
  const uint32_t bbase = smem_u32(&sm.bsm[0][0][0]);
  const int ltid = fresh_tid();                       // recomputed here: kept over the loop, it spills
  const int m = (ltid >> 3) & 3, r8 = ltid & 7;
  const int ksw = (r8 >> 1) & 3;                      // (k >> 4) & 3 of this lane's ldmatrix row
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    // A fragments (rows v, columns j) from the transposed staging: matrix m of the x4 covers
    // (v + 8 (m & 1), j + 8 (m >> 1))
    uint32_t afr[6];
    const int vc = (32 * at.wr + 16 * mt) / 8 + (m & 1);
    ldsm_x4_trans(smem_u32(&s_a_chunk(sm, r8 + 8 * (m >> 1), vc)), reinterpret_cast<uint32_t(&)[4]>(afr[0]));
    ldsm_x2_trans(smem_u32(&s_a_chunk(sm, L + r8, vc)), afr[4], afr[5]);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int k = 64 * at.wc + 16 * (r8 >> 1) + 2 * nt + (r8 & 1);
      const uint32_t off = static_cast<uint32_t>(k * 64 + ((m ^ ksw) << 4));
      uint32_t bh[4], bm[4], bl[4];
      ldsm_x4(bbase + off, bh);
      ldsm_x4(bbase + 1 * K * 64 + off, bm);
      ldsm_x4(bbase + 2 * K * 64 + off, bl);
      mma_bf16_k16(acc[mt][nt], afr, bl[0], bl[1]);
      mma_bf16_k8(acc[mt][nt], afr[4], afr[5], bl[2]);
      mma_bf16_k16(acc[mt][nt], afr, bm[0], bm[1]);
      mma_bf16_k8(acc[mt][nt], afr[4], afr[5], bm[2]);
      mma_bf16_k16(acc[mt][nt], afr, bh[0], bh[1]);
      mma_bf16_k8(acc[mt][nt], afr[4], afr[5], bh[2]);
    }
  }
}

// ---- 2. subspace iteration -------------------------------------------------------------------------------------

// S^T q0 in fp32 on CUDA cores (its precision decides qk, and through it the tokens): column partials over this
// lane's 4 rows, reduce-scattered over the 8 lanes g of a column (lane keeps vector (g >> 1) & 3 of column
// colbase + 2 nt + (g & 1)), into red[wr][j][k]. The lane's vectors come in the order j ^ ((g >> 1) & 3): at the first
// two levels (vector halves) the half it keeps is then its first half and the partner's matching values sit in the
// partner's second half, so only the last level (the column pair) needs selects.
__device__ __forceinline__ void st_q0_partials(Smem& sm, const Place& at, const float (&acc)[2][8][4]) {
  const int g = at.g;
  float xr[4][4];                                    // xr[ri][p]: q0 vector p ^ ((g >> 1) & 3) at row at.row(ri)
#pragma unroll
  for (int ri = 0; ri < 4; ++ri) {
    const float4 x4 = sm.q0p[(g >> 1) & 3][at.row(ri)];
    xr[ri][0] = x4.x; xr[ri][1] = x4.y; xr[ri][2] = x4.z; xr[ri][3] = x4.w;
  }
  const bool odd = g & 1;
  // red + (wr R + ((g >> 1) & 3)) PART + colbase + (g & 1), from a fresh %tid.x (derived from tid, it spills in the
  // deployment form)
  const int fx = fresh_tid();
  float* redp = sm.red + ((fx >> 6) * R + ((fx >> 3) & 3)) * PART + 64 * ((fx >> 5) & 1) + 16 * (fx & 3) +
                ((fx >> 2) & 1);
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    float pv[8];
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float s = acc[0][nt][e] * xr[0][j];
        s = fmaf(acc[0][nt][2 + e], xr[1][j], s);
        s = fmaf(acc[1][nt][e], xr[2][j], s);
        s = fmaf(acc[1][nt][2 + e], xr[3][j], s);
        pv[4 * e + j] = s;
      }
#pragma unroll
    for (int e = 0; e < 2; ++e) {                    // lane ^ 16: its (g >> 1) & 3 is ours ^ 2, its p + 2 our p
      pv[4 * e] += __shfl_xor_sync(FULL, pv[4 * e + 2], 16);
      pv[4 * e + 1] += __shfl_xor_sync(FULL, pv[4 * e + 3], 16);
    }
#pragma unroll
    for (int e = 0; e < 2; ++e)                      // lane ^ 8: ours ^ 1, its p = 1 is our p = 0
      pv[4 * e] += __shfl_xor_sync(FULL, pv[4 * e + 1], 8);
    pv[1] = pv[4];                                   // lane ^ 4: the other column of the pair
    rs_level<2>(pv, odd, 4);
    redp[2 * nt] = pv[0];                            // red[wr][(g >> 1) & 3][colbase + 2 nt + (g & 1)]
  }
}

// Warp 0: qk = CGS2 of the 4 row-warps' column partials of S^T q0, into zs as tf32 parts (rows 0-3) and the rest
// (rows 4-7), the B operands of S qk.
__device__ __forceinline__ void orthonormalise_qk(Smem& sm, int lane) {
  float a[4][4];
  sum_partials<4>(sm.red, lane, a);
  cgs2(a);
#pragma unroll
  for (int n = 0; n < R; ++n) {
    uint4 part, rest;
    part.x = tf32_part(a[0][n]); part.y = tf32_part(a[1][n]);
    part.z = tf32_part(a[2][n]); part.w = tf32_part(a[3][n]);
    rest.x = tf32_rest(a[0][n]); rest.y = tf32_rest(a[1][n]);
    rest.z = tf32_rest(a[2][n]); rest.w = tf32_rest(a[3][n]);
    *reinterpret_cast<uint4*>(&sm.zs[n][4 * lane]) = part;
    *reinterpret_cast<uint4*>(&sm.zs[R + n][4 * lane]) = rest;
  }
}

// S qk on tf32 tensor cores (3xTF32: S and qk each as a tf32 part + the rest; the N = 8 of [part | rest] gives the
// fourth product free). An m16n8 accumulator tile is an m16n8k8 tf32 A fragment as it stands once its columns
// 2 t, 2 t + 1 are read as the A columns t, t + 4; B's rows follow the same order. The 2 column-warps are summed by
// the consumer through red[wc][j][v].
__device__ __forceinline__ void s_qk_partials(Smem& sm, const Place& at, const float (&acc)[2][8][4]) {
  const int g = at.g, t = at.t;
  float d[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const float2 z = *reinterpret_cast<const float2*>(&sm.zs[g][at.colbase + 2 * nt]);   // k = colbase + 2 nt (+1)
    const uint32_t b0 = __float_as_uint(z.x), b1 = __float_as_uint(z.y);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const float* c = acc[mt][nt];
      mma_tf32_k8(d[mt], tf32_rest(c[0]), tf32_rest(c[2]), tf32_rest(c[1]), tf32_rest(c[3]), b0, b1);
      mma_tf32_k8(d[mt], tf32_part(c[0]), tf32_part(c[2]), tf32_part(c[1]), tf32_part(c[3]), b0, b1);
    }
  }
  // columns n = 2 t, 2 t + 1: the qk part of qk_n for t < 2, the rest of qk_{n-4} for t >= 2
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) d[mt][i] += __shfl_xor_sync(FULL, d[mt][i], 2);
  if (t < 2) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int v = 32 * at.wr + 16 * mt + 8 * h + g;
        float* part = sm.red + (at.wc * R + 2 * t) * PART + v;
        part[0] = d[mt][2 * h];
        part[PART] = d[mt][2 * h + 1];
      }
  }
}

// Warp 0: qv = CGS2 of the 2 column-warps' row partials of S qk, into qvf in fp32.
__device__ __forceinline__ void orthonormalise_qv(Smem& sm, int lane) {
  float a[4][4];
  sum_partials<2>(sm.red, lane, a);
  cgs2(a);
#pragma unroll
  for (int n = 0; n < R; ++n)
    *reinterpret_cast<float4*>(&sm.qvf[n][4 * lane]) = make_float4(a[0][n], a[1][n], a[2][n], a[3][n]);
}

// u = S^T qv on tf32 tensor cores (3xTF32, as S qk: S and qv each as a tf32 part + the rest, the N = 8 of
// [part | rest] giving the fourth product free); its precision reaches the tokens through u_new's fp16 rounding. An
// 8 x 8 block of accumulator values transposed by movmatrix_trans32 is a quarter of an m16n8k8 A fragment of S^T
// (rows k, columns v); the warp's 32 rows v are 4 k-steps of 8, the 4 row-warps summed by the consumer through
// red[wr][k][j].
__device__ __forceinline__ void st_qv_partials(Smem& sm, const Place& at, const float (&acc)[2][8][4]) {
  const int g = at.g, t = at.t;
  // B[kk][n]: kk = t <-> v = 32 wr + 16 mt + 8 h + 2 t, kk = t + 4 <-> v + 1 (the order the transposed blocks
  // come in); column n < 4 the tf32 part of qv_n, n >= 4 the rest of qv_{n-4}
  uint32_t bx[2][2][2];
  const int tx = fresh_tid();                        // the row address afresh: kept from the rebuild, it spills
  const float* xr0 = &sm.qvf[(tx >> 2) & 3][32 * (tx >> 6) + 2 * (tx & 3)];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float2 x = *reinterpret_cast<const float2*>(xr0 + 16 * mt + 8 * h);
      bx[mt][h][0] = g < 4 ? tf32_part(x.x) : tf32_rest(x.x);
      bx[mt][h][1] = g < 4 ? tf32_part(x.y) : tf32_rest(x.y);
    }
#pragma unroll
  for (int np = 0; np < 4; ++np) {                   // A rows 0-7: the columns of n-tile 2 np, rows 8-15: 2 np + 1
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float y[2][2];                               // [n-tile 2 np + i][row 2 t + e of the 8 rows (mt, h)]
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const float* c = &acc[mt][2 * np + i][2 * h];
          movmatrix_trans32(c[0], c[1], y[i][0], y[i][1]);
        }
        mma_tf32_k8(d, tf32_rest(y[0][0]), tf32_rest(y[1][0]), tf32_rest(y[0][1]), tf32_rest(y[1][1]),
                    bx[mt][h][0], bx[mt][h][1]);
        mma_tf32_k8(d, tf32_part(y[0][0]), tf32_part(y[1][0]), tf32_part(y[0][1]), tf32_part(y[1][1]),
                    bx[mt][h][0], bx[mt][h][1]);
      }
    // columns n = 2 t, 2 t + 1: the qv part's share of u_n for t < 2, the rest's share of u_{n-4} for t >= 2
#pragma unroll
    for (int i = 0; i < 4; ++i) d[i] += __shfl_xor_sync(FULL, d[i], 2);
    if (t < 2) {
      // A row g + 8 h = column k = k0 + 2 (2 np + h) of n-tile 2 np + h, inside k0's block of 16
      float* part = sm.red + at.wr * UPART + upart_at(64 * at.wc + 16 * (g >> 1) + (g & 1)) + 2 * t;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<float2*>(part + 8 * (2 * np + h)) = make_float2(d[2 * h], d[2 * h + 1]);
    }
  }
}

// u_new = fp16(the 4 row-warps' partials of S^T qv) and q_new = fp16(qv), each thread two values of each: to global
// memory, and as fp16 pairs (-u_new^T, q_new^T) for the residual's mma.
template <bool POOL>
__device__ __forceinline__ void store_tokens(const FlushParams& p, Smem& sm, Records rec) {
  const int tx7 = fresh_tid();                       // (from tid, it spills in the deployment form)
  const int k = tx7 >> 1, jp = (tx7 & 1) * 2;
  float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const float2 o = *reinterpret_cast<const float2*>(sm.red + r * UPART + upart_at(k) + jp);
    s0 += o.x; s1 += o.y;
  }
  const __half h0 = __float2half_rn(s0), h1 = __float2half_rn(s1);
  __half* u_new = reinterpret_cast<__half*>(static_cast<char*>(p.u_new) + ck_offset<POOL>(rec.ck, 2 * R * K));
  u_new[jp * token_row<POOL>() + k] = h0;
  u_new[(jp + 1) * token_row<POOL>() + k] = h1;
  sm.un16[un16_at(k, tx7 & 1)] = half_pair(__hneg(h0), __hneg(h1));
  // q_new = fp16(qv): thread (v, pair) rounds qv_{jp}[v], qv_{jp + 1}[v]
  const int v = k;
  const __half q0h = __float2half_rn(sm.qvf[jp][v]), q1h = __float2half_rn(sm.qvf[jp + 1][v]);
  __half* q_new = reinterpret_cast<__half*>(static_cast<char*>(p.q_new) + ck_offset<POOL>(rec.ck, 2 * R * V));
  q_new[jp * token_row<POOL>() + v] = q0h;
  q_new[(jp + 1) * token_row<POOL>() + v] = q1h;
  sm.qn16[v][tx7 & 1] = half_pair(q0h, q1h);
}

// S^T q0, CGS2, S qk, CGS2, S^T qv from the state in registers; u_new, q_new stored. Barriers #2-#7.
template <bool POOL>
__device__ __forceinline__ void subspace_iteration(const FlushParams& p, Smem& sm, Records rec, const Place& at,
                                                   const float (&acc)[2][8][4]) {
  st_q0_partials(sm, at, acc);
  __syncthreads();                                                                                   // #2
  STAMP(3);
  if (at.warp == 0) orthonormalise_qk(sm, at.lane);
  __syncthreads();                                                                                   // #3
  STAMP(4);
  s_qk_partials(sm, at, acc);
  __syncthreads();                                                                                   // #4
  STAMP(5);
  if (at.warp == 0) orthonormalise_qv(sm, at.lane);
  __syncthreads();                                                                                   // #5
  STAMP(6);
  st_qv_partials(sm, at, acc);
  __syncthreads();                                                                                   // #6
  STAMP(7);
  store_tokens<POOL>(p, sm, rec);
  __syncthreads();                                                                                   // #7
  STAMP(8);
}

// ---- 3. residual, scales, codes --------------------------------------------------------------------------------

// E = S - q_new^T u_new in place: one fp16 m16n8k8 mma a tile (exact fp16 products onto the fp32 state).
__device__ __forceinline__ void subtract_tokens(const Smem& sm, const Place& at, float (&acc)[2][8][4]) {
  const int t = at.t;
  uint32_t qa[2][2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    const int v0 = 32 * at.wr + 16 * mt + at.g;
    qa[mt][0] = t < 2 ? sm.qn16[v0][t & 1] : 0u;
    qa[mt][1] = t < 2 ? sm.qn16[v0 + 8][t & 1] : 0u;
  }
  // k = 64 wc + 16 (g >> 1) + (g & 1) + 2 nt (at + 4 nt), from a fresh %tid.x (kept from the rebuild, it spills)
  const int tx = fresh_tid();
  const uint32_t* un = sm.un16 + un16_at(64 * ((tx >> 5) & 1) + 16 * ((tx >> 3) & 3) + ((tx >> 2) & 1), tx & 1);
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const uint32_t b = t < 2 ? un[4 * nt] : 0u;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) mma_f16_k8(acc[mt][nt], qa[mt][0], qa[mt][1], b);
  }
}

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
      y[b] = __float_as_uint(__fmaf_rn(x, step, 12582912.0f));   // round half to even; low byte = the code
    }
    uint4 o;
    o.x = pack_low_bytes(y[0], y[1], y[2], y[3]);
    o.y = pack_low_bytes(y[4], y[5], y[6], y[7]);
    o.z = pack_low_bytes(y[8], y[9], y[10], y[11]);
    o.w = pack_low_bytes(y[12], y[13], y[14], y[15]);
    *reinterpret_cast<uint4*>(codes_new + v * K + at.colbase) = o;
  }
}

// Residual, s_k, s_v and codes from the state in registers (overwritten by E / s_k). Barriers #8-#10.
template <bool POOL>
__device__ __forceinline__ void quantize_residual(const FlushParams& p, Smem& sm, Records rec, const Place& at,
                                                  float (&acc)[2][8][4]) {
  subtract_tokens(sm, at, acc);
  abs_column_sums(sm, at, acc);
  __syncthreads();                                                                                   // #8
  STAMP(9);
  store_s_k<POOL>(p, sm, rec, at.tid);
  __syncthreads();                                                                                   // #9
  STAMP(10);
  scale_rows(sm, at, acc);
  __syncthreads();                                                                                   // #10
  STAMP(11);
  store_codes<POOL>(p, sm, rec, at, acc);
}

// One program: wait for its staged inputs, flush it, and (after barrier #1, when the staging area is free) start the
// copies of the next program's inputs; the deployment form also resets the program's window there.
template <bool POOL>
__device__ __forceinline__ void flush_program(const FlushParams& p, Smem& sm, Records rec, Records next,
                                              bool has_next) {
  const Place at = this_place();
  STAMP(0);
  cp_async_wait_all();
  __syncthreads();                                                                                   // #0
  STAMP(1);
  uint4 cw[4];
  float svr[4];
  stage_factors(sm, at, cw, svr);
  __syncthreads();                                                                                   // #1
  STAMP(2);
  if (has_next) prefetch_program<POOL>(p, sm.st, next);
  if (POOL) {
    // reset the window (its staged copy is complete): w = 0, pcum = 0, gbuf = 1
    const size_t win = static_cast<size_t>(rec.win);
    const uint4 ones = make_uint4(0x3C003C00u, 0x3C003C00u, 0x3C003C00u, 0x3C003C00u);   // fp16 1.0 pairs
    static_cast<uint4*>(p.gbuf)[win * (L * K / 8) + at.tid] = ones;
    if (at.tid < 32) reinterpret_cast<uint4*>(p.pcum + win * K)[at.tid] = make_uint4(0, 0, 0, 0);
    else if (at.tid < 36) reinterpret_cast<uint4*>(p.w + win * L)[at.tid - 32] = make_uint4(0, 0, 0, 0);
  }
  float acc[2][8][4];
  rebuild_state(sm, at, cw, svr, acc);
  subspace_iteration<POOL>(p, sm, rec, at, acc);
  quantize_residual<POOL>(p, sm, rec, at, acc);
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
  auto load_q0 = [&] {
    if (tid < V) {
      const float4 x = __ldg(reinterpret_cast<const float4*>(p.q0) + tid);
      sm.q0p[0][tid] = x;
      sm.q0p[1][tid] = make_float4(x.y, x.x, x.w, x.z);
      sm.q0p[2][tid] = make_float4(x.z, x.w, x.x, x.y);
      sm.q0p[3][tid] = make_float4(x.w, x.z, x.y, x.x);
    }
  };
  if constexpr (!POOL) {
    load_q0();
    prefetch_program<POOL>(p, sm.st, Records{static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.x)});
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
    load_q0();                                         // only when there is work: none due stays two loads a thread
    auto due_records = [&](int i) { const int2 r = sm.due[i]; return Records{r.x, r.y}; };
    prefetch_program<POOL>(p, sm.st, due_records(0));
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
