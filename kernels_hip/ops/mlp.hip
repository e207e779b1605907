// The MLP as one stage: y += Wd · (silu(Wg·x̂) * (Wu·x̂)), x̂ = RMSNorm(x), with no grid-wide wait between its
// halves.
//
// A unit of the matvec stream (ops/matvec.hip) is gate row j and up row j, as in HeMvGateUp; HeMvGateUpDown also
// requests row j of Wdᵀ (the host keeps W_down transposed, [F][d]: column j of W_down is d contiguous weights)
// when the unit starts (its pre(), into registers), and its epilogue, once the warp has h_j = silu(g_j)·u_j, adds
// h_j · Wdᵀ[j] into the warp's own partial of y, kept in shared memory (each lane owns 8-column runs of it: in
// registers too, the 64 partial sums pushed the monokernel to 255 registers and 348 bytes of spills). So each warp
// streams 12 KiB per unit and no block waits for another between gate/up and down. At the stage's end the block
// adds its warps' partials in a fixed order (he_mlp_reduce) and adds the result into y_fx,
// the residual stream's pending addend, as 64-bit fixed point (port.h he_fx_from_f32, he_red_add_i64_relaxed_
// device): integer sums do not depend on the order in which blocks arrive, so y is the same bits every run and on
// both paths (the monokernel runs this stage, the per-op path the kernel mlp_fused on the same grid). Readers add
// y_fx to x: the next RMSNorm prologues (he_rmsnorm_stage's fx) and the O-proj's residual rows (HeMvPlain res_fx),
// which write the completed row back into x and clear its addend.
//
// Memory: W_down is held transposed as well (the prefill's matmuls keep the row-major copy); each token reads
// only the transposed one.
#ifndef HE_OPS_MLP_HIP
#define HE_OPS_MLP_HIP
#include "port.h"
#include "ops/matvec.hip"

// 16-byte vectors of a Wdᵀ row per lane: ceil(d / (8 · warp)) for the model (the host passes it; 8 = d 2,048 on
// NVIDIA). A row is kMlpDVec sweeps of warp · 8 columns; columns past d are not loaded.
#ifndef HE_MLP_DVEC
#define HE_MLP_DVEC 8
#endif
constexpr int kMlpDVec = HE_MLP_DVEC;
// One warp's state through the stage: the current unit's Wdᵀ row and where its partial of y is (shared memory,
// kMlpWarpFloats; lane l owns columns k · sweep + l · 8 .. + 7, stored as two 16-byte quarters at he_mlp_slot(k, half,
// lane): consecutive lanes at consecutive 16 bytes, so the epilogue's 16-byte accesses are free of bank conflicts
// — with each lane's 8 floats contiguous they were 8-way conflicts, and v75b's first build ran the MLP stage in
// 49 µs instead of ≈ 25). The row is copied into shared memory asynchronously
// where the target can (port.h kHasCpAsync: NVIDIA; its registers pushed the monokernel past 255 with spills),
// else held in registers (wave64 has the registers).
struct HeMlpWarp {
  he_vec16 dt[kHasCpAsync ? 1 : kMlpDVec];
  float* acc;
  HeSmem dts;  // kHasCpAsync: this warp's row buffer, kMlpDVec · warp 16-byte vectors
};

// Shared memory of the stage, in floats: x̂ [d] | one partial of y per warp (kMlpWarpFloats: kMlpDVec whole sweeps,
// the slots of columns past d unused) | (kHasCpAsync) one Wdᵀ row buffer per warp.
constexpr int kMlpWarpFloats = kMlpDVec * kMatvecSweep;
HE_INLINE int he_mlp_part_offset(int d) { return d; }
// Float offset in a warp's partial of columns k · sweep + lane · 8 + 4 · half .. + 3.
HE_INLINE int he_mlp_slot(int k, int half, int lane) { return ((2 * k + half) * kWarpSize + lane) * 4; }
// ... and of column c.
HE_INLINE int he_mlp_slot_of(int c) {
  const int k = c / kMatvecSweep, r = c % kMatvecSweep;
  return he_mlp_slot(k, (r / 4) & 1, r / 8) + r % 4;
}
HE_INLINE int he_mlp_row_offset(int d) { return d + he_num_warps() * kMlpWarpFloats; }

