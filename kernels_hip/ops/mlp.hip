// The MLP as one stage: y += Wd · (silu(Wg·x̂) * (Wu·x̂)), x̂ = RMSNorm(x), split over blocks along the hidden
// (ffn) dimension, so that no block waits for another between the two halves.
//
// Slice s of n_slices takes hidden rows [s·F/n, (s+1)·F/n): its block computes those rows of gate/up with the
// matvec stream (ops/matvec.hip; HeMvGateUpSlice gives each warp rows r0 + warp, r0 + warp + warps, ... of the
// block's slice instead of grid-strided units) into shared memory, then — after a block barrier, not a grid
// one — its slice's share of the down-projection: the slice's rows of Wdᵀ (the host stores W_down transposed,
// [F][d], so a slice is one contiguous run of rows) times those values, every thread owning 8 output columns.
// The slices' partial outputs are added into y_fx, the residual stream's pending addend, as 64-bit fixed point
// (port.h he_fx_from_f32 / he_red_add_i64_relaxed_device): integer sums do not depend on the order in which
// blocks arrive, so the result is the same bits every run and on both paths (the monokernel runs this body as
// its MLP stage, the per-op path as the kernel mlp_fused on the same slices). Readers add y_fx to x: the next
// RMSNorm prologues (he_rmsnorm_stage's fx) and the O-proj's residual rows (HeMvPlain res_fx), which write the
// completed row back into x and clear its addend.
//
// Cost per layer: one grid-wide dependency fewer than gate/up → barrier → down, and the down weights stream
// from the block's own slice as soon as its gate/up rows are done; d 64-bit adds per slice (Llama-3.2-1B on
// 132 slices: 270K per layer, coalesced: consecutive columns per warp). Memory: W_down is held transposed as
// well (the prefill's matmuls keep the row-major copy).
#ifndef HE_OPS_MLP_HIP
#define HE_OPS_MLP_HIP
#include "port.h"
#include "ops/matvec.hip"

// First hidden row of slice s (slice s is [start(s), start(s + 1)); start(n) = F).
HE_INLINE int he_mlp_slice_start(int s, int F, int n_slices) { return (int)((he_i64)s * F / n_slices); }

// gate/up of one block's slice of hidden rows [r0, r1): unit u = gate row u and up row u, written as
// silu(g)·u to hs[u - r0] (shared memory).
struct HeMvGateUpSlice {
  const float* x;
  const float* gamma;
  float eps;
  int in;
  const he_u16* Wg;
  const he_u16* Wu;
  float* hs;
  int r0, r1;
  const he_i64* x_fx;  // as HeMvPlain's (null: the fused MLP's input x is complete after the O-proj)
  HE_INLINE int units() const { return r1; }  // (the unit hooks below decide which units a warp takes)
  HE_INLINE void rows(int u, const he_u16* (&rp)[2]) const {
    rp[0] = Wg + (he_i64)u * in;
    rp[1] = Wu + (he_i64)u * in;
  }
  HE_INLINE void pre(int, float (&pv)[2]) const { pv[0] = pv[1] = 0.f; }
  HE_INLINE void epi(int u, const float (&acc)[2], const float (&)[2]) const {
    if (he_lane_id() == 0) hs[u - r0] = he_silu(acc[0]) * acc[1];
  }
};
// The block's rows, one warp after another (ops/matvec.hip's unit hooks).
HE_INLINE int he_mv_unit_first(const HeMvGateUpSlice& op) { return op.r0 + he_warp_id(); }
HE_INLINE int he_mv_unit_step(const HeMvGateUpSlice&) { return he_num_warps(); }
HE_INLINE bool he_mv_unit_has(const HeMvGateUpSlice& op, int u) { return u < op.r1; }

