// Prefill: the multi-token path. Y[M, rows] = X[M, in] · Wᵀ for a chunk of M prompt tokens, reading each
// weight once per chunk (decoding the prompt token by token would read it M times). The attention of a
// chunk reuses attention_split with grid.y = M (query t sees positions ≤ *pos + t), and RoPE + KV append
// reuse qk_norm_rope with grid.y = M, so only the projections need kernels of their own:
//   matmul_mma_m{16,32,64}  the matrix cores (port.h he_mma), chunks of up to 64 tokens — the default;
//   matmul_small_m          plain FMAs, up to 8 tokens per launch — GPUs without matrix cores, and the
//                           comparison path (HIPENGINE_PREFILL_MMA=0).
#ifndef HE_OPS_PREFILL_HIP
#define HE_OPS_PREFILL_HIP
#include "port.h"
#include "ops/matvec.hip"
#include "sync.h"

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

// ---- the matrix-core form ------------------------------------------------------------------------------
// A block owns kPfBN = 64 "virtual" weight rows — rows n0 .. n0+63 of W (modes 0, 1), or 32 rows of Wg
// followed by the same 32 rows of Wu (mode 2, so SiLU·mul finds both halves in the block) — and all
// 16·kMT token rows of the chunk; warp w computes virtual rows 16w .. 16w+15 for every 16-token tile. Each
// k-step stages 64 columns of the block's weight rows and of X into shared memory, and the global loads of
// the next step are in flight while the matrix cores work on this one.
// X stays fp32 where it matters: it is staged as two 16-bit halves, hi = round(x) and lo = round(x − hi),
// and every tile takes both products (W·hi + W·lo), so the activations keep ~16 (bf16) / ~22 (fp16) bits of
// mantissa instead of 8 / 11 — prefill stays as close to the fp32 reference as the FMA path (the weights are
// exact either way) for twice the matrix work, which the chunk sizes here leave idle anyway. (fp16 weights:
// |x| must stay below 65504, as in any fp16 model.)
// Split K (grid.y = S > 1, for weights with too few 64-row tiles to fill the GPU): split s sums columns
// [s·kchunk, (s+1)·kchunk) into its slice of `part`, and the last of a tile's S blocks to arrive (sync.h
// he_arrive_last; count: one zeroed word per tile, left zero) adds the S slices in split order — the result
// does not depend on which block finishes last — and applies the epilogue:
//   mode 0: Y = X Wᵀ (+ bias)   1: Y += X Wᵀ   2: Y = silu(X Wgᵀ) * (X Wuᵀ)   (Y [M, rows], row stride rows).
constexpr int kPfWarps = 4;
constexpr int kPfThreads = kPfWarps * kWarpSize;
constexpr int kPfBN = 16 * kPfWarps;  // virtual weight rows per block
constexpr int kPfBK = 64;             // columns per k-step
constexpr int kPfLd = kPfBK + 8;      // shared row stride in elements: 16-byte rows, conflict-free fragments
constexpr int kPfCld = kPfBN + 4;     // the epilogue's fp32 tile stride

template <bool kF16>
HE_INLINE he_u16 he_pf_round(float x) { return kF16 ? he_f32_to_f16(x) : he_f32_to_bf16(x); }
template <bool kF16>
HE_INLINE float he_pf_widen(he_u16 h) { return kF16 ? he_f16_to_f32(h) : he_bf16_to_f32(h); }

// Shared memory of one block: the staged tiles during the k-loop, the fp32 result tile after it.
template <int kMT>
struct HePfSmem {
  static constexpr int kStage = (kPfBN + 2 * 16 * kMT) * kPfLd * 2;
  static constexpr int kTile = 16 * kMT * kPfCld * 4;
  static constexpr int kBytes = kStage > kTile ? kStage : kTile;
};

