// The greedy LM head screened by an int8 copy of its rows — exactly: the token is the bf16 head's arg-max.
//
// At batch 1 the LM head is the largest read of a decode step (Llama-3.2-1B: 128,256 rows × 2,048 bf16 =
// 525 MB of 2.47 GB). Greedy decoding needs only the arg-max of the logits, so a step can stream an int8 copy
// of the rows (half the bytes) and prove which few rows can still hold the maximum:
//
//   host (hipengine/gpu/head_screen.py), per row i of the head as the device holds it (bf16/fp16 values w_i):
//     s_i = max|w_i| / 127, q_i = round(w_i / s_i) ∈ [−127, 127] (int8),
//     c1_i ≥ ||w_i − s_i q_i||₂ + 2⁻¹⁶ (||w_i||₂ + ||s_i q_i||₂), and one c2 ≥ max_i ||s_i q_i||₂ (1 + 2⁻¹⁵);
//   device, per step: xs = the head's normalised input, staged by the bf16 head's own prologue (same bits),
//     s_x = max|xs| / 32767, x16 = round(xs / s_x) (int16), N ≥ ||xs||₂, Δ ≥ ||xs − s_x x16||₂, and per row
//       A_i = s_i s_x Σ_j q_ij x16_j   (per lane an exact int32 dot product, dp2a; the warp sums it in fp32)
//       B_i = (c1_i N + c2 Δ)(1 + 2⁻¹⁰) + 2⁻²⁰ |A_i|.
//     The bf16 head's logit L_i (its fp32 sum, in its order) lies in [A_i − B_i, A_i + B_i]: by Cauchy–Schwarz
//     |Σ w x − Σ s q s_x x16| ≤ ||w − s q|| ||xs|| + ||s q|| ||xs − s_x x16||, and the 2⁻¹⁶ terms cover the fp32
//     rounding of both dot products (≤ ~40 and ~8 units of 2⁻²⁴ of Σ|w x| for rows of up to 8,192), the rest the
//     rounding of N, Δ, B and A ± B.
//   So M = max_i (A_i − B_i) ≤ max_i L_i, and a row with A_i + B_i < M cannot be the arg-max. The rows left
//   (typically 1–30 of 128K) are recomputed from the bf16 rows with the bf16 head's own arithmetic
//   (he_mv_row_exact: the stream's loads and he_mv_consume's chains, the same warp sum) and the arg-max over
//   them — ties to the smaller index — is the bf16 head's, bit for bit. A flat distribution only makes more
//   rows candidates (slower, never wrong); M needs every block's lower bounds, so the choice waits for a grid
//   barrier, which the monokernel has after its LM head anyway.
//
// Stream view: the int8 rows [V4, d] bytes (V4 = vocab rounded up to 4, zero rows after the vocabulary) are
// streamed as a bf16-shaped matrix [V4 / 2, d] — each virtual row two int8 rows — so the weight stream
// (ops/matvec.hip, HeMvPlain's rows and units) requests them with its own code; a unit u (two virtual rows)
// holds int8 rows 4u..4u+3. A 16-byte load at virtual column vc holds int8 columns c..c+15 of row-half
// h = (2·vc ≥ d), c = 2·vc − h·d. d % 16 == 0 and d ≤ 8192 (a lane's int32 sum: ≤ d / 32 · 127 · 32767 < 2³¹).
#ifndef HE_OPS_HEAD_SCREEN_HIP
#define HE_OPS_HEAD_SCREEN_HIP
#include "port.h"
#include "ops/matvec.hip"

// What the screened head needs beyond the stream's op (a HeMvPlain over the int8 rows' virtual matrix).
struct HeHeadScreen {
  const float* meta;  // [V4 / 4][8]: s_i of rows 4u..4u+3, then c1_i of the same rows (host-written)
  float c2;           // the one bound on ||s_i q_i||₂
  int vocab;          // rows past it (padding to V4) are never candidates and bound nothing
  float* lo_out;      // [grid]: each block's max_i (A_i − B_i)
  float* row_lo;      // tests (kRowBounds): [vocab] every row's A_i − B_i and A_i + B_i
  float* row_hi;
};