// This warp's partial in `smem + he_mlp_part_offset(d)` (the block's [warps][kMlpWarpFloats]), zeroed by the lanes that
// own its columns (no other lane touches them until the block's reduction, after a block barrier), and its row
// buffer.
HE_INLINE void he_mlp_begin(HeMlpWarp& w, float* smem, int d) {
  w.acc = smem + he_mlp_part_offset(d) + he_warp_id() * kMlpWarpFloats;
  w.dts = he_smem((char*)(smem + he_mlp_row_offset(d)) + he_warp_id() * kMlpDVec * kWarpSize * 16);
#pragma unroll
  for (int k = 0; k < kMlpDVec; ++k) {
    if (k * kMatvecSweep + he_lane_id() * 8 < d) {
      *(he_vec16*)(w.acc + he_mlp_slot(k, 0, he_lane_id())) = he_vec16{0u, 0u, 0u, 0u};
      *(he_vec16*)(w.acc + he_mlp_slot(k, 1, he_lane_id())) = he_vec16{0u, 0u, 0u, 0u};
    }
  }
}

struct HeMvGateUpDown {
  const float* x;
  const float* gamma;
  float eps;
  int in;
  const he_u16* Wg;
  const he_u16* Wu;
  const he_u16* WdT;  // [n_rows][in]: a down row is as long as gate/up's input (the hidden size)
  int n_rows;
  HeMlpWarp& w;
  const he_i64* x_fx;  // (the stream's prologue addend: none, x is complete after the O-proj)
  HE_INLINE int units() const { return n_rows; }
  HE_INLINE void rows(int u, const he_u16* (&rp)[2]) const {
    rp[0] = Wg + (he_i64)u * in;
    rp[1] = Wu + (he_i64)u * in;
  }
  // Row u of Wdᵀ, in flight while the unit's gate/up rows stream.
  HE_INLINE void pre(int u, float (&pv)[2]) const {
    pv[0] = pv[1] = 0.f;
    const int d = in;
    const he_u16* row = WdT + (he_i64)u * d + he_lane_id() * 8;
#pragma unroll
    for (int k = 0; k < kMlpDVec; ++k) {
      const int c = k * kMatvecSweep + he_lane_id() * 8;
      if constexpr (kHasCpAsync)  // (each lane later reads only what it copied: no barrier needed)
        he_cp_async16_at(w.dts, (k * kWarpSize + he_lane_id()) * 16, c < d ? row + k * kMatvecSweep : WdT, c < d);
      else
        w.dt[kHasCpAsync ? 0 : k] = c < d ? he_load16_stream(row + k * kMatvecSweep) : he_vec16{0u, 0u, 0u, 0u};
    }
    if constexpr (kHasCpAsync) he_cp_async_commit();
  }
  // sums are the warp's (identical in every lane): h = silu(g)·u, then the warp's partial += h · Wdᵀ[u]
  template <bool kF16>
  HE_INLINE void down(const float (&sum)[2]) const {
    const float h = he_silu(sum[0]) * sum[1];
    const int d = in;
    if constexpr (kHasCpAsync) he_cp_async_wait<0>();  // this lane's copies of the row
#pragma unroll
    for (int k = 0; k < kMlpDVec; ++k) {
      const int c = k * kMatvecSweep + he_lane_id() * 8;
      if (c >= d) continue;
      const he_vec16 v = kHasCpAsync ? *(const he_vec16*)(w.dts.p + (k * kWarpSize + he_lane_id()) * 16)
                                     : w.dt[kHasCpAsync ? 0 : k];
      const he_u32 q[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        he_vec16* ap = (he_vec16*)(w.acc + he_mlp_slot(k, half, he_lane_id()));
        const he_vec16 o = *ap;
        float a[4] = {he_u32_as_f32(o.x), he_u32_as_f32(o.y), he_u32_as_f32(o.z), he_u32_as_f32(o.w)};
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const he_u32 wq = q[2 * half + i];
          a[2 * i] = he_fma(kF16 ? he_f16lo_to_f32(wq) : he_bf16lo_to_f32(wq), h, a[2 * i]);
          a[2 * i + 1] = he_fma(kF16 ? he_f16hi_to_f32(wq) : he_bf16hi_to_f32(wq), h, a[2 * i + 1]);
        }
        *ap = he_vec16{he_f32_as_u32(a[0]), he_f32_as_u32(a[1]), he_f32_as_u32(a[2]), he_f32_as_u32(a[3])};
      }
    }
  }
};