// This block's gate/up op for slice `slice` (blocks past the last slice get an empty one).
HE_INLINE HeMvGateUpSlice he_mlp_gate_up_op(const float* x, const float* gamma, float eps, int d, const he_u16* Wg,
                                            const he_u16* Wu, float* hs, int F, int slice, int n_slices) {
  const int r0 = slice < n_slices ? he_mlp_slice_start(slice, F, n_slices) : F;
  const int r1 = slice < n_slices ? he_mlp_slice_start(slice + 1, F, n_slices) : F;
  return HeMvGateUpSlice{x, gamma, eps, d, Wg, Wu, hs, r0, r1, nullptr};
}

// Shared memory of the fused stage, in floats: x̂ [d] | hs [slice rows, rounded to 4] | part [8 · threads].
HE_INLINE int he_mlp_hs_offset(int d) { return d; }
HE_INLINE int he_mlp_part_offset(int d, int F, int n_slices) {
  const int rows = (F + n_slices - 1) / n_slices;
  return d + (rows + 3) / 4 * 4;
}

// Loads per thread per batch of the down half (two batches in flight: 2 · 8 · 16 B per thread, 64 KiB per
// 256-thread block — what the matvec stream keeps in flight per block).
constexpr int kMlpDownBatch = 8;

// The down half of slice rows [r0, r0 + nj): y_fx[c] += fx(Σ_j WdT[r0 + j][c] · hs[j]) for every c < d.
// Threads own 16-byte column vectors v (8 columns); with fewer vectors than threads (d < 8 · threads) the
// threads form `groups` copies of the row of vectors, copy g taking rows g, g + groups, ..., and the copies'
// sums are added in shared memory in copy order. Each thread adds its rows in row order: the sums depend only
// on d, the slice and the block size. The first batches are requested before the block barrier that makes hs
// complete (weights do not depend on it). part: 8 · threads floats of shared memory.
template <bool kF16>
HE_INLINE void he_mlp_down(const he_u16* WdT, const float* hs, int r0, int nj, int d, he_i64* y_fx, float* part) {
  const int t = he_thread_idx(), nt = he_block_dim(), V = d / 8;
  const int groups = V >= nt ? 1 : nt / V;
  constexpr int kB = kMlpDownBatch;
  bool synced = false;
  for (int v0 = 0; v0 < V; v0 += nt) {  // passes of nt vectors (one pass when d <= 8 · threads)
    const int span = groups > 1 ? V : (V - v0 < nt ? V - v0 : nt);  // vectors in this pass
    const int vl = groups > 1 ? t % V : t, g = groups > 1 ? t / V : 0;
    const bool on = g < groups && vl < span && nj > 0;
    const he_u16* col = WdT + (he_i64)r0 * d + 8 * (v0 + vl);
    float a[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) a[e] = 0.f;
    he_vec16 wa[kB], wb[kB];
    const int step = kB * groups;  // rows per batch over all copies
    auto load = [&](he_vec16 (&w)[kB], int jb) {
#pragma unroll
      for (int k = 0; k < kB; ++k) {
        const int j = jb + k * groups + g;
        w[k] = (on && j < nj) ? he_load16_stream(col + (he_i64)j * d) : he_vec16{0u, 0u, 0u, 0u};
      }
    };
    auto use = [&](const he_vec16 (&w)[kB], int jb) {
#pragma unroll
      for (int k = 0; k < kB; ++k) {
        const int j = jb + k * groups + g;
        if (on && j < nj) {
          const float h = hs[j];
          const he_u32 q[4] = {w[k].x, w[k].y, w[k].z, w[k].w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            a[2 * i] = he_fma(kF16 ? he_f16lo_to_f32(q[i]) : he_bf16lo_to_f32(q[i]), h, a[2 * i]);
            a[2 * i + 1] = he_fma(kF16 ? he_f16hi_to_f32(q[i]) : he_bf16hi_to_f32(q[i]), h, a[2 * i + 1]);
          }
        }
      }
    };
    load(wa, 0);
    load(wb, step);
    if (!synced) {  // hs complete (every warp's gate/up epilogue), and part free
      he_sync_block();
      synced = true;
    }
    for (int jb = 0; jb < nj; jb += 2 * step) {  // block-uniform trip count
      use(wa, jb);
      load(wa, jb + 2 * step);
      use(wb, jb + step);
      load(wb, jb + 3 * step);
    }
    if (nj > 0) {
      if (on) {
#pragma unroll
        for (int e = 0; e < 8; ++e) part[(g * span + vl) * 8 + e] = a[e];
      }
      he_sync_block();
      for (int i = t; i < 8 * span; i += nt) {  // consecutive columns per warp: coalesced adds
        float s = part[i];
        for (int c = 1; c < groups; ++c) s += part[c * 8 * span + i];
#if HE_MLP_VARIANT == 1 || HE_MLP_VARIANT == 4  // (bench_ops only) plain stores of the partials, one row per block
        ((float*)y_fx)[(he_i64)he_block_idx() * d + 8 * v0 + i] = s;
#elif HE_MLP_VARIANT == 6  // (bench_ops only) fp32 adds, 4 columns per instruction (not deterministic)
        if (i % 4 == 0 && i + 3 < 8 * span) {
          float* q = (float*)y_fx + 8 * v0 + i;
          asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(q), "f"(s),
                       "f"(part[i + 1]), "f"(part[i + 2]), "f"(part[i + 3]) : "memory");
        }
#else
        he_red_add_i64_relaxed_device(y_fx + 8 * v0 + i, he_fx_from_f32(s));
#endif
      }
      he_sync_block();  // part is reused by the next pass / the caller
    }
  }
}

