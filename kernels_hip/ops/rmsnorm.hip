// RMSNorm: y = x · rsqrt(mean(x²) + eps) · gamma, fp32 in, fp32 out, gamma fp32 [n].
//
// Two forms share one body:
//   * he_rmsnorm_stage(): a block normalises x into (shared) memory — the fused prologue of a matvec, so
//     the normalised vector never goes through HBM (every block recomputes the n-element reduction; x is
//     8-32 KB and stays in L2, which is cheaper than a separate launch plus a grid-wide dependency).
//   * rmsnorm(): the standalone kernel, one block per row (rows = tokens in prefill).
#ifndef HE_OPS_RMSNORM_HIP
#define HE_OPS_RMSNORM_HIP
#include "port.h"

// Copies x[0:n] into dst (optionally normalised by gamma). All threads of the block must call it; on
// return dst is visible to the whole block. `scratch` is __shared__ float[kMaxWarpsPerBlock].
// gamma == nullptr: plain copy (the matvec's input is already normalised, e.g. attention output).
// n % 4 == 0 (the decode step's case) takes the batched 16-byte path (x, gamma, dst 16-byte aligned);
// other lengths the scalar one.
//
// Latency, not bandwidth, is what this costs inside a decode step (x is 2-32 KB in L2): every 16-byte load
// of a pass is issued before the first is used (batches of kNormBatch per thread), so a pass is one L2
// round trip instead of one per loop iteration (the scalar loop took ~8 dependent round trips to stage the
// 32 KB down-proj input: ~5 µs per layer in the monokernel's profile).
// Batches are 8 loads per thread (32 registers: the monokernel's weight stream is live during the
// prologue, so more would spill), 4 in the scaling pass, which also loads gamma.
constexpr int kNormBatch = 8;
// The fixed-point-only stage's form (kFxOnly below): 1, one pass that keeps a one-batch vector's values; 0, two
// passes at small batches (a build choice while both are measured: HIPENGINE_MK_DEFINES=HE_NORM_FX_ONE_PASS=0).
#ifndef HE_NORM_FX_ONE_PASS
#define HE_NORM_FX_ONE_PASS 1
#endif

HE_INLINE void he_load4f(const float* p, float (&v)[4]) {
  const he_vec16 w = he_load16(p);
  v[0] = he_u32_as_f32(w.x);
  v[1] = he_u32_as_f32(w.y);
  v[2] = he_u32_as_f32(w.z);
  v[3] = he_u32_as_f32(w.w);
}

// v[0..3] += the fixed-point addend fx[0..3] (two 16-byte loads; the fused MLP's residual, ops/mlp.hip).
HE_INLINE void he_add_fx4(const he_i64* fx, float (&v)[4]) {
  const he_vec16 a = he_load16(fx), b = he_load16(fx + 2);
  v[0] = v[0] + he_fx_to_f32(he_i64_of_words(a.x, a.y));
  v[1] = v[1] + he_fx_to_f32(he_i64_of_words(a.z, a.w));
  v[2] = v[2] + he_fx_to_f32(he_i64_of_words(b.x, b.y));
  v[3] = v[3] + he_fx_to_f32(he_i64_of_words(b.z, b.w));
}

// The stage's input values at float4 index i: x (+ fx when given), or kFxOnly: fx alone.
template <bool kFxOnly>
HE_INLINE void he_load_x4(const float* x, const he_i64* fx, int i, float (&v)[4]) {
  if constexpr (kFxOnly) {
    const he_vec16 a = he_load16(fx + 4 * i), b = he_load16(fx + 4 * i + 2);
    v[0] = he_fx_to_f32(he_i64_of_words(a.x, a.y));
    v[1] = he_fx_to_f32(he_i64_of_words(a.z, a.w));
    v[2] = he_fx_to_f32(he_i64_of_words(b.x, b.y));
    v[3] = he_fx_to_f32(he_i64_of_words(b.z, b.w));
  } else {
    he_load4f(x + 4 * i, v);
    if (fx != nullptr) he_add_fx4(fx + 4 * i, v);
  }
}

// dst[4i..4i+3] = x[...] (· scale · gamma[...]) for this thread's float4 indices, kB loads in flight.
// fx != nullptr: x + fx (he_add_fx4) instead of x; kFxOnly: fx alone (x is not read: the fixed-point buffer holds
// the whole value, the grouped O-proj's residual, ops/matvec_group.hip). kPost: each value then times `post`, a
// power of two (the packed weights' exponent offset, ops/matvec_packed.hip: exact, so the stored value is the
// unscaled one's bits shifted in exponent).
template <int kB, bool kGamma, bool kPost = false, bool kFxOnly = false>
HE_INLINE void he_norm_store(const float* x, const float* gamma, float scale, int n4, float* dst,
                             const he_i64* fx = nullptr, float post = 1.f) {
  const int t = he_thread_idx(), nt = he_block_dim();
  for (int i0 = t; i0 < n4; i0 += kB * nt) {
    float v[kB][4], g[kGamma ? kB : 1][4];
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      const int i = i0 + b * nt;
      if (i < n4) {
        he_load_x4<kFxOnly>(x, fx, i, v[b]);
        if (kGamma) he_load4f(gamma + 4 * i, g[kGamma ? b : 0]);
      }
    }
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      const int i = i0 + b * nt;
      if (i < n4) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float y = kGamma ? v[b][j] * scale * g[kGamma ? b : 0][j] : v[b][j];
          dst[4 * i + j] = kPost ? y * post : y;
        }
      }
    }
  }
}

