// Decode attention with grouped-query heads, split over the sequence ("flash-decoding"), plus the combine.
//
// Layouts
//   q        fp32 [T][num_heads·hd]          T query tokens (1 in decode; a prefill chunk otherwise)
//   caches   bf16 [num_kv_heads][max_ctx][hd] one layer; query t sees positions [0, *pos + t]
//   partial  fp32 [T][num_heads][nsplit][hd + 2]  unnormalised o, then (m, l) of that split
//   out      fp32 [T][num_heads·hd]
// Query head h reads kv head h / G (G = num_heads / num_kv_heads, HF's repeat_kv order).
//
// attention_split: grid = (num_kv_heads·nsplit, T); block handles `chunk` positions of one kv head for all
// G query heads of its group, so each K/V row is read from HBM once per step however large G is.
//   1. scores s[g][p] = q_g·k_p / sqrt(hd), kept in log2 units (q pre-scaled by log2(e)/sqrt(hd)) so the
//      softmax uses exp2;  each K row is 16-byte loads by hd/8 lanes, reduced with xor shuffles inside
//      that lane group, several rows per warp;
//   2. per head: m = max s, e = 2^(s - m), l = Σ e   (block reductions, deterministic order);
//   3. o[g] = Σ_p e[g][p] · v_p, each lane accumulating 8 dims for every head of the group, then summed
//      across lane groups (shuffles) and warps (shared memory, fixed order).
// Splits that start past the sequence end write l = 0 and are skipped by the combine, so the grid can be
// sized once for max_ctx (graph capture / monokernel) while *pos grows.
// Requirements: hd % 8 == 0, hd ≤ 8·kWarpSize, G ≤ kAttnMaxGroup; dynamic shared memory
// = (2·G·hd + G·chunk) · 4 bytes.
#ifndef HE_OPS_ATTENTION_DECODE_HIP
#define HE_OPS_ATTENTION_DECODE_HIP
#include "port.h"

constexpr int kAttnMaxGroup = 8;
constexpr int kAttnUnroll = 4;  // K/V rows loaded per lane group before use

HE_INLINE float he_dot8_bf16(const he_vec16 k, const float* q) {
  return he_bf16lo_to_f32(k.x) * q[0] + he_bf16hi_to_f32(k.x) * q[1] + he_bf16lo_to_f32(k.y) * q[2] +
         he_bf16hi_to_f32(k.y) * q[3] + he_bf16lo_to_f32(k.z) * q[4] + he_bf16hi_to_f32(k.z) * q[5] +
         he_bf16lo_to_f32(k.w) * q[6] + he_bf16hi_to_f32(k.w) * q[7];
}