// HE_MLP_VARIANT (bench_ops' breakdown of mlp_fused only; the monokernel and the decode path build 0): 1 the
// partials stored instead of added, 2 gate/up only, 3 down only, 4 down only with stores, 5 the adds alone (no
// weights), 6 fp32 vector adds (sm_90 PTX; not deterministic).
#ifndef HE_MLP_VARIANT
#define HE_MLP_VARIANT 0
#endif

// The per-op path's MLP: one launch of exactly n_slices blocks (the monokernel's grid: the same slices, hence
// the same bits). y_fx (the residual stream's addend, [d] int64) accumulates; x is not written. Shared memory:
// he_mlp_part_offset(d, F, n_slices) + 8 · blockDim floats.
HE_KERNEL(kMatvecMaxThreads) mlp_fused(const he_u16* __restrict__ Wg, const he_u16* __restrict__ Wu,
                                       const he_u16* __restrict__ WdT, const float* x, const float* __restrict__ gamma,
                                       float eps, he_i64* y_fx, int d, int F, int n_slices, int w_f16) {
  extern __shared__ float he_xs[];
  __shared__ float scratch[kMaxWarpsPerBlock];
  float* hs = he_xs + he_mlp_hs_offset(d);
  float* part = he_xs + he_mlp_part_offset(d, F, n_slices);
  const HeMvGateUpSlice op = he_mlp_gate_up_op(x, gamma, eps, d, Wg, Wu, hs, F, he_block_idx(), n_slices);
#if HE_MLP_VARIANT == 5
  he_pdl_trigger();
  he_pdl_wait();
  for (int i = he_thread_idx(); i < d; i += he_block_dim()) he_red_add_i64_relaxed_device(y_fx + i, 1);
  (void)op; (void)part; (void)w_f16; (void)WdT;
#else
  constexpr bool kUp = HE_MLP_VARIANT != 3 && HE_MLP_VARIANT != 4, kDown = HE_MLP_VARIANT != 2;
  if (!kUp) { he_pdl_trigger(); he_pdl_wait(); }
  if (w_f16) {
    if (kUp) he_matvec_run<true>(op, he_xs, scratch);
    if (kDown) he_mlp_down<true>(WdT, hs, op.r0, op.r1 - op.r0, d, y_fx, part);
  } else {
    if (kUp) he_matvec_run<false>(op, he_xs, scratch);
    if (kDown) he_mlp_down<false>(WdT, hs, op.r0, op.r1 - op.r0, d, y_fx, part);
  }
#endif
}
#endif