// The staged input's int16 copy (in shared memory after xs) and its norms, every thread the same values.
struct HeScreenX {
  float sx;  // s_x
  float n;   // N ≥ ||xs||₂
  float dn;  // Δ ≥ ||xs − s_x x16||₂
};

HE_INLINE float he_fabs(float v) { return v < 0.f ? -v : v; }

// The warp's screen slots: A_i + B_i of its units' rows (slot 4j + q: its j-th unit's row 4u + q), kept in shared
// memory from the head stage to the token choice after the barrier. Slots per warp: 4 · ceil(units / warps).
HE_INLINE float* he_screen_slots(float* xs, int d, int units) {
  const int per = (units + he_mv_stride() - 1) / he_mv_stride();
  return xs + d + d / 2 + he_warp_id() * 4 * per;  // after xs (d floats) and x16 (d int16)
}

HE_INLINE HeScreenX he_screen_quantize(const float* xs, int d, he_i16* x16, float* scratch) {
  float amax = 0.f, ss = 0.f;
  for (int j = he_thread_idx(); j < d; j += he_block_dim()) {
    const float v = xs[j];
    amax = he_fmax(amax, he_fabs(v));
    ss = he_fma(v, v, ss);
  }
  amax = he_block_max(amax, scratch);
  ss = he_block_sum(ss, scratch);
  const float sx = amax / 32767.f;  // whatever its rounding: Δ is measured with this s_x
  const float inv = amax > 0.f ? 32767.f / amax : 0.f;
  float dd = 0.f;
  for (int j = he_thread_idx(); j < d; j += he_block_dim()) {
    const float v = xs[j];
    int qv = he_f32_to_i32_rn(v * inv);
    qv = qv > 32767 ? 32767 : (qv < -32767 ? -32767 : qv);
    x16[j] = (he_i16)qv;
    const float r = v - sx * (float)qv;
    dd = he_fma(r, r, dd);
  }
  dd = he_block_sum(dd, scratch);  // its barriers also publish x16 to the block
  const float n = he_sqrt(ss) * (1.f + 0x1p-12f);
  return HeScreenX{sx, n, he_sqrt(dd) * (1.f + 0x1p-12f) + 0x1p-20f * n};
}

// iacc[r][h] += this lane's integer dot products of batch w (virtual columns c0 + k·sweep + lane·8) of the
// unit's virtual rows r with x16.
HE_INLINE void he_screen_consume(const he_vec16 (&w)[2][kMatvecUnroll], int c0, int d, const he_i16* x16,
                                 int (&iacc)[2][2]) {
  const int lane = he_lane_id();
#pragma unroll
  for (int k = 0; k < kMatvecUnroll; ++k) {
    const int vc = c0 + k * kMatvecSweep + lane * 8;
    if (!kMvWholePairs && vc >= d) continue;  // past the virtual row: the stream loaded zeros, nothing to add
    const int e = 2 * vc, h = e >= d ? 1 : 0, c = e - h * d;
    const he_vec16 xa = he_load16(x16 + c), xb = he_load16(x16 + c + 8);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const he_vec16 v = w[r][k];
      int t = he_dp2a_lo(xa.x, v.x, 0);
      t = he_dp2a_hi(xa.y, v.x, t);
      t = he_dp2a_lo(xa.z, v.y, t);
      t = he_dp2a_hi(xa.w, v.y, t);
      t = he_dp2a_lo(xb.x, v.z, t);
      t = he_dp2a_hi(xb.y, v.z, t);
      t = he_dp2a_lo(xb.z, v.w, t);
      t = he_dp2a_hi(xb.w, v.w, t);
      iacc[r][0] += h ? 0 : t;
      iacc[r][1] += h ? t : 0;
    }
  }
}