// The weight type of the stage, for the epilogue (the stream's epi has no template parameter).
template <bool kF16>
struct HeMvGateUpDownT : HeMvGateUpDown {
  HE_INLINE void epi(int, const float (&sum)[2], const float (&)[2]) const { down<kF16>(sum); }
};

template <bool kF16>
HE_INLINE HeMvGateUpDownT<kF16> he_mlp_op(const float* x, const float* gamma, float eps, int d, const he_u16* Wg,
                                          const he_u16* Wu, const he_u16* WdT, int F, HeMlpWarp& w) {
  return HeMvGateUpDownT<kF16>{{x, gamma, eps, d, Wg, Wu, WdT, F, w, nullptr}};
}

// The block's warps' partials (part: [warps][kMlpWarpFloats]), summed in warp order, added into y_fx[0:d] as fixed point.
// Every thread of the block calls it, after its warp's last unit.
HE_INLINE void he_mlp_reduce(const float* part, int d, he_i64* y_fx) {
  he_sync_block();
  const int nw = he_num_warps();
  for (int i = he_thread_idx(); i < d; i += he_block_dim()) {  // consecutive columns per warp: coalesced adds
    const int o = he_mlp_slot_of(i);
    float s = part[o];
    for (int j = 1; j < nw; ++j) s += part[j * kMlpWarpFloats + o];
#if HE_MLP_VARIANT == 1  // (bench_ops only) plain stores of the block's sums, one row per block
    ((float*)y_fx)[(he_i64)he_block_idx() * d + i] = s;
#else
    he_red_add_i64_relaxed_device(y_fx + i, he_fx_from_f32(s));
#endif
  }
}

// HE_MLP_VARIANT (bench_ops' breakdown of mlp_fused only; the monokernel and the decode path build 0): 1 the block
// sums stored instead of added, 2 gate/up only (no Wdᵀ rows, no sums).
#ifndef HE_MLP_VARIANT
#define HE_MLP_VARIANT 0
#endif

// The per-op path's MLP: the monokernel's stage as one launch, on the monokernel's grid (the same warps take the
// same rows, hence the same bits). y_fx ([d] int64) accumulates; x is not written. Shared memory: ops.py
// mlp_shared_bytes.
template <bool kF16>
HE_INLINE void he_mlp_run(const he_u16* Wg, const he_u16* Wu, const he_u16* WdT, const float* x, const float* gamma,
                          float eps, he_i64* y_fx, int d, int F, float* xs, float* scratch) {
#if HE_MLP_VARIANT == 2
  he_matvec_run<kF16>(HeMvGateUp{x, gamma, eps, d, Wg, Wu, (float*)y_fx, F}, xs, scratch);
  (void)WdT;
#else
  HeMlpWarp w;
  he_mlp_begin(w, xs, d);
  he_matvec_run<kF16>(he_mlp_op<kF16>(x, gamma, eps, d, Wg, Wu, WdT, F, w), xs, scratch);
  he_mlp_reduce(xs + he_mlp_part_offset(d), d, y_fx);
#endif
}

HE_KERNEL_MIN(kMatvecMaxThreads / 2, 1) mlp_fused(const he_u16* __restrict__ Wg, const he_u16* __restrict__ Wu,
                                       const he_u16* __restrict__ WdT, const float* x,
                                       const float* __restrict__ gamma, float eps, he_i64* y_fx, int d, int F,
                                       int w_f16) {
  extern __shared__ float he_xs[];
  __shared__ float scratch[kMaxWarpsPerBlock];
  if (w_f16) he_mlp_run<true>(Wg, Wu, WdT, x, gamma, eps, y_fx, d, F, he_xs, scratch);
  else he_mlp_run<false>(Wg, Wu, WdT, x, gamma, eps, y_fx, d, F, he_xs, scratch);
}
#endif
