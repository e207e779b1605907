// Matrix-vector products of the decode step: y = W x, W row-major [rows, in] in bf16 or fp16, x fp32,
// fp32 accumulation, with the fused prologue (RMSNorm of x into shared memory) and the fused epilogues of
// a Llama layer:
//   matvec          y = W·x (+ residual)                  O-proj / down-proj (+ residual add), LM head
//   matvec_gate_up  y = silu(Wg·x) * (Wu·x)                the MLP's first half
//   matvec_qkv      [q|k|v] = Wqkv·x + b, RoPE on q and k,  attention's input; k/v appended to the cache
//                   k/v appended to the KV cache
// (prefill.hip holds the multi-token form, built on he_wdot8.)
//
// Why this shape. At batch 1 the step is bound by HBM: every weight byte is read once and used once. Each
// lane issues 16-byte loads (8 weights), a warp sweeps kWarpSize·8 consecutive weights of a row per load,
// and every lane keeps kMatvecUnroll·kRows loads in flight (16 × 16 B × 32 lanes = 8 KiB per warp on NVIDIA) so the
// memory system sees enough outstanding requests (H200: ~4.8 TB/s × ~1 µs latency ≈ 36 KiB per SM).
// Weights are read with the streaming load (no L1 allocation): they are used exactly once per step.
// The grid is sized by the host to a few blocks per SM and blocks stride over row groups, so the fused
// prologue (x staged in shared memory, ≤ 32 KiB) is paid a few hundred times, not once per row.
//
// Requirements (checked by the host wrapper): in % 8 == 0 and 16-byte aligned rows (every model dimension
// here is a multiple of 64), blockDim a multiple of kWarpSize, dynamic shared memory = in * 4 bytes.
#ifndef HE_OPS_MATVEC_HIP
#define HE_OPS_MATVEC_HIP
#include "port.h"
#include "ops/rmsnorm.hip"

// 16-byte loads in flight per lane per row (per batch). A define so benchmarks can compare depths.
#ifndef HE_MATVEC_UNROLL
#define HE_MATVEC_UNROLL 4
#endif
constexpr int kMatvecUnroll = HE_MATVEC_UNROLL;

// Dot product of 8 packed weights with 8 fp32 activations (x 16-byte aligned).
template <bool kF16>
HE_INLINE float he_wdot8(const he_vec16 w, const float* x) {
  const he_u32 q[4] = {w.x, w.y, w.z, w.w};
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float lo = kF16 ? he_f16lo_to_f32(q[j]) : he_bf16lo_to_f32(q[j]);
    const float hi = kF16 ? he_f16hi_to_f32(q[j]) : he_bf16hi_to_f32(q[j]);
    s += lo * x[2 * j] + hi * x[2 * j + 1];
  }
  return s;
}

// A batch is kMatvecUnroll warp-wide sweeps of kWarpSize·8 weights per row, starting at column c0. Loads past
// the row's end are predicated off (zero vectors), so every `in` that is a multiple of 8 works and short rows
// still issue all their loads at once.
constexpr int kMatvecSweep = kWarpSize * 8;
// Launch bound of the matvec kernels: 512 threads leaves 128 registers per thread (NVIDIA), enough for the
// 2 x kMatvecUnroll 16-byte loads in flight without spilling; a 1024 bound capped them at 64 and spilled
// (measured on H200: the LM head fell from 96% to 56% of HBM bandwidth).
constexpr int kMatvecMaxThreads = 512;
constexpr int kMatvecBatch = kMatvecUnroll * kMatvecSweep;

template <int kRows>
HE_INLINE void he_matvec_load(const he_u16* const (&rows)[kRows], int in, int c0, he_vec16 (&w)[kRows][kMatvecUnroll]) {
  const int lane = he_lane_id();
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int u = 0; u < kMatvecUnroll; ++u) {
      const int c = c0 + u * kMatvecSweep + lane * 8;
      w[r][u] = (c < in) ? he_load16_stream(rows[r] + c) : he_vec16{0u, 0u, 0u, 0u};
    }
}

// One warp computes kRows dot products rows[r]·x over `in` elements; every lane returns all kRows sums.
// `w` holds the first batch, already loaded (see he_matvec_load): the bodies issue it *before* the fused
// prologue so HBM latency overlaps the normalisation of x (weights never depend on the activation).
// Double-buffered: batch b+1 is issued before batch b is consumed, so a long row (down-proj, in = 8192)
// keeps 2·kMatvecUnroll loads per row in flight instead of draining between batches.
template <int kRows, bool kF16>
HE_INLINE void he_matvec_warp(const he_u16* const (&rows)[kRows], int in, const float* xs,
                              he_vec16 (&w)[kRows][kMatvecUnroll], float (&acc)[kRows]) {
  const int lane = he_lane_id();
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.f;
  he_vec16 nxt[kRows][kMatvecUnroll];
  for (int c0 = 0;;) {
    const bool more = c0 + kMatvecBatch < in;
    if (more) he_matvec_load<kRows>(rows, in, c0 + kMatvecBatch, nxt);
#pragma unroll
    for (int u = 0; u < kMatvecUnroll; ++u) {
      const int c = c0 + u * kMatvecSweep + lane * 8;
      if (c < in) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) acc[r] += he_wdot8<kF16>(w[r][u], xs + c);
      }
    }
    if (!more) break;
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int u = 0; u < kMatvecUnroll; ++u) w[r][u] = nxt[r][u];
    c0 += kMatvecBatch;
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = he_warp_sum(acc[r]);
}