// Row `row`'s interval from its integer dot product t (summed over the warp), its scale and c1: the upper bound
// into slots[slot], the lower one into lo_max (rows past the vocabulary: -inf, no bound); kRowBounds (tests): both
// into hs.row_lo / row_hi. Every lane computes; the `writer` lane (one that holds the row's sum) stores.
template <bool kRowBounds>
HE_INLINE void he_screen_row(const HeHeadScreen& hs, const HeScreenX& q, int row, float t, he_u32 s_bits,
                             he_u32 c1_bits, bool writer, float* slots, int slot, float& lo_max) {
  const float a = (he_u32_as_f32(s_bits) * q.sx) * t;
  const float b = (he_u32_as_f32(c1_bits) * q.n + hs.c2 * q.dn) * (1.f + 0x1p-10f) + 0x1p-20f * he_fabs(a);
  const bool live = row < hs.vocab;
  if (!writer) return;
  slots[slot] = live ? a + b : he_neg_inf();
  if (live) lo_max = he_fmax(lo_max, a - b);
  if (kRowBounds && live) {
    hs.row_lo[row] = a - b;
    hs.row_hi[row] = a + b;
  }
}

// The screened head as a stage of the weight stream: he_mv_finish's loop over `op` (the int8 rows' virtual
// matrix) with the same refills from nxt, the bf16 head's prologue, then the screen's quantisation, and per unit
// the four rows' A ± B: upper bounds into the warp's slots, the block's max lower bound into lo_out. kDefer as
// in he_mv_finish (the caller requests nxt's first pair after its barrier arrival). kRowBounds (tests): every
// row's interval also into hs.row_lo / row_hi.
template <bool kDefer, bool kRowBounds = false, class Next>
HE_INLINE void he_head_screen_finish(const HeMvPlain& op, HeMvStream<2>& s, float* xs, float* scratch,
                                     const Next& nxt, const HeHeadScreen& hs) {
  if (HE_UNLIKELY(!s.p.nx && s.p.u >= op.units())) {  // no unit of op for this warp
    s.p.u = he_mv_first();
    s.p.c0 = 0;
    s.p.nx = true;
    he_mv_fill_a(op, nxt, s.p, s);
    he_mv_fill_b(op, nxt, s.p, s);
  }
  he_rmsnorm_stage<kMvWholePairs && HE_COLD_HINTS>(op.x, op.gamma, op.eps, op.in, xs, scratch, op.x_fx);
  he_i16* x16 = (he_i16*)(xs + op.in);
  const HeScreenX q = he_screen_quantize(xs, op.in, x16, scratch);
  float* slots = he_screen_slots(xs, op.in, op.units());
  float lo_max = he_neg_inf();
  int slot = 0;
  // A unit's four rows are bounded by four lanes at once: lane group g = (lane / (W/4)) holds row 4u + g after the
  // unit's butterfly (below), and its first lane (the writer) loads that row's s_i and c1_i when the unit starts.
  const int lane = he_lane_id();
  const bool up = (lane & (kWarpSize / 2)) != 0, odd = (lane & (kWarpSize / 4)) != 0, writer = (lane & (kWarpSize / 4 - 1)) == 0;
  const int gr = (up ? 2 : 0) + (odd ? 1 : 0);  // this lane group's row of a unit, 4u + gr
  he_u32 ms = 0u, mc = 0u;                      // the current unit's s and c1 of that row (writer lanes)
  if (!s.p.nx && writer) {
    ms = he_f32_as_u32(hs.meta[8 * (he_i64)s.p.u + gr]);
    mc = he_f32_as_u32(hs.meta[8 * (he_i64)s.p.u + 4 + gr]);
  }
  int iacc[2][2] = {{0, 0}, {0, 0}};
  while (!s.p.nx) {
    HeMvPos n = s.p;
    he_mv_advance(n, op, nxt);
    he_screen_consume(s.a, s.p.c0, op.in, x16, iacc);
    if (!kDefer || !n.nx) he_mv_fill_a(op, nxt, n, s);
    he_screen_consume(s.b, s.p.c0 + kMatvecBatch, op.in, x16, iacc);
    if (!kDefer || !n.nx) he_mv_fill_b(op, nxt, n, s);
    if (n.nx || n.u != s.p.u) {  // the unit's last pair: its four rows' sums in one butterfly, then their bounds
      // rows (0, 1, 2, 3) = iacc (0 0, 0 1, 1 0, 1 1): exchange halves at W/2 (up keeps rows 2, 3), then at W/4 (odd
      // keeps the odd row), then a plain butterfly over the W/4 lanes of each group: 6 shuffles instead of 4 x 5.
      const float v0 = (float)iacc[0][0], v1 = (float)iacc[0][1], v2 = (float)iacc[1][0], v3 = (float)iacc[1][1];
      const float s0 = he_shfl_xor(up ? v0 : v2, kWarpSize / 2), s1 = he_shfl_xor(up ? v1 : v3, kWarpSize / 2);
      const float a0 = (up ? v2 : v0) + s0, a1 = (up ? v3 : v1) + s1;
      float t = (odd ? a1 : a0) + he_shfl_xor(odd ? a0 : a1, kWarpSize / 4);
#pragma unroll
      for (int o = kWarpSize / 8; o > 0; o >>= 1) t += he_shfl_xor(t, o);
      he_screen_row<kRowBounds>(hs, q, 4 * s.p.u + gr, t, ms, mc, writer, slots, 4 * slot + gr, lo_max);
      iacc[0][0] = iacc[0][1] = iacc[1][0] = iacc[1][1] = 0;
      ++slot;
      if (!n.nx && writer) {  // this group's row of the next unit
        ms = he_f32_as_u32(hs.meta[8 * (he_i64)n.u + gr]);
        mc = he_f32_as_u32(hs.meta[8 * (he_i64)n.u + 4 + gr]);
      }
    }
    s.p = n;
  }
  s.p.nx = false;
  lo_max = he_block_max(lo_max, scratch);
  if (he_thread_idx() == 0) hs.lo_out[he_block_idx()] = lo_max;
}