// Rows whose length is not a multiple of 4 (not 16-byte aligned): one element per thread per iteration.
template <bool kFxOnly = false>
HE_INLINE void he_rmsnorm_scalar(const float* x, const float* __restrict__ gamma, float eps, int n, float* dst,
                                 float* scratch, const he_i64* fx = nullptr, float post = 1.f) {
  const int t = he_thread_idx(), nt = he_block_dim();
  auto xv = [&](int i) {
    if constexpr (kFxOnly) return he_fx_to_f32(fx[i]);
    else return fx != nullptr ? x[i] + he_fx_to_f32(fx[i]) : x[i];
  };
  float scale = 1.f;
  if (gamma) {
    float ss = 0.f;
    for (int i = t; i < n; i += nt) ss += xv(i) * xv(i);
    scale = he_rsqrt(he_block_sum(ss, scratch) / (float)n + eps);
  }
  for (int i = t; i < n; i += nt) dst[i] = (gamma ? xv(i) * scale * gamma[i] : xv(i)) * post;
  he_sync_block();
}

// This thread's sum of squares of x (+ fx) over its float4 indices, kB loads in flight, in index order.
template <int kB, bool kFxOnly = false>
HE_INLINE float he_norm_ss(const float* x, const he_i64* fx, int n4) {
  const int t = he_thread_idx(), nt = he_block_dim();
  float ss = 0.f;
  for (int i0 = t; i0 < n4; i0 += kB * nt) {
    float v[kB][4];
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      const int i = i0 + b * nt;
      if (i < n4) {
        he_load_x4<kFxOnly>(x, fx, i, v[b]);
      } else {
        v[b][0] = v[b][1] = v[b][2] = v[b][3] = 0.f;
      }
    }
#pragma unroll
    for (int b = 0; b < kB; ++b)
      ss += v[b][0] * v[b][0] + v[b][1] * v[b][1] + v[b][2] * v[b][2] + v[b][3] * v[b][3];
  }
  return ss;
}

// The stage for a vector that is one batch per thread (n / 4 <= kNormBatch / 4 · blockDim float4: 2 per thread at
// a hidden size of 2,048): the thread keeps its values between the sum and the scaling, so the input is read once
// (the two-pass form reads it twice: one more round trip). Same values, same order, same bits as the passes. (It
// runs beside the weight stream's 64 registers: the two-pass form at the x + fx batches spilled 190 B in the
// monokernel, this 18 B; session 36. With gamma held across the block sum the monokernel spills 106 / 200 B, every
// added site in the prologues, an L1 hit each: session 43.)
// HE_NORM_GAMMA_EARLY: where gamma's loads go out. 2 (the default): with the input's, so the stage is one L2 round
// trip, and plain x (no fixed-point addend) takes this one-pass form too — +1.2 to +1.8% for the monokernel at 1K on
// an H100 (docs/perf-log.md session 43); 1: early for the fixed-point input only (the grouped O-proj's gate/up), plain
// x in two passes; 0: after the sum, as in session 36's form, where gamma's generic loads could not pass the first
// store of the scaled values into shared memory, so the fixed-point stage took three round trips and the two-pass
// one two (SASS).
#ifndef HE_NORM_GAMMA_EARLY
#define HE_NORM_GAMMA_EARLY 2
#endif
template <bool kPost, bool kFxOnly>
HE_INLINE void he_rmsnorm_one_pass(const float* x, const float* __restrict__ gamma, float eps, int n, float* dst,
                                   float* scratch, const he_i64* fx, float post) {
  constexpr int kB = kNormBatch / 4;
  constexpr bool kEarly = HE_NORM_GAMMA_EARLY >= (kFxOnly ? 1 : 2);
  const int t = he_thread_idx(), nt = he_block_dim(), n4 = n / 4;
  float v[kB][4], g[kEarly ? kB : 1][4];
#pragma unroll
  for (int b = 0; b < kB; ++b) {
    const int i = t + b * nt;
    if (i < n4) {
      he_load_x4<kFxOnly>(x, fx, i, v[b]);
      if constexpr (kEarly) he_load4f(gamma + 4 * i, g[kEarly ? b : 0]);
    } else {
      v[b][0] = v[b][1] = v[b][2] = v[b][3] = 0.f;
    }
  }
  float ss = 0.f;
#pragma unroll
  for (int b = 0; b < kB; ++b)
    ss += v[b][0] * v[b][0] + v[b][1] * v[b][1] + v[b][2] * v[b][2] + v[b][3] * v[b][3];
  const float scale = he_rsqrt(he_block_sum(ss, scratch) / (float)n + eps);
#pragma unroll
  for (int b = 0; b < kB; ++b) {
    const int i = t + b * nt;
    if (i < n4) {
      if constexpr (!kEarly) he_load4f(gamma + 4 * i, g[0]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float y = v[b][j] * scale * g[kEarly ? b : 0][j];
        dst[4 * i + j] = kPost ? y * post : y;
      }
    }
  }
  he_sync_block();
}

