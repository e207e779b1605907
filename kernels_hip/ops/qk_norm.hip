// Per-head RMSNorm of q and k (Qwen3), RoPE and the KV-cache append, on a stacked q|k|v vector per token.
//
// Used where the projection could not fuse RoPE: Qwen3 (the norm needs the whole head before rotating)
// and prefill (the small-M matmul writes raw q|k|v for M tokens). With q_norm == k_norm == nullptr it is
// just RoPE + append.
//   qkv     fp32 [T][q_dim + 2·kv_dim]   (q heads, then k heads, then v heads; head-major, hd each)
//   q_out   fp32 [T][q_dim]
//   caches  he_kv (bf16 or fp16, port.h) [num_kv_heads][max_ctx][hd] (one layer); token t lands at position *pos + t.
//   cos/sin fp32 [max_ctx][hd/2] from the host (float64 frequencies, see matvec.hip).
// grid = (num_heads + 2·num_kv_heads, T), block = any multiple of kWarpSize; one block per (head, token).
#ifndef HE_OPS_QK_NORM_HIP
#define HE_OPS_QK_NORM_HIP
#include "port.h"

// qkv is rewritten every layer inside the monokernel: a plain pointer (no non-coherent read-only path).
HE_INLINE void he_qk_norm_rope_head(const float* qkv, const float* __restrict__ q_norm,
                                    const float* __restrict__ k_norm, float eps, const float* __restrict__ cos_t,
                                    const float* __restrict__ sin_t, int pos, float* __restrict__ q_out,
                                    he_kv* __restrict__ k_cache, he_kv* __restrict__ v_cache, int max_ctx,
                                    int nh, int nkv, int hd, int head, float* scratch) {
  const int half = hd / 2;
  const float* src = qkv + (he_i64)head * hd;  // heads are consecutive in the stacked vector
  const bool is_q = head < nh, is_k = !is_q && head < nh + nkv;
  const float* gamma = is_q ? q_norm : (is_k ? k_norm : nullptr);
  float scale = 1.f;
  if (gamma) {
    float ss = 0.f;
    for (int i = he_thread_idx(); i < hd; i += he_block_dim()) ss += src[i] * src[i];
    scale = he_rsqrt(he_block_sum(ss, scratch) / (float)hd + eps);
  }
  if (!is_q && !is_k) {  // v: straight into the cache
    he_kv* dst = v_cache + ((he_i64)(head - nh - nkv) * max_ctx + pos) * hd;
    for (int i = he_thread_idx(); i < hd; i += he_block_dim()) dst[i] = he_f32_to_kv(src[i]);
    return;
  }
  for (int i = he_thread_idx(); i < half; i += he_block_dim()) {
    float a = src[i] * scale, b = src[i + half] * scale;
    if (gamma) { a *= gamma[i]; b *= gamma[i + half]; }
    const float c = cos_t[(he_i64)pos * half + i], s = sin_t[(he_i64)pos * half + i];
    const float ra = a * c - b * s, rb = b * c + a * s;
    if (is_q) {
      q_out[head * hd + i] = ra;
      q_out[head * hd + i + half] = rb;
    } else {
      he_kv* dst = k_cache + ((he_i64)(head - nh) * max_ctx + pos) * hd;
      dst[i] = he_f32_to_kv(ra);
      dst[i + half] = he_f32_to_kv(rb);
    }
  }
}

HE_KERNEL(1024) qk_norm_rope(const float* qkv, const float* __restrict__ q_norm,
                             const float* __restrict__ k_norm, float eps, const float* __restrict__ cos_t,
                             const float* __restrict__ sin_t, const int* pos_p, float* __restrict__ q_out,
                             he_kv* __restrict__ k_cache, he_kv* __restrict__ v_cache, int max_ctx, int nh,
                             int nkv, int hd) {
  he_pdl_trigger();
  he_pdl_wait();  // port.h: everything below reads or writes step data
  __shared__ float scratch[kMaxWarpsPerBlock];
  const int t = he_block_idx_y();
  const he_i64 stride = (he_i64)(nh + 2 * nkv) * hd;
  he_qk_norm_rope_head(qkv + t * stride, q_norm, k_norm, eps, cos_t, sin_t, he_ld_step(pos_p) + t,
                       q_out + (he_i64)t * nh * hd, k_cache, v_cache, max_ctx, nh, nkv, hd, he_block_idx(), scratch);
}
#endif