HE_INLINE void he_attention_split_block(const float* __restrict__ q, const he_bf16* __restrict__ k_cache,
                                        const he_bf16* __restrict__ v_cache, float* __restrict__ partial, int seq,
                                        int kvh, int split, int nsplit, int chunk, int nh, int nkv, int hd,
                                        int max_ctx, float* smem, float* scratch) {
  const int G = nh / nkv;
  float* qs = smem;               // [G][hd]
  float* os = qs + G * hd;        // [G][hd]
  float* sc = os + G * hd;        // [G][chunk]
  const int t = he_thread_idx(), nt = he_block_dim();
  const int start = split * chunk;
  const int n = start < seq ? (seq - start < chunk ? seq - start : chunk) : 0;
  // Lanes per K/V row: hd/8 rounded up to a power of two so xor shuffles stay inside the lane group;
  // lanes past the row's end (hd = 24 → 3 of 4 lanes busy) contribute zeros.
  int lpr = 1;
  while (lpr * 8 < hd) lpr *= 2;
  const int rpw = kWarpSize / lpr;        // rows per warp per sweep
  const int lane = he_lane_id(), sub = lane % lpr, rw = lane / lpr;
  const bool dim_ok = sub * 8 < hd;
  const int rows_per_sweep = he_num_warps() * rpw;
  const float qscale = he_rsqrt((float)hd) * kLog2e;

  if (n == 0) {  // nothing to attend in this split: mark it empty for the combine
    for (int g = t; g < G; g += nt) {
      float* pr = partial + ((he_i64)(kvh * G + g) * nsplit + split) * (hd + 2);
      pr[hd] = he_neg_inf();
      pr[hd + 1] = 0.f;
    }
    return;
  }
  for (int i = t; i < G * hd; i += nt) {
    qs[i] = q[(he_i64)(kvh * G) * hd + i] * qscale;
    os[i] = 0.f;
  }
  he_sync_block();

  // 1. scores. kAttnUnroll rows per lane group are loaded before any is used (latency hiding).
  const he_bf16* kbase = k_cache + ((he_i64)kvh * max_ctx + start) * hd;
  for (int p0 = 0; p0 < n; p0 += kAttnUnroll * rows_per_sweep) {
    he_vec16 kv[kAttnUnroll];
#pragma unroll
    for (int j = 0; j < kAttnUnroll; ++j) {
      const int p = p0 + j * rows_per_sweep + he_warp_id() * rpw + rw;
      kv[j] = (p < n && dim_ok) ? he_load16_stream(kbase + (he_i64)p * hd + sub * 8) : he_vec16{0u, 0u, 0u, 0u};
    }
#pragma unroll
    for (int j = 0; j < kAttnUnroll; ++j) {
      const int p = p0 + j * rows_per_sweep + he_warp_id() * rpw + rw;
      for (int g = 0; g < G; ++g) {
        float s = dim_ok ? he_dot8_bf16(kv[j], qs + g * hd + sub * 8) : 0.f;
        for (int o = lpr / 2; o > 0; o >>= 1) s += he_shfl_xor(s, o);  // stays inside the lane group
        if (p < n && sub == 0) sc[g * chunk + p] = s;
      }
    }
  }
  he_sync_block();

  // 2. softmax numerators per head
  float m_g[kAttnMaxGroup], l_g[kAttnMaxGroup];
  for (int g = 0; g < G; ++g) {
    float m = he_neg_inf();
    for (int p = t; p < n; p += nt) m = he_fmax(m, sc[g * chunk + p]);
    m = he_block_max(m, scratch);
    float l = 0.f;
    for (int p = t; p < n; p += nt) {
      const float e = he_exp2(sc[g * chunk + p] - m);
      sc[g * chunk + p] = e;
      l += e;
    }
    l = he_block_sum(l, scratch);  // its barriers also publish the e values written above
    m_g[g] = m;
    l_g[g] = l;
  }

  // 3. o = Σ e·v
  float acc[kAttnMaxGroup][8];
#pragma unroll
  for (int g = 0; g < kAttnMaxGroup; ++g)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[g][j] = 0.f;
  const he_bf16* vbase = v_cache + ((he_i64)kvh * max_ctx + start) * hd;
  for (int p0 = 0; p0 < n; p0 += kAttnUnroll * rows_per_sweep) {
    he_vec16 vv[kAttnUnroll];
#pragma unroll
    for (int j = 0; j < kAttnUnroll; ++j) {
      const int p = p0 + j * rows_per_sweep + he_warp_id() * rpw + rw;
      vv[j] = (p < n && dim_ok) ? he_load16_stream(vbase + (he_i64)p * hd + sub * 8) : he_vec16{0u, 0u, 0u, 0u};
    }
#pragma unroll
    for (int j = 0; j < kAttnUnroll; ++j) {
      const int p = p0 + j * rows_per_sweep + he_warp_id() * rpw + rw;
      if (p < n && dim_ok) {
        const he_vec16 v = vv[j];
        const float vf[8] = {he_bf16lo_to_f32(v.x), he_bf16hi_to_f32(v.x), he_bf16lo_to_f32(v.y),
                             he_bf16hi_to_f32(v.y), he_bf16lo_to_f32(v.z), he_bf16hi_to_f32(v.z),
                             he_bf16lo_to_f32(v.w), he_bf16hi_to_f32(v.w)};
#pragma unroll
        for (int g = 0; g < kAttnMaxGroup; ++g) {
          if (g < G) {
            const float e = sc[g * chunk + p];
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) acc[g][jj] += e * vf[jj];
          }
        }
      }
    }
  }
  // reduce across the lane groups of a warp (xor offsets ≥ lpr mix rows, keep the dim slot)...