// One row of the bf16 head, computed by the whole warp exactly as the stream computes it (ops/matvec.hip:
// he_matvec_load / he_mv_consume per pair of batches in column order, the two chains, the warp sum, then
// HeMvPlain::epi's + 0 of its null residual): the same bits as that row's logit. Every lane returns it.
template <bool kF16>
HE_INLINE float he_mv_row_exact(const he_u16* row, int in, const float* xs) {
  const he_u16* rp[1] = {row};
  he_vec16 a[1][kMatvecUnroll], b[1][kMatvecUnroll];
  float acc[1][2] = {{0.f, 0.f}};
  for (int c0 = 0; c0 < in; c0 += 2 * kMatvecBatch) {
    he_matvec_load<1>(rp, in, c0, a);
    he_matvec_load<1>(rp, in, c0 + kMatvecBatch, b);
    he_mv_consume<kF16>(a, c0, in, xs, acc);
    he_mv_consume<kF16>(b, c0 + kMatvecBatch, in, xs, acc);
  }
  return he_warp_sum(acc[0][0] + acc[0][1]) + 0.f;
}

// After the barrier that follows he_head_screen_finish (every block's lo_out published): M, then this warp's
// candidates (slots ≥ M) recomputed exactly from the bf16 rows W; (best, bi) is the warp's arg-max over them
// (−inf / INT_MAX if none; ties to the smaller row). xs still holds the staged input.
template <bool kF16>
HE_INLINE void he_head_screen_pick(const he_u16* W, int d, int vocab, const float* lo, const float* xs,
                                   float* scratch, float& best, int& bi) {
  const int units = (vocab + 3) / 4;
  float m = he_neg_inf();
  for (int b = he_thread_idx(); b < he_grid_dim(); b += he_block_dim()) m = he_fmax(m, lo[b]);
  m = he_block_max(m, scratch);
  const float* slots = he_screen_slots((float*)xs, d, units);
  const int first = he_mv_first(), stride = he_mv_stride();
  const int mine = first < units ? 4 * ((units - first + stride - 1) / stride) : 0;
  const int lane = he_lane_id();
  best = he_neg_inf();
  bi = 0x7fffffff;
  for (int j0 = 0; j0 < mine; j0 += kWarpSize) {
    const int jl = j0 + lane;
    // (a padding row's slot is -inf, but so may M be — x = NaN or every bound -inf — hence the row test)
    int pend = jl < mine && 4 * (first + (jl / 4) * stride) + jl % 4 < vocab && slots[jl] >= m ? 1 : 0;
    for (;;) {  // this lane group's candidates, lowest lane first (warp-uniform loop)
      int lead = pend ? lane : kWarpSize;
#pragma unroll
      for (int o = kWarpSize / 2; o > 0; o >>= 1) {
        const int other = he_shfl_xor_int(lead, o);
        lead = other < lead ? other : lead;
      }
      if (lead == kWarpSize) break;
      const int j = j0 + lead, row = 4 * (first + (j / 4) * stride) + j % 4;
      const float v = he_mv_row_exact<kF16>(W + (he_i64)row * d, d, xs);
      if (v > best || (v == best && row < bi)) { best = v; bi = row; }
      if (lane == lead) pend = 0;
    }
  }
}