template <bool kF16, int kMT>
HE_INLINE void he_matmul_mma_body(const he_u16* __restrict__ W, const he_u16* __restrict__ W2, const float* X,
                                  const float* bias, float* Y, int M, int rows, int in, int mode, int kchunk,
                                  float* part, he_u32* count, char* smem) {
  constexpr int kBM = 16 * kMT;
  constexpr int kWVec = kPfBN * kPfBK / 8;  // 16-byte weight loads per k-step
  constexpr int kXVec = kBM * kPfBK / 4;    // 16-byte X loads per k-step
  static_assert(kWVec % kPfThreads == 0 && kXVec % kPfThreads == 0, "k-step loads per thread");
  constexpr int kWPer = kWVec / kPfThreads, kXPer = kXVec / kPfThreads;
  he_u16* Ws = (he_u16*)smem;
  he_u16* Xh = Ws + kPfBN * kPfLd;
  he_u16* Xl = Xh + kBM * kPfLd;
  const int tid = he_thread_idx(), nt = he_block_idx(), split = he_block_idx_y(), S = he_grid_dim_y();
  const int kbeg = split * kchunk, kend = (kbeg + kchunk < in) ? kbeg + kchunk : in;
  const int half = kPfBN / 2;

  // This thread's k-step loads: row pointers (nullptr: a row past the weight / the chunk) and columns.
  const he_u16* wp[kWPer];
  int wc[kWPer], ws[kWPer];
#pragma unroll
  for (int i = 0; i < kWPer; ++i) {
    const int idx = tid + i * kPfThreads, vr = idx / (kPfBK / 8);
    wc[i] = (idx % (kPfBK / 8)) * 8;
    ws[i] = vr * kPfLd + wc[i];
    const int n = (mode == 2) ? nt * half + (vr % half) : nt * kPfBN + vr;
    const he_u16* base = (mode == 2 && vr >= half) ? W2 : W;
    wp[i] = (n < rows) ? base + (he_i64)n * in + wc[i] : nullptr;
  }
  const float* xp[kXPer];
  int xc[kXPer], xs[kXPer];
#pragma unroll
  for (int i = 0; i < kXPer; ++i) {
    const int idx = tid + i * kPfThreads, m = idx / (kPfBK / 4);
    xc[i] = (idx % (kPfBK / 4)) * 4;
    xs[i] = m * kPfLd + xc[i];
    xp[i] = (m < M) ? X + (he_i64)m * in + xc[i] : nullptr;
  }
  he_vec16 wr[kWPer], xr[kXPer];
  const he_vec16 zero = {0u, 0u, 0u, 0u};
  // in % 8 == 0 and kchunk % 64 == 0, so a 16-byte vector is wholly inside [kbeg, kend) or wholly outside.
  auto load_w = [&](int k0) {
#pragma unroll
    for (int i = 0; i < kWPer; ++i) wr[i] = (wp[i] && k0 + wc[i] < kend) ? he_load16_stream(wp[i] + k0) : zero;
  };
  auto load_x = [&](int k0) {
#pragma unroll
    for (int i = 0; i < kXPer; ++i) xr[i] = (xp[i] && k0 + xc[i] < kend) ? he_load16(xp[i] + k0) : zero;
  };

  HeMmaAcc acc[kMT];
#pragma unroll
  for (int t = 0; t < kMT; ++t) he_mma_zero(acc[t]);
  load_w(kbeg);  // weights never depend on the previous kernel
  he_pdl_wait();  // port.h: X, Y, part and count are step data
  load_x(kbeg);
  const he_u16* wt = Ws + he_warp_id() * 16 * kPfLd;
  for (int k0 = kbeg; k0 < kend; k0 += kPfBK) {
#pragma unroll
    for (int i = 0; i < kWPer; ++i) *(he_vec16*)(Ws + ws[i]) = wr[i];
#pragma unroll
    for (int i = 0; i < kXPer; ++i) {
      const float f[4] = {he_u32_as_f32(xr[i].x), he_u32_as_f32(xr[i].y), he_u32_as_f32(xr[i].z),
                          he_u32_as_f32(xr[i].w)};
      he_u16 hi[4], lo[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        hi[j] = he_pf_round<kF16>(f[j]);
        lo[j] = he_pf_round<kF16>(f[j] - he_pf_widen<kF16>(hi[j]));
      }
      he_u32* h = (he_u32*)(Xh + xs[i]);
      he_u32* l = (he_u32*)(Xl + xs[i]);
      h[0] = (he_u32)hi[0] | ((he_u32)hi[1] << 16);
      h[1] = (he_u32)hi[2] | ((he_u32)hi[3] << 16);
      l[0] = (he_u32)lo[0] | ((he_u32)lo[1] << 16);
      l[1] = (he_u32)lo[2] | ((he_u32)lo[3] << 16);
    }
    he_sync_block();
    if (k0 + kPfBK < kend) {  // the next k-step's loads fly while this one is multiplied
      load_w(k0 + kPfBK);
      load_x(k0 + kPfBK);
    }
#pragma unroll
    for (int kk = 0; kk < kPfBK; kk += 16) {
      const HeMmaFrag b = he_mma_load_b(wt + kk, kPfLd);
#pragma unroll
      for (int t = 0; t < kMT; ++t) {
        he_mma<kF16>(acc[t], he_mma_load_a(Xh + t * 16 * kPfLd + kk, kPfLd), b);
        he_mma<kF16>(acc[t], he_mma_load_a(Xl + t * 16 * kPfLd + kk, kPfLd), b);
      }
    }
    he_sync_block();
  }

  // The block's [kBM, kPfBN] result tile, fp32, in shared memory (the staging area is free now).
  float* C = (float*)smem;
#pragma unroll
  for (int t = 0; t < kMT; ++t)
#pragma unroll
    for (int i = 0; i < kMmaAcc; ++i)
      C[(t * 16 + he_mma_acc_m(i)) * kPfCld + he_warp_id() * 16 + he_mma_acc_n(i)] = acc[t].v[i];
  he_sync_block();
  if (S > 1) {
    constexpr int kTile = kBM * kPfBN;
    float* mine = part + ((he_i64)split * he_grid_dim() + nt) * kTile;
    for (int e = tid; e < kTile; e += kPfThreads) mine[e] = C[(e / kPfBN) * kPfCld + e % kPfBN];
    he_fence_acq_rel_device();  // release: this thread's slice stores, before the arrival (AMD: per thread)
    if (!he_arrive_last(count + nt, (he_u32)S)) return;
    he_fence_acq_rel_device();  // acquire: every split's slice
    for (int e = tid; e < kTile; e += kPfThreads) {
      float v = 0.f;
      for (int s = 0; s < S; ++s) v += part[((he_i64)s * he_grid_dim() + nt) * kTile + e];
      C[(e / kPfBN) * kPfCld + e % kPfBN] = v;
    }
    he_sync_block();
  }
  if (mode == 2) {
    for (int e = tid; e < M * half; e += kPfThreads) {
      const int m = e / half, j = e % half, n = nt * half + j;
      if (n < rows) Y[(he_i64)m * rows + n] = he_silu(C[m * kPfCld + j]) * C[m * kPfCld + half + j];
    }
    return;
  }
  for (int e = tid; e < M * kPfBN; e += kPfThreads) {
    const int m = e / kPfBN, j = e % kPfBN, n = nt * kPfBN + j;
    if (n >= rows) continue;
    const float v = C[m * kPfCld + j];
    float* y = Y + (he_i64)m * rows + n;
    if (mode == 1) *y += v;
    else *y = v + (bias ? bias[n] : 0.f);
  }
}