#pragma unroll
  for (int g = 0; g < kAttnMaxGroup; ++g) {
    if (g < G) {
#pragma unroll
      for (int j = 0; j < 8; ++j)
        for (int o = kWarpSize / 2; o >= lpr; o >>= 1) acc[g][j] += he_shfl_xor(acc[g][j], o);
    }
  }
  // ...then across warps in a fixed order (deterministic sums).
  for (int w = 0; w < he_num_warps(); ++w) {
    if (he_warp_id() == w && rw == 0 && dim_ok) {
#pragma unroll
      for (int g = 0; g < kAttnMaxGroup; ++g)
        if (g < G)
#pragma unroll
          for (int j = 0; j < 8; ++j) os[g * hd + sub * 8 + j] += acc[g][j];
    }
    he_sync_block();
  }
  for (int i = t; i < G * hd; i += nt) {
    const int g = i / hd, d = i % hd;
    float* pr = partial + ((he_i64)(kvh * G + g) * nsplit + split) * (hd + 2);
    pr[d] = os[i];
  }
  for (int g = t; g < G; g += nt) {
    float* pr = partial + ((he_i64)(kvh * G + g) * nsplit + split) * (hd + 2);
    pr[hd] = m_g[g];
    pr[hd + 1] = l_g[g];
  }
}

HE_KERNEL(256) attention_split(const float* __restrict__ q, const he_bf16* __restrict__ k_cache,
                               const he_bf16* __restrict__ v_cache, float* __restrict__ partial,
                               const int* __restrict__ pos_p, int nsplit, int chunk, int nh, int nkv, int hd,
                               int max_ctx) {
  extern __shared__ float he_attn_smem[];
  __shared__ float scratch[kMaxWarpsPerBlock];
  const int tq = he_block_idx_y();
  const int seq = *pos_p + tq + 1;
  const int kvh = he_block_idx() / nsplit, split = he_block_idx() % nsplit;
  he_attention_split_block(q + (he_i64)tq * nh * hd, k_cache, v_cache,
                           partial + (he_i64)tq * nh * nsplit * (hd + 2), seq, kvh, split, nsplit, chunk, nh, nkv,
                           hd, max_ctx, he_attn_smem, scratch);
}

// out[h] = Σ_s 2^(m_s − M) o_s / Σ_s 2^(m_s − M) l_s  over non-empty splits.  grid = (num_heads, T).
// The split weights are computed in parallel (one thread per split) into shared memory; a serial loop over
// splits would chain nsplit dependent global loads (~0.5 µs each).
HE_INLINE void he_attention_combine_head(const float* __restrict__ pr, int nsplit, int hd, float* __restrict__ out,
                                         float* wsh, float* scratch) {
  const int t = he_thread_idx(), nt = he_block_dim();
  float m = he_neg_inf();
  for (int s = t; s < nsplit; s += nt)
    if (pr[s * (hd + 2) + hd + 1] > 0.f) m = he_fmax(m, pr[s * (hd + 2) + hd]);
  const float M = he_block_max(m, scratch);
  float l = 0.f;
  for (int s = t; s < nsplit; s += nt) {
    const float ls = pr[s * (hd + 2) + hd + 1];
    const float w = ls > 0.f ? he_exp2(pr[s * (hd + 2) + hd] - M) : 0.f;
    wsh[s] = w;
    l += w * ls;
  }
  const float inv = 1.f / he_block_sum(l, scratch);  // barriers inside also publish wsh
  for (int d = t; d < hd; d += nt) {
    // Loads are unconditional (empty splits hold stale values, masked by the select) so the unrolled loop
    // issues 8 independent L2 loads before the first FMA needs one; a conditional load serialised them.
    float o = 0.f;
#pragma unroll 8
    for (int s = 0; s < nsplit; ++s) {
      const float w = wsh[s];
      const float v = pr[s * (hd + 2) + d];
      o += (w > 0.f) ? v * w : 0.f;
    }
    out[d] = o * inv;
  }
}

HE_KERNEL(256) attention_combine(const float* __restrict__ partial, int nsplit, int nh, int hd,
                                 float* __restrict__ out) {
  extern __shared__ float he_combine_w[];  // [nsplit]
  __shared__ float scratch[kMaxWarpsPerBlock];
  const int h = he_block_idx(), tq = he_block_idx_y();
  he_attention_combine_head(partial + ((he_i64)tq * nh + h) * nsplit * (hd + 2), nsplit, hd,
                            out + ((he_i64)tq * nh + h) * hd, he_combine_w, scratch);
}
#endif