#ifndef HE_IN_MONOKERNEL
// The screen on its own (tests): every row's [A − B, A + B] into lo / hi (the bf16 head's logits must lie
// inside), each block's max lower bound into block_lo, then — after the host's stream order makes block_lo
// whole, i.e. in a second launch, head_screen_pick — each block's exact arg-max over its candidates. Both
// launches must have the same grid (the slots are per warp). Dynamic shared memory: hipengine/gpu/head_screen.py
// smem_bytes.
HE_KERNEL(kMatvecMaxThreads) head_screen_bounds(const he_u16* __restrict__ Wq, const float* __restrict__ meta,
                                             float c2, const float* x, const float* __restrict__ gamma, float eps,
                                             int d, int vocab, float* lo, float* hi, float* block_lo) {
  extern __shared__ float he_xs[];
  __shared__ float scratch[kMaxWarpsPerBlock];
  const int v4 = (vocab + 3) / 4 * 4;
  const HeMvPlain op{x, gamma, eps, d, Wq, nullptr, nullptr, v4 / 2, nullptr, nullptr};
  const HeHeadScreen hs{meta, c2, vocab, block_lo, lo, hi};
  HeMvStream<2> s;
  const HeMvNone none{0};
  he_mv_begin(op, s, none);  // weights only (no kernel writes them), then the step data
  he_pdl_wait();
  he_head_screen_finish<false, true>(op, s, he_xs, scratch, none, hs);
}

// The pick on its own (tests): recomputes the bounds into the slots (same grid, same values), then each block's
// candidates against block_lo (from head_screen_bounds), exactly; out[2b], out[2b + 1]: the block's (value,
// row bits). W: the bf16/fp16 head; w_f16 its dtype.
HE_KERNEL(kMatvecMaxThreads) head_screen_pick(const he_u16* __restrict__ Wq, const float* __restrict__ meta,
                                           float c2, const float* x, const float* __restrict__ gamma, float eps,
                                           int d, int vocab, const float* block_lo, float* scratch_lo,
                                           const he_u16* __restrict__ W, int w_f16, float* out) {
  extern __shared__ float he_xs[];
  __shared__ float scratch[kMaxWarpsPerBlock];
  __shared__ float wv[kMaxWarpsPerBlock];
  __shared__ int wi[kMaxWarpsPerBlock];
  const int v4 = (vocab + 3) / 4 * 4;
  const HeMvPlain op{x, gamma, eps, d, Wq, nullptr, nullptr, v4 / 2, nullptr, nullptr};
  const HeHeadScreen hs{meta, c2, vocab, scratch_lo, nullptr, nullptr};
  HeMvStream<2> s;
  const HeMvNone none{0};
  he_mv_begin(op, s, none);  // weights only (no kernel writes them), then the step data
  he_pdl_wait();
  he_head_screen_finish<false>(op, s, he_xs, scratch, none, hs);
  float best;
  int bi;
  if (w_f16) he_head_screen_pick<true>(W, d, vocab, block_lo, he_xs, scratch, best, bi);
  else he_head_screen_pick<false>(W, d, vocab, block_lo, he_xs, scratch, best, bi);
  // the block's arg-max (ties to the smaller row), as mk_argmax_grid's
  he_warp_argmax(best, bi);
  if (he_lane_id() == 0) { wv[he_warp_id()] = best; wi[he_warp_id()] = bi; }
  he_sync_block();
  if (he_thread_idx() == 0) {
    best = wv[0];
    bi = wi[0];
    for (int w = 1; w < he_num_warps(); ++w)
      if (wv[w] > best || (wv[w] == best && wi[w] < bi)) { best = wv[w]; bi = wi[w]; }
    out[2 * he_block_idx()] = best;
    out[2 * he_block_idx() + 1] = he_u32_as_f32((he_u32)bi);
  }
}
#endif

#endif
