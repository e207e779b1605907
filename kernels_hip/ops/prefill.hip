// Prefill: the multi-token path. Y[M, rows] = X[M, in] · Wᵀ for chunks of M ≤ kMaxM prompt tokens, reading
// each weight once per chunk (decoding the prompt token by token would read it M times). The attention of
// a chunk reuses attention_split with grid.y = M (query t sees positions ≤ *pos + t), and RoPE + KV
// append reuse qk_norm_rope with grid.y = M, so only the projections need a kernel of their own.
// Tensor cores are not used yet: at M ≤ 8 the matmul is still bound by reading W (8 tokens × 2 FLOP per
// weight byte pair is far below the H200's FLOP/byte balance).
#ifndef HE_OPS_PREFILL_HIP
#define HE_OPS_PREFILL_HIP
#include "port.h"
#include "ops/matvec.hip"

// Each weight row is loaded once and multiplied with all M token vectors, so a chunk of M prompt tokens
// costs one pass over the weights (the decode path would cost M). X is read through L1/L2 (M·in·4 bytes,
// far smaller than W). Rows of X past M are clamped to row M-1 and their results dropped, so one
// instantiation serves every M ≤ kMaxM.
// mode: 0  Y = XWᵀ (+ bias)           1  Y += XWᵀ (residual add, in place)
//       2  Y = silu(X Wgᵀ) * (X Wuᵀ)  (W2 = Wu)
constexpr int kMaxM = 8;

template <bool kF16>
HE_INLINE void he_matmul_small_m_body(const he_u16* __restrict__ W, const he_u16* __restrict__ W2,
                                      const float* __restrict__ X, const float* __restrict__ bias, float* Y,
                                      int M, int rows, int in, int mode) {
  constexpr int kSweep = kWarpSize * 8;
  const int lane = he_lane_id();
  const int nw = (mode == 2) ? 2 : 1;
  for (int r = he_block_idx() * he_num_warps() + he_warp_id(); r < rows; r += he_grid_dim() * he_num_warps()) {
    float acc[2][kMaxM];
#pragma unroll
    for (int m = 0; m < kMaxM; ++m) { acc[0][m] = 0.f; acc[1][m] = 0.f; }
    for (int c = lane * 8; c < in; c += kSweep) {
      he_vec16 w[2];
      w[0] = he_load16_stream(W + (he_i64)r * in + c);
      w[1] = (nw == 2) ? he_load16_stream(W2 + (he_i64)r * in + c) : w[0];
#pragma unroll
      for (int m = 0; m < kMaxM; ++m) {
        const float* xr = X + (he_i64)(m < M ? m : M - 1) * in + c;
        const he_vec16 a = he_load16(xr), b = he_load16(xr + 4);
        const float xv[8] = {he_u32_as_f32(a.x), he_u32_as_f32(a.y), he_u32_as_f32(a.z), he_u32_as_f32(a.w),
                             he_u32_as_f32(b.x), he_u32_as_f32(b.y), he_u32_as_f32(b.z), he_u32_as_f32(b.w)};
        acc[0][m] += he_wdot8<kF16>(w[0], xv);
        if (nw == 2) acc[1][m] += he_wdot8<kF16>(w[1], xv);
      }
    }
#pragma unroll
    for (int m = 0; m < kMaxM; ++m) {
      const float s0 = he_warp_sum(acc[0][m]);
      const float s1 = (nw == 2) ? he_warp_sum(acc[1][m]) : 0.f;
      if (lane == 0 && m < M) {
        float* dst = Y + (he_i64)m * rows + r;
        if (mode == 0) *dst = s0 + (bias ? bias[r] : 0.f);
        else if (mode == 1) *dst += s0;
        else *dst = he_silu(s0) * s1;
      }
    }
  }
}

HE_KERNEL(kMatvecMaxThreads) matmul_small_m(const he_u16* __restrict__ W, const he_u16* __restrict__ W2,
                               const float* X, const float* __restrict__ bias, float* Y, int M, int rows,
                               int in, int mode, int w_f16) {
  he_pdl_trigger();
  he_pdl_wait();  // port.h: everything below reads or writes step data
  if (w_f16) he_matmul_small_m_body<true>(W, W2, X, bias, Y, M, rows, in, mode);
  else he_matmul_small_m_body<false>(W, W2, X, bias, Y, M, rows, in, mode);
}
#endif
