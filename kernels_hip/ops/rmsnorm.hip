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
HE_INLINE void he_rmsnorm_stage(const float* x, const float* __restrict__ gamma, float eps, int n,
                                float* dst, float* scratch) {
  const int t = he_thread_idx(), nt = he_block_dim();
  float scale = 1.f;
  if (gamma) {
    float ss = 0.f;
    for (int i = t; i < n; i += nt) ss += x[i] * x[i];
    // mean in fp32 then rsqrt: rsqrt.approx has ~2 ulp error, far below the bf16 weights' rounding.
    scale = he_rsqrt(he_block_sum(ss, scratch) / (float)n + eps);
  }
  for (int i = t; i < n; i += nt) dst[i] = gamma ? x[i] * scale * gamma[i] : x[i];
  he_sync_block();
}

// y[row] = rmsnorm(x[row]) for rows = gridDim.x; y may alias x (each element is read before written by the
// same thread, and the reduction finishes before any write).
HE_KERNEL(1024) rmsnorm(const float* x, const float* __restrict__ gamma, float eps, int n,
                        float* y) {
  __shared__ float scratch[kMaxWarpsPerBlock];
  const he_i64 row = he_block_idx();
  he_rmsnorm_stage(x + row * n, gamma, eps, n, y + row * n, scratch);
}
#endif