HE_INLINE float he_silu(float g) { return g / (1.f + he_exp(-g)); }

// ---- y = W·x (+ residual) ------------------------------------------------------------------------------
// Two rows per warp (more loads in flight). residual may alias y: each y[r] is read then written by the
// same lane. gamma != nullptr fuses RMSNorm(x; gamma, eps) as the prologue.
template <bool kF16>
HE_INLINE void he_matvec_body(const he_u16* __restrict__ W, const float* x, const float* __restrict__ gamma,
                              float eps, const float* residual, float* y, int rows, int in, float* xs,
                              float* scratch) {
  const int units = (rows + 1) / 2;
  const int u0 = he_block_idx() * he_num_warps() + he_warp_id(), ustride = he_grid_dim() * he_num_warps();
  he_vec16 w[2][kMatvecUnroll];
  if (u0 < units) {  // first batch in flight before the prologue
    const int r0 = 2 * u0, r1 = (r0 + 1 < rows) ? r0 + 1 : r0;
    const he_u16* const rp[2] = {W + (he_i64)r0 * in, W + (he_i64)r1 * in};
    he_matvec_load<2>(rp, in, 0, w);
  }
  he_rmsnorm_stage(x, gamma, eps, in, xs, scratch);
  for (int u = u0; u < units; u += ustride) {
    const int r0 = 2 * u, r1 = (r0 + 1 < rows) ? r0 + 1 : r0;  // odd tail: recompute r0, write once
    const he_u16* const rp[2] = {W + (he_i64)r0 * in, W + (he_i64)r1 * in};
    if (u != u0) he_matvec_load<2>(rp, in, 0, w);
    float acc[2];
    he_matvec_warp<2, kF16>(rp, in, xs, w, acc);
    if (he_lane_id() == 0) {
      y[r0] = acc[0] + (residual ? residual[r0] : 0.f);
      if (r1 != r0) y[r1] = acc[1] + (residual ? residual[r1] : 0.f);
    }
  }
}

HE_KERNEL(kMatvecMaxThreads) matvec(const he_u16* __restrict__ W, const float* x, const float* __restrict__ gamma, float eps,
                       const float* residual, float* y, int rows, int in, int w_f16) {
  extern __shared__ float he_xs[];  // [in]
  __shared__ float scratch[kMaxWarpsPerBlock];
  if (w_f16) he_matvec_body<true>(W, x, gamma, eps, residual, y, rows, in, he_xs, scratch);
  else he_matvec_body<false>(W, x, gamma, eps, residual, y, rows, in, he_xs, scratch);
}

// ---- y = silu(Wg·x) * (Wu·x) ------------------------------------------------------------------------------
template <bool kF16>
HE_INLINE void he_matvec_gate_up_body(const he_u16* __restrict__ Wg, const he_u16* __restrict__ Wu, const float* x,
                                      const float* __restrict__ gamma, float eps, float* y, int rows, int in,
                                      float* xs, float* scratch) {
  const int r_first = he_block_idx() * he_num_warps() + he_warp_id(), rstride = he_grid_dim() * he_num_warps();
  he_vec16 w[2][kMatvecUnroll];
  if (r_first < rows) {
    const he_u16* const rp[2] = {Wg + (he_i64)r_first * in, Wu + (he_i64)r_first * in};
    he_matvec_load<2>(rp, in, 0, w);
  }
  he_rmsnorm_stage(x, gamma, eps, in, xs, scratch);
  for (int r = r_first; r < rows; r += rstride) {
    const he_u16* const rp[2] = {Wg + (he_i64)r * in, Wu + (he_i64)r * in};
    if (r != r_first) he_matvec_load<2>(rp, in, 0, w);
    float acc[2];
    he_matvec_warp<2, kF16>(rp, in, xs, w, acc);
    if (he_lane_id() == 0) y[r] = he_silu(acc[0]) * acc[1];
  }
}

HE_KERNEL(kMatvecMaxThreads) matvec_gate_up(const he_u16* __restrict__ Wg, const he_u16* __restrict__ Wu, const float* x,
                               const float* __restrict__ gamma, float eps, float* y, int rows, int in, int w_f16) {
  extern __shared__ float he_xs[];
  __shared__ float scratch[kMaxWarpsPerBlock];
  if (w_f16) he_matvec_gate_up_body<true>(Wg, Wu, x, gamma, eps, y, rows, in, he_xs, scratch);
  else he_matvec_gate_up_body<false>(Wg, Wu, x, gamma, eps, y, rows, in, he_xs, scratch);
}