// kVec4: the caller promises n % 4 == 0 (a matvec build of whole-pair rows), so the scalar path is not compiled.
// fx (optional): the residual stream's pending fixed-point addend (ops/mlp.hip); the stage normalises x + fx.
// kPost: every stored value times `post` (he_norm_store; the scalar path multiplies by it unconditionally:
// post is 1 there unless kPost, and x · 1 is x). kFxOnly: the input is fx alone (he_load_x4; x is not read).
template <bool kVec4 = false, bool kPost = false, bool kFxOnly = false>
HE_INLINE void he_rmsnorm_stage(const float* x, const float* __restrict__ gamma, float eps, int n,
                                float* dst, float* scratch, const he_i64* fx = nullptr, float post = 1.f) {
  if constexpr (!kVec4) {
    if (HE_UNLIKELY(n % 4)) {
      he_rmsnorm_scalar<kFxOnly>(x, gamma, eps, n, dst, scratch, fx, kPost ? post : 1.f);
      return;
    }
  }
  const int n4 = n / 4;
  // With the addend the batches are halved: its two loads per float4 keep the registers of a batch (32) as
  // without it (the monokernel's weight stream is live here). Sums in the same element order either way.
  if (HE_UNLIKELY(!gamma)) {  // (a literal nullptr folds: the O-proj / down-proj take only this path)
    if (fx != nullptr) he_norm_store<kNormBatch / 2, false, kPost, kFxOnly>(x, nullptr, 1.f, n4, dst, fx, post);
    else he_norm_store<kNormBatch, false, kPost>(x, nullptr, 1.f, n4, dst, nullptr, post);
    he_sync_block();
    return;
  }
  // A vector of at most kNormBatch / 4 float4 per thread (a hidden size of 2,048 at 256 threads) in one pass: the
  // fixed-point input (kFxOnly, HE_NORM_FX_ONE_PASS) or plain x (HE_NORM_GAMMA_EARLY), never x + fx.
  if constexpr ((kFxOnly && HE_NORM_FX_ONE_PASS) || (!kFxOnly && HE_NORM_GAMMA_EARLY >= 2)) {
    const bool one = (kFxOnly || fx == nullptr) && n4 <= kNormBatch / 4 * he_block_dim();
    if (!HE_UNLIKELY(!one)) {  // (the passes below: cold code, after the hot path's)
      he_rmsnorm_one_pass<kPost, kFxOnly>(x, gamma, eps, n, dst, scratch, fx, post);
      return;
    }
  }
  // kFxOnly, longer vectors or HE_NORM_FX_ONE_PASS=0: the passes' batches at a quarter and an eighth of kNormBatch
  // (at the x + fx form's half / quarter ptxas spilled 190 B in the monokernel, 18 B at these; session 36). At a
  // hidden size of 2,048 the scaling pass then takes two round trips.
  constexpr int kFxSs = kFxOnly ? kNormBatch / 4 : kNormBatch / 2, kFxSt = kFxOnly ? kNormBatch / 8 : kNormBatch / 4;
  const float ss = fx != nullptr ? he_norm_ss<kFxSs, kFxOnly>(x, fx, n4) : he_norm_ss<kNormBatch>(x, nullptr, n4);
  // mean in fp32 then rsqrt: rsqrt.approx has ~2 ulp error, far below the bf16 weights' rounding.
  const float scale = he_rsqrt(he_block_sum(ss, scratch) / (float)n + eps);
  if (fx != nullptr) he_norm_store<kFxSt, true, kPost, kFxOnly>(x, gamma, scale, n4, dst, fx, post);
  else he_norm_store<kNormBatch / 2, true, kPost>(x, gamma, scale, n4, dst, nullptr, post);
  he_sync_block();
}

// y[row] = rmsnorm(x[row]) for rows = gridDim.x; y may alias x (each element is read before written by the
// same thread, and the reduction finishes before any write).
HE_KERNEL(1024) rmsnorm(const float* x, const float* __restrict__ gamma, float eps, int n,
                        float* y) {
  he_pdl_trigger();
  he_pdl_wait();  // port.h: everything below reads or writes step data
  __shared__ float scratch[kMaxWarpsPerBlock];
  const he_i64 row = he_block_idx();
  he_rmsnorm_stage(x + row * n, gamma, eps, n, y + row * n, scratch);
}
#endif