// Launch: grid (tiles, S), kPfThreads threads; tiles = ceil(rows / 64) (mode 2: ceil(rows / 32)); M ≤ 16·kMT;
// in % 8 == 0; kchunk a multiple of 64 with S·kchunk ≥ in; part: S·tiles·16·kMT·64 floats when S > 1.
#define HE_MATMUL_MMA_KERNEL(NAME, MT)                                                                           \
  HE_KERNEL(kPfThreads) NAME(const he_u16* __restrict__ W, const he_u16* __restrict__ W2,       \
                                          const float* X, const float* bias, float* Y, int M, int rows,      \
                                          int in, int mode, int w_f16, int kchunk, float* part,              \
                                          he_u32* count) {                                                   \
    __shared__ he_vec16 smem_v[(HePfSmem<MT>::kBytes + 15) / 16]; /* 16-byte aligned */              \
    char* smem = (char*)smem_v;                                                                              \
    he_pdl_trigger();                                                                                        \
    if (w_f16) he_matmul_mma_body<true, MT>(W, W2, X, bias, Y, M, rows, in, mode, kchunk, part, count, smem); \
    else he_matmul_mma_body<false, MT>(W, W2, X, bias, Y, M, rows, in, mode, kchunk, part, count, smem); \
  }
HE_MATMUL_MMA_KERNEL(matmul_mma_m16, 1)  // M <= 16
HE_MATMUL_MMA_KERNEL(matmul_mma_m32, 2)  // M <= 32
HE_MATMUL_MMA_KERNEL(matmul_mma_m64, 4)  // M <= 64
#undef HE_MATMUL_MMA_KERNEL
#endif