// ---- QKV + bias + RoPE + KV append -------------------------------------------------------------------------
// Wqkv is wq, wk, wv stacked: [q_dim + 2·kv_dim, in]. RoPE is in rotate-half form, pairing element i of a
// head with element i + hd/2, so one warp computes exactly that pair of rows and rotates it in registers:
//   out[i]        = a·cos − b·sin
//   out[i + hd/2] = b·cos + a·sin        (a = row i, b = row i + hd/2; cos/sin at [pos][i])
// cos/sin tables [max_ctx][hd/2] fp32 come from the host (ModelConfig.rope_inv_freq(), float64) so the
// device never recomputes frequencies. The position is read from device memory (*pos) so a captured
// graph / the monokernel advances it without relaunch arguments changing.
// KV cache (per layer): k_cache, v_cache bf16 [num_kv_heads][max_ctx][hd].
// rope == 0 (Qwen3 qk_norm path): no RoPE/append here; raw q|k|v (+bias) go to q_out [q_dim + 2·kv_dim]
// and qk_norm_rope finishes the job after the per-head norm.
template <bool kF16>
HE_INLINE void he_matvec_qkv_body(const he_u16* __restrict__ W, const float* x, const float* __restrict__ gamma,
                                  float eps, const float* __restrict__ bias, const float* __restrict__ cos_t,
                                  const float* __restrict__ sin_t, const int* __restrict__ pos_p,
                                  float* __restrict__ q_out, he_bf16* __restrict__ k_cache,
                                  he_bf16* __restrict__ v_cache, int max_ctx, int q_dim, int kv_dim, int hd,
                                  int in, int rope, float* xs, float* scratch) {
  const int half = hd / 2;
  const int pairs = (q_dim + 2 * kv_dim) / 2;
  const int p_first = he_block_idx() * he_num_warps() + he_warp_id(), pstride = he_grid_dim() * he_num_warps();
  he_vec16 w[2][kMatvecUnroll];
  if (p_first < pairs) {
    const int ra = (p_first / half) * hd + p_first % half;
    const he_u16* const rp[2] = {W + (he_i64)ra * in, W + (he_i64)(ra + half) * in};
    he_matvec_load<2>(rp, in, 0, w);
  }
  he_rmsnorm_stage(x, gamma, eps, in, xs, scratch);
  const int pos = *pos_p;
  for (int p = p_first; p < pairs; p += pstride) {
    const int head = p / half, i = p % half;
    const int ra = head * hd + i, rb = ra + half;  // rows in the stacked matrix
    const he_u16* const rp[2] = {W + (he_i64)ra * in, W + (he_i64)rb * in};
    if (p != p_first) he_matvec_load<2>(rp, in, 0, w);
    float acc[2];
    he_matvec_warp<2, kF16>(rp, in, xs, w, acc);
    if (he_lane_id() != 0) continue;
    float a = acc[0] + (bias ? bias[ra] : 0.f), b = acc[1] + (bias ? bias[rb] : 0.f);
    if (!rope) { q_out[ra] = a; q_out[rb] = b; continue; }
    if (ra < q_dim + kv_dim) {  // q or k: rotate
      const float c = cos_t[(he_i64)pos * half + i], s = sin_t[(he_i64)pos * half + i];
      const float ra_v = a * c - b * s, rb_v = b * c + a * s;
      a = ra_v; b = rb_v;
    }
    if (ra < q_dim) { q_out[ra] = a; q_out[rb] = b; continue; }
    const bool is_k = ra < q_dim + kv_dim;
    const int kvh = (ra - q_dim - (is_k ? 0 : kv_dim)) / hd;
    he_bf16* dst = (is_k ? k_cache : v_cache) + ((he_i64)kvh * max_ctx + pos) * hd;
    dst[i] = he_f32_to_bf16(a);
    dst[i + half] = he_f32_to_bf16(b);
  }
}

HE_KERNEL(kMatvecMaxThreads) matvec_qkv(const he_u16* __restrict__ W, const float* x, const float* __restrict__ gamma, float eps,
                           const float* __restrict__ bias, const float* __restrict__ cos_t,
                           const float* __restrict__ sin_t, const int* __restrict__ pos_p, float* __restrict__ q_out,
                           he_bf16* __restrict__ k_cache, he_bf16* __restrict__ v_cache, int max_ctx, int q_dim,
                           int kv_dim, int hd, int in, int rope, int w_f16) {
  extern __shared__ float he_xs[];
  __shared__ float scratch[kMaxWarpsPerBlock];
  if (w_f16)
    he_matvec_qkv_body<true>(W, x, gamma, eps, bias, cos_t, sin_t, pos_p, q_out, k_cache, v_cache, max_ctx, q_dim,
                             kv_dim, hd, in, rope, he_xs, scratch);
  else
    he_matvec_qkv_body<false>(W, x, gamma, eps, bias, cos_t, sin_t, pos_p, q_out, k_cache, v_cache, max_ctx, q_dim,
                              kv_dim, hd, in, rope, he_xs, scratch);
}

#endif
