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

// s + the same dot product as one fused multiply-add chain (the matvec stream's form: 2 FP instructions per
// weight pair instead of he_wdot8's 3).
template <bool kF16>
HE_INLINE float he_wfma8(const he_vec16 w, const float* x, float s) {
  const he_u32 q[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    s = he_fma(kF16 ? he_f16lo_to_f32(q[j]) : he_bf16lo_to_f32(q[j]), x[2 * j], s);
    s = he_fma(kF16 ? he_f16hi_to_f32(q[j]) : he_bf16hi_to_f32(q[j]), x[2 * j + 1], s);
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
// HE_MV_WHOLE_PAIRS=1: the host's promise that every row length this module streams is a multiple of 2B (a
// pair of batches: 2,048 columns on NVIDIA, 4,096 on wave64), so the load and the consume compile without
// their predicated paths — code such rows never run, which sat between the code they do run and cost
// instruction fetch every stage: the monokernel 6% faster at 1K on H200, the per-op path 1% (docs/perf-log.md
// v67; hipengine/gpu/ops.py whole_pairs picks it per row length, monokernel.py compile_args per model).
#ifndef HE_MV_WHOLE_PAIRS
#define HE_MV_WHOLE_PAIRS 0
#endif
constexpr bool kMvWholePairs = HE_MV_WHOLE_PAIRS != 0;

// A batch wholly inside the rows (every Llama dimension: multiples of kMatvecBatch) takes the unpredicated
// path: the predicated one costs a compare and a zeroed destination per load (measured in SASS: 128 register
// clears per pair) and the batch's loads are warp-uniformly in range or not.
template <int kRows>
HE_INLINE void he_matvec_load(const he_u16* const (&rows)[kRows], int in, int c0, he_vec16 (&w)[kRows][kMatvecUnroll]) {
  const int lane = he_lane_id();
  if (kMvWholePairs || c0 + kMatvecBatch <= in) {
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int u = 0; u < kMatvecUnroll; ++u) w[r][u] = he_load16_stream(rows[r] + c0 + u * kMatvecSweep + lane * 8);
    return;
  }
  if constexpr (!kMvWholePairs) {
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int u = 0; u < kMatvecUnroll; ++u) {
        const int c = c0 + u * kMatvecSweep + lane * 8;
        w[r][u] = (c < in) ? he_load16_stream(rows[r] + c) : he_vec16{0u, 0u, 0u, 0u};
      }
  }
}

// ---- the row stream --------------------------------------------------------------------------------------
// A warp's work in one matvec is its units u0, u0 + stride, ... (u0 = global warp index, stride = warps in
// the grid); a unit is kRows rows of `in` weights, read in batches of kMatvecBatch columns, two batches at a
// time: register buffer `a` holds columns [c0, c0 + B) of the unit's rows and `b` holds [c0 + B, c0 + 2B)
// (B = kMatvecBatch; a unit's columns are padded to a multiple of 2B, the padding loads nothing). After `a`
// is consumed it is refilled with the next pair's first batch, after `b` with its second, so two batches are
// in flight while one is reduced, and the stream does not drain between units.
//
// Nor between ops: the pair after a warp's last one belongs to the NEXT matvec (the `nxt` descriptor), so
// when a stage ends every warp already holds — or has in flight — the first two batches of its part of the
// next stage. Weights never depend on activations, so the monokernel keeps one stream running through the
// whole step: a grid barrier, attention or token selection only delay the consumption, never the requests.
// The per-op kernels use the same code with HeMvNone as the next op.
//
//   he_mv_begin(op, s, nxt)   first two batches of this warp's part of op (or of nxt if op has none for it)
//   he_mv_finish(op, s, ..., nxt)   fused RMSNorm prologue, then consume op's batches, refilling from nxt
//
// An op is a small struct: the prologue input (x, gamma, eps, in), units(), rows(u, rp) (the kRows row
// pointers of unit u), pre(u, pv) (loads of the unit's epilogue operands that do not depend on its sums —
// the residual rows of an O-proj / down-proj — issued when the unit starts, before the prologue for a warp's
// first unit, so that their round trip overlaps the unit's weights instead of following its warp reduction)
// and epi(u, acc, pv) (lane-0 stores of the unit's kRows sums, identical in every lane).
struct HeMvPos {
  int u, c0;  // unit and first column of the pair held in (a, b)
  bool nx;    // the pair belongs to the next op
};

template <int kRows>
struct HeMvStream {
  he_vec16 a[kRows][kMatvecUnroll];  // columns [c0, c0 + B) of unit u's rows: arrived or in flight
  he_vec16 b[kRows][kMatvecUnroll];  // columns [c0 + B, c0 + 2B)
  HeMvPos p;
};

// The op after the last one (per-op kernels, or a chain's end): no units.
struct HeMvNone {
  int in;
  HE_INLINE int units() const { return 0; }
  template <int kRows>
  HE_INLINE void rows(int, const he_u16* (&rp)[kRows]) const {
    for (int r = 0; r < kRows; ++r) rp[r] = nullptr;
  }
};

HE_INLINE int he_mv_stride() { return he_grid_dim() * he_num_warps(); }
HE_INLINE int he_mv_first() { return he_block_idx() * he_num_warps() + he_warp_id(); }

template <int kRows>
HE_INLINE void he_mv_zero(he_vec16 (&w)[kRows][kMatvecUnroll]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int k = 0; k < kMatvecUnroll; ++k) w[r][k] = he_vec16{0u, 0u, 0u, 0u};
}

// Ops whose weights are the packed 13-bit form (ops/matvec_packed.hip) say so with `static constexpr bool
// kPacked = true` and bring their own batch load, consume, exponent offset and exact fix-up of the rare units
// the form cannot hold (he_mv_finish calls them); every other op is bf16 / fp16 and takes the code below.
template <class Op, class = void>
struct HeMvIsPacked {
  static constexpr bool value = false;
};
template <class Op>
struct HeMvIsPacked<Op, decltype(void(Op::kPacked))> {
  static constexpr bool value = Op::kPacked;
};
// Ops whose prologue input is the fixed-point buffer x_fx alone say so with `static constexpr bool kFxOnly = true`
// (the monokernel's gate/up after the grouped O-proj, ops/matvec_group.hip): x is not read.
template <class Op, class = void>
struct HeMvFxOnly {
  static constexpr bool value = false;
};
template <class Op>
struct HeMvFxOnly<Op, decltype(void(Op::kFxOnly))> {
  static constexpr bool value = Op::kFxOnly;
};

// Load batch columns [c0, c0 + B) of unit u of `op` (zeros past the rows' end or when there is no unit).
template <class Op, int kRows>
HE_INLINE void he_mv_load(const Op& op, int u, int c0, he_vec16 (&w)[kRows][kMatvecUnroll]) {
  if (u >= op.units()) { he_mv_zero(w); return; }
  if constexpr (HeMvIsPacked<Op>::value) {
    op.pload(u, c0, w);
    return;
  }
  const he_u16* rp[kRows];
  op.rows(u, rp);
  he_matvec_load<kRows>(rp, op.in, c0, w);
}

// Load both batches of pair p (from op, or from nxt once the pair belongs to it).
template <class Op, class Next, int kRows>
HE_INLINE void he_mv_fill_a(const Op& op, const Next& nxt, const HeMvPos& p, HeMvStream<kRows>& s) {
  if (!p.nx) he_mv_load(op, p.u, p.c0, s.a);
  else he_mv_load(nxt, p.u, p.c0, s.a);
}
template <class Op, class Next, int kRows>
HE_INLINE void he_mv_fill_b(const Op& op, const Next& nxt, const HeMvPos& p, HeMvStream<kRows>& s) {
  if (!p.nx) he_mv_load(op, p.u, p.c0 + kMatvecBatch, s.b);
  else he_mv_load(nxt, p.u, p.c0 + kMatvecBatch, s.b);
}

// p past op's last unit -> the first pair of nxt.
template <class Op>
HE_INLINE void he_mv_norm(HeMvPos& p, const Op& op) {
  if (!p.nx && p.u >= op.units()) { p.u = he_mv_first(); p.c0 = 0; p.nx = true; }
}

// The pair after p: next 2B columns, then the warp's next unit, then nxt's first pair.
template <class Op, class Next>
HE_INLINE void he_mv_advance(HeMvPos& p, const Op& op, const Next& nxt) {
  p.c0 += 2 * kMatvecBatch;
  if (p.c0 >= (p.nx ? nxt.in : op.in)) { p.c0 = 0; p.u += he_mv_stride(); }
  he_mv_norm(p, op);
}

template <class Op, class Next, int kRows>
HE_INLINE void he_mv_begin(const Op& op, HeMvStream<kRows>& s, const Next& nxt) {
  s.p = HeMvPos{he_mv_first(), 0, false};
  he_mv_norm(s.p, op);
  he_mv_fill_a(op, nxt, s.p, s);
  he_mv_fill_b(op, nxt, s.p, s);
}

// acc[r][k % 2] += this lane's part of batch w (columns c0 + k·sweep + lane·8) of the unit's rows: two FMA
// chains per row (even and odd sweeps), summed when the unit ends.
template <bool kF16, int kRows>
HE_INLINE void he_mv_consume(const he_vec16 (&w)[kRows][kMatvecUnroll], int c0, int in, const float* xs,
                             float (&acc)[kRows][2]) {
  const int lane = he_lane_id();
  if (kMvWholePairs || c0 + kMatvecBatch <= in) {  // whole batch in range (warp-uniform), as in he_matvec_load
#pragma unroll
    for (int k = 0; k < kMatvecUnroll; ++k)
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        acc[r][k & 1] = he_wfma8<kF16>(w[r][k], xs + c0 + k * kMatvecSweep + lane * 8, acc[r][k & 1]);
    return;
  }
  if constexpr (!kMvWholePairs) {
#pragma unroll
    for (int k = 0; k < kMatvecUnroll; ++k) {
      const int c = c0 + k * kMatvecSweep + lane * 8;
      if (c < in) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) acc[r][k & 1] = he_wfma8<kF16>(w[r][k], xs + c, acc[r][k & 1]);
      }
    }
  }
}

// Stage the activation (RMSNorm prologue), then consume this warp's pairs of op; each buffer is refilled as
// soon as it is consumed, from op or — past op's end — from nxt. On return s holds nxt's first pair (as
// "current": the caller's next he_mv_finish is for nxt). Batches are consumed in column order, so a lane's
// partial sums are added in the same order as a plain loop: results do not depend on the pipelining, the
// unroll depth, or which op came before.
// kDefer: the loop does not request nxt's first pair; the caller does, with he_mv_fill_next(nxt, s), later
// (the monokernel: after its barrier arrival, whose release fence would otherwise wait for those loads).
template <bool kF16, bool kDefer = false, class Op, class Next, int kRows>
HE_INLINE void he_mv_finish(const Op& op, HeMvStream<kRows>& s, float* xs, float* scratch, const Next& nxt) {
  if (HE_UNLIKELY(!s.p.nx && s.p.u >= op.units())) {  // no unit of op for this warp
    s.p.u = he_mv_first();
    s.p.c0 = 0;
    s.p.nx = true;
    he_mv_fill_a(op, nxt, s.p, s);
    he_mv_fill_b(op, nxt, s.p, s);
  }
  constexpr bool kPacked = HeMvIsPacked<Op>::value;
  float pv[kRows];  // the current unit's epilogue operands (op.pre)
  if (!s.p.nx) op.pre(s.p.u, pv);
  [[maybe_unused]] bool fix = false;  // packed ops: the current unit is one the packed form cannot hold (op.pfix recomputes it)
  if constexpr (kPacked) {
    if (!s.p.nx) fix = op.pesc(s.p.u);
  }
  // whole-pair rows have n % 4 == 0: the norm's scalar path is dropped with the cold-branch hints (the measured
  // v68 build; the per-op modules, built without the hints, keep it). Packed ops stage x · 2^D (their offset).
  if constexpr (kPacked)
    he_rmsnorm_stage<kMvWholePairs && HE_COLD_HINTS, true>(op.x, op.gamma, op.eps, op.in, xs, scratch, op.x_fx, op.pk.post);
  else
    he_rmsnorm_stage<kMvWholePairs && HE_COLD_HINTS, false, HeMvFxOnly<Op>::value>(op.x, op.gamma, op.eps, op.in, xs,
                                                                                  scratch, op.x_fx);
  he_pdl_trigger_staged();  // port.h: a per-op HE_PDL_LATE=2 build lets the next kernel launch here; else nothing
  float acc[kRows][2];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = 0.f;
  while (!s.p.nx) {
    HeMvPos n = s.p;
    he_mv_advance(n, op, nxt);
    if constexpr (kPacked) op.pconsume(s.a, s.p.c0, xs, acc);
    else he_mv_consume<kF16>(s.a, s.p.c0, op.in, xs, acc);
    if (!kDefer || !n.nx) he_mv_fill_a(op, nxt, n, s);
    if constexpr (kPacked) op.pconsume(s.b, s.p.c0 + kMatvecBatch, xs, acc);
    else he_mv_consume<kF16>(s.b, s.p.c0 + kMatvecBatch, op.in, xs, acc);
    if (!kDefer || !n.nx) he_mv_fill_b(op, nxt, n, s);
    if (n.nx || n.u != s.p.u) {  // the unit's last pair: reduce over the warp, store, restart
      float sum[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        sum[r] = he_warp_sum(acc[r][0] + acc[r][1]);
        acc[r][0] = acc[r][1] = 0.f;
      }
      if constexpr (kPacked) {
        if (HE_UNLIKELY(fix)) op.pfix(s.p.u, xs, sum);
      }
      op.epi(s.p.u, sum, pv);
      if (!n.nx) op.pre(n.u, pv);  // the warp's next unit of op
      if constexpr (kPacked) {
        if (!n.nx) fix = op.pesc(n.u);
      }
    }
    s.p = n;
  }
  s.p.nx = false;
}

// The first pair of nxt after a he_mv_finish<kF16, true>(op, s, ..., nxt) (s.p is nxt's first pair).
// Two calls on purpose: where the row pointers are loads (the monokernel's layer table after a grid wait), the
// second batch's address arithmetic follows fill_a's unit test, and there ptxas waits again on the pointers'
// scoreboard, which it shares with the first batch's loads — so the second batch goes out only once the first
// has arrived. Issuing both at once was 2.0 / 1.1 / 0.6% slower at 1K / 8K / 32K on H200 (the O-proj's and
// gate/up's fills −0.8% each, QKV's ±0; docs/perf-log.md v69): those bytes land in a latency-bound window.
template <class Next, int kRows>
HE_INLINE void he_mv_fill_next(const Next& nxt, HeMvStream<kRows>& s) {
  he_mv_fill_a(nxt, nxt, s.p, s);
  he_mv_fill_b(nxt, nxt, s.p, s);
}

HE_INLINE float he_silu(float g) { return g / (1.f + he_exp(-g)); }

// ---- y = W·x (+ residual) ------------------------------------------------------------------------------
// Two rows per unit (more loads in flight per warp). residual may alias y: each y[r] is read then written by
// the same lane. gamma != nullptr fuses RMSNorm(x; gamma, eps) as the prologue. Odd `rows`: the last unit
// computes the last row twice and writes it once.
// x_fx (optional, the fused MLP's builds): the residual stream's pending 64-bit fixed-point addend (ops/mlp.hip),
// added to x in the prologue. res_fx (optional, the O-proj of those builds): the same addend of the residual
// rows — added to each residual row (as the prologue adds it: the same float sum) and cleared by the epilogue,
// which writes the completed row.
struct HeMvPlain {
  const float* x;
  const float* gamma;
  float eps;
  int in;
  const he_u16* W;
  const float* residual;
  float* y;
  int n_rows;
  const he_i64* x_fx;
  he_i64* res_fx;
  HE_INLINE int units() const { return (n_rows + 1) / 2; }
  HE_INLINE void rows(int u, const he_u16* (&rp)[2]) const {
    const int r0 = 2 * u, r1 = r0 + 1 < n_rows ? r0 + 1 : r0;
    rp[0] = W + (he_i64)r0 * in;
    rp[1] = W + (he_i64)r1 * in;
  }
  // The residual rows, by lane 0 (the only lane that stores). residual[r] is written only by this unit's own
  // epilogue, so the early value is the one a late load would see.
  HE_INLINE void pre(int u, float (&pv)[2]) const {
    pv[0] = pv[1] = 0.f;
    if (residual == nullptr || he_lane_id() != 0) return;
    const int r0 = 2 * u, r1 = r0 + 1;
    pv[0] = residual[r0];
    if (r1 < n_rows) pv[1] = residual[r1];
    if (res_fx != nullptr) {
      pv[0] = pv[0] + he_fx_to_f32(res_fx[r0]);
      if (r1 < n_rows) pv[1] = pv[1] + he_fx_to_f32(res_fx[r1]);
    }
  }
  HE_INLINE void epi(int u, const float (&acc)[2], const float (&pv)[2]) const {
    if (he_lane_id() != 0) return;
    const int r0 = 2 * u, r1 = r0 + 1;
    y[r0] = acc[0] + pv[0];
    if (r1 < n_rows) y[r1] = acc[1] + pv[1];
    if (res_fx != nullptr) {
      res_fx[r0] = 0;
      if (r1 < n_rows) res_fx[r1] = 0;
    }
  }
};

// ---- y = W·x (+ residual), one row per unit -------------------------------------------------------------
// HeMvPlain with units of one row: twice the warps for the same matrix. The per-op path takes it for long
// rows whose 2-row units leave the grid short of warps (the down-projection: 1,024 units of 2 × 8,192
// weights fill one 8-warp block per SM, each warp streaming 4 pairs with 8 KiB in flight), built with
// HE_MATVEC_UNROLL=8 so a warp keeps the same 64 registers — 8 KiB — of one row's weights in flight
// (hipengine/gpu/ops.py matvec_rows1). A row's sum is the same chain as in HeMvPlain whatever kRows and the
// unroll depth (a lane adds its even and odd sweeps, each in column order, then the warp sum), so the bits
// are HeMvPlain's.
struct HeMvPlain1 {
  const float* x;
  const float* gamma;
  float eps;
  int in;
  const he_u16* W;
  const float* residual;
  float* y;
  int n_rows;
  const he_i64* x_fx;  // as HeMvPlain's (no res_fx: the per-op path's one-row down is not the fused MLP's)
  HE_INLINE int units() const { return n_rows; }
  HE_INLINE void rows(int u, const he_u16* (&rp)[1]) const { rp[0] = W + (he_i64)u * in; }
  HE_INLINE void pre(int u, float (&pv)[1]) const {  // as HeMvPlain::pre
    pv[0] = 0.f;
    if (residual != nullptr && he_lane_id() == 0) pv[0] = residual[u];
  }
  HE_INLINE void epi(int u, const float (&acc)[1], const float (&pv)[1]) const {
    if (he_lane_id() == 0) y[u] = acc[0] + pv[0];
  }
};

// HeMvPlain1 whose residual row is a 64-bit fixed-point word (the per-op path's down-projection after the grouped
// O-proj: ops/matvec_group.hip HeMvPlainFxRes is its two-row form, which the monokernel runs): y[u] = the sum +
// res_fx[u], then res_fx[u] = 0. Each lane loads one 32-bit half of the row's word straight into its one pv register
// — even lanes the low half, odd lanes the high half (little-endian on both targets; one request for the warp) — so
// no instruction reads the load before the epilogue (HeMvPlainFxRes's reason: the in-order return, docs/perf-log.md
// session 39; a select between the halves after a 64-bit load would wait for it in pre()). In the epilogue lane 0
// takes lane 1's half by a shuffle (the warp is converged after the sum's butterfly) and writes y; lanes 0 and 1
// clear their halves. The sum is HeMvPlain1's, the conversion HeMvPlainFxRes's: the same bits as the monokernel's
// down-proj.
struct HeMvPlain1FxRes : HeMvPlain1 {  // (residual is not read)
  he_u32* res_w;  // the int64 words as 32-bit halves (word r: res_w[2r] low, res_w[2r + 1] high): every access here
                  // is 32-bit, so no word is read or written through two types
  HE_INLINE void pre(int u, float (&pv)[1]) const { pv[0] = he_u32_as_f32(res_w[2 * u + (he_lane_id() & 1)]); }
  HE_INLINE void epi(int u, const float (&acc)[1], const float (&pv)[1]) const {
    const int l = he_lane_id();
    const he_u32 hi = (he_u32)he_shfl_xor_int((int)he_f32_as_u32(pv[0]), 1);  // lane 0 <- lane 1's high half
    if (l == 0) y[u] = acc[0] + he_fx_to_f32(he_i64_of_words(he_f32_as_u32(pv[0]), hi));
    if (l < 2) res_w[2 * u + l] = 0u;
  }
};

// The per-op kernels' common body: this warp's first two batches of weights are requested, THEN the kernel
// waits for the step data (he_pdl_wait, port.h): launched with the host's `pdl` flag, those loads overlap
// the end of the kernel before it. The monokernel runs the same stream through its stages instead. The next
// kernel may launch at the top, after the wait or after the staging (in he_mv_finish), by the module's
// HE_PDL_LATE (port.h).
template <bool kF16, int kRows = 2, class Op>
HE_INLINE void he_matvec_run(const Op& op, float* xs, float* scratch) {
  he_pdl_trigger_top();
  HeMvStream<kRows> s;
  const HeMvNone none{0};
  he_mv_begin(op, s, none);  // weights only: no kernel writes them
  he_pdl_wait();
  he_pdl_trigger_late();
  he_mv_finish<kF16>(op, s, xs, scratch, none);
}

// The per-op kernels' fixed-point addends (HeMvPlain x_fx / res_fx) are build choices: -DHE_MV_X_FX=1 /
// -DHE_MV_RES_FX=1 (hipengine/gpu/ops.py picks the module by the arguments given) take the pointer as non-null,
// the default drops it, so neither build carries the other's path (with both at run time ptxas spilled 12 bytes
// in the stream of the matvec kernel).
#ifndef HE_MV_X_FX
#define HE_MV_X_FX 0
#endif
#ifndef HE_MV_RES_FX
#define HE_MV_RES_FX 0
#endif
template <bool kOn, class T>
HE_INLINE T* he_mv_fx_arg(T* p) {
  if constexpr (!kOn) return nullptr;
  __builtin_assume(p != nullptr);
  return p;
}

// x_fx / res_fx: HeMvPlain's (the fused MLP's residual addend: the LM head's / the O-proj's), used in the
// HE_MV_X_FX / HE_MV_RES_FX builds.
HE_KERNEL(kMatvecMaxThreads) matvec(const he_u16* __restrict__ W, const float* x, const float* __restrict__ gamma, float eps,
                       const float* residual, float* y, int rows, int in, int w_f16, const he_i64* x_fx,
                       he_i64* res_fx) {
  extern __shared__ float he_xs[];  // [in]
  __shared__ float scratch[kMaxWarpsPerBlock];
  const HeMvPlain op{x, gamma, eps, in, W, residual, y, rows, he_mv_fx_arg<HE_MV_X_FX != 0>(x_fx),
                     he_mv_fx_arg<HE_MV_RES_FX != 0>(res_fx)};
  if (w_f16) he_matvec_run<true>(op, he_xs, scratch);
  else he_matvec_run<false>(op, he_xs, scratch);
}

// Not in the monokernel's module (HE_IN_MONOKERNEL): it does not use it, and kernels beside its own change
// how NVVM compiles it (see attention_decode.hip).
#ifndef HE_IN_MONOKERNEL
HE_KERNEL(kMatvecMaxThreads) matvec_rows1(const he_u16* __restrict__ W, const float* x, const float* __restrict__ gamma,
                             float eps, const float* residual, float* y, int rows, int in, int w_f16) {
  extern __shared__ float he_xs[];  // [in]
  __shared__ float scratch[kMaxWarpsPerBlock];
  const HeMvPlain1 op{x, gamma, eps, in, W, residual, y, rows};
  if (w_f16) he_matvec_run<true, 1>(op, he_xs, scratch);
  else he_matvec_run<false, 1>(op, he_xs, scratch);
}

// y = W·x + res_fx (then res_fx cleared, row by row) in one-row units: the per-op down-projection after the grouped
// O-proj where ops.matvec_rows1 picks one-row units (matvec_group.hip matvec_fx_res is the two-row kernel).
HE_KERNEL(kMatvecMaxThreads) matvec_rows1_fx_res(const he_u16* __restrict__ W, const float* x, he_i64* res_fx,
                                                float* y, int rows, int in, int w_f16) {
  extern __shared__ float he_xs[];  // [in]
  __shared__ float scratch[kMaxWarpsPerBlock];
  const HeMvPlain1FxRes op{{x, nullptr, 0.f, in, W, nullptr, y, rows}, reinterpret_cast<he_u32*>(res_fx)};
  if (w_f16) he_matvec_run<true, 1>(op, he_xs, scratch);
  else he_matvec_run<false, 1>(op, he_xs, scratch);
}
#endif

// ---- y = silu(Wg·x) * (Wu·x) ------------------------------------------------------------------------------
// Unit u = gate row u and up row u.
struct HeMvGateUp {
  const float* x;
  const float* gamma;
  float eps;
  int in;
  const he_u16* Wg;
  const he_u16* Wu;
  float* y;
  int n_rows;
  const he_i64* x_fx;  // as HeMvPlain's
  HE_INLINE int units() const { return n_rows; }
  HE_INLINE void rows(int u, const he_u16* (&rp)[2]) const {
    rp[0] = Wg + (he_i64)u * in;
    rp[1] = Wu + (he_i64)u * in;
  }
  HE_INLINE void pre(int, float (&pv)[2]) const { pv[0] = pv[1] = 0.f; }
  HE_INLINE void epi(int u, const float (&acc)[2], const float (&)[2]) const {
    if (he_lane_id() == 0) y[u] = he_silu(acc[0]) * acc[1];
  }
};

HE_KERNEL(kMatvecMaxThreads) matvec_gate_up(const he_u16* __restrict__ Wg, const he_u16* __restrict__ Wu, const float* x,
                               const float* __restrict__ gamma, float eps, float* y, int rows, int in, int w_f16) {
  extern __shared__ float he_xs[];
  __shared__ float scratch[kMaxWarpsPerBlock];
  const HeMvGateUp op{x, gamma, eps, in, Wg, Wu, y, rows};
  if (w_f16) he_matvec_run<true>(op, he_xs, scratch);
  else he_matvec_run<false>(op, he_xs, scratch);
}

// ---- QKV + bias + RoPE + KV append -------------------------------------------------------------------------
// Wqkv is wq, wk, wv stacked: [q_dim + 2·kv_dim, in]. RoPE is in rotate-half form, pairing element i of a
// head with element i + hd/2, so one unit is exactly that pair of rows and rotates it in registers:
//   out[i]        = a·cos − b·sin
//   out[i + hd/2] = b·cos + a·sin        (a = row i, b = row i + hd/2; cos/sin at [pos][i])
// cos/sin tables [max_ctx][hd/2] fp32 come from the host (ModelConfig.rope_inv_freq(), float64) so the
// device never recomputes frequencies. The position is read from device memory (*pos_p) so a captured
// graph / the monokernel advances it without relaunch arguments changing.
// KV cache (per layer): k_cache, v_cache he_kv (bf16 or fp16, port.h) [num_kv_heads][max_ctx][hd].
// rope == 0 (Qwen3 qk_norm path): no RoPE/append here; raw q|k|v (+bias) go to q_out [q_dim + 2·kv_dim]
// and qk_norm_rope finishes the job after the per-head norm.
// kEarlyPos: pre() loads the position when the unit starts, so the epilogue of a warp's last unit ends in one
// dependent load (cos/sin) instead of two (the per-op kernel, matvec_qkv; same values, same bits). Not the
// cos/sin as well: a load that depends on another one at the unit's start stalls the warp's in-order issue
// there, before the prologue's loads (measured −1.7% per-op at 1K, docs/perf-log.md v36). The monokernel
// keeps the late loads (its position is &iota[pos], no device word; v34: a change in its QKV stream's live
// state cost it 1.5% at 1K).
template <bool kEarlyPos>
struct HeMvQkvT {
  const float* x;
  const float* gamma;
  float eps;
  int in;
  const he_u16* W;
  const float* bias;
  const float* cos_t;
  const float* sin_t;
  const int* pos_p;
  float* q_out;
  he_kv* k_cache;
  he_kv* v_cache;
  int max_ctx, q_dim, kv_dim, hd, rope;
  const he_i64* x_fx;  // as HeMvPlain's
  HE_INLINE int units() const { return (q_dim + 2 * kv_dim) / 2; }
  HE_INLINE void rows(int u, const he_u16* (&rp)[2]) const {
    const int half = hd / 2, ra = (u / half) * hd + u % half;
    rp[0] = W + (he_i64)ra * in;
    rp[1] = W + (he_i64)(ra + half) * in;
  }
  HE_INLINE void pre(int, float (&pv)[2]) const {
    pv[0] = pv[1] = 0.f;
    if (kEarlyPos && rope && he_lane_id() == 0) pv[0] = he_u32_as_f32((he_u32)he_ld_step(pos_p));  // its bits
  }
  // Unit u's rows in the stacked matrix (ra, rb = ra + hd/2: a RoPE pair), its index i in the head's first half, and
  // its two values with the bias added.
  HE_INLINE void biased(int u, const float (&acc)[2], int& ra, int& rb, int& i, float& a, float& b) const {
    const int half = hd / 2;
    i = u % half;
    ra = (u / half) * hd + i;
    rb = ra + half;
    a = acc[0] + (bias ? bias[ra] : 0.f);
    b = acc[1] + (bias ? bias[rb] : 0.f);
  }
  // RoPE at `pos` for q and k rows (v rows pass through).
  HE_INLINE void rotate(int ra, int i, int pos, float& a, float& b) const {
    if (ra < q_dim + kv_dim) {  // q or k: rotate
      const int half = hd / 2;
      const float c = cos_t[(he_i64)pos * half + i], s = sin_t[(he_i64)pos * half + i];
      const float ra_v = a * c - b * s, rb_v = b * c + a * s;
      a = ra_v; b = rb_v;
    }
  }
  // A k or v pair into the cache at `pos`; returns the two values as the cache holds them.
  HE_INLINE void append(int ra, int i, int pos, float a, float b, he_kv& ka, he_kv& kb) const {
    const bool is_k = ra < q_dim + kv_dim;
    const int kvh = (ra - q_dim - (is_k ? 0 : kv_dim)) / hd;
    he_kv* dst = (is_k ? k_cache : v_cache) + ((he_i64)kvh * max_ctx + pos) * hd;
    ka = he_f32_to_kv(a);
    kb = he_f32_to_kv(b);
    dst[i] = ka;
    dst[i + hd / 2] = kb;
  }
  HE_INLINE void epi(int u, const float (&acc)[2], const float (&pv)[2]) const {
    if (he_lane_id() != 0) return;
    int ra, rb, i;
    float a, b;
    biased(u, acc, ra, rb, i, a, b);
    if (!rope) { q_out[ra] = a; q_out[rb] = b; return; }
    const int pos = kEarlyPos ? (int)he_f32_as_u32(pv[0]) : *pos_p;
    rotate(ra, i, pos, a, b);
    if (ra < q_dim) { q_out[ra] = a; q_out[rb] = b; return; }
    he_kv ka, kb;
    append(ra, i, pos, a, b, ka, kb);
  }
};

// The monokernel's. (v71, the position by value instead of &iota[pos]: level on H200, removed; docs/perf-log.md.)
using HeMvQkv = HeMvQkvT<false>;

HE_KERNEL(kMatvecMaxThreads) matvec_qkv(const he_u16* __restrict__ W, const float* x, const float* __restrict__ gamma, float eps,
                           const float* __restrict__ bias, const float* __restrict__ cos_t,
                           const float* __restrict__ sin_t, const int* pos_p, float* __restrict__ q_out,
                           he_kv* __restrict__ k_cache, he_kv* __restrict__ v_cache, int max_ctx, int q_dim,
                           int kv_dim, int hd, int in, int rope, int w_f16, const he_i64* x_fx) {
  extern __shared__ float he_xs[];
  __shared__ float scratch[kMaxWarpsPerBlock];
  const HeMvQkvT<true> op{x, gamma, eps, in, W, bias, cos_t, sin_t, pos_p, q_out, k_cache, v_cache,
                          max_ctx, q_dim, kv_dim, hd, rope, he_mv_fx_arg<HE_MV_X_FX != 0>(x_fx)};
  if (w_f16) he_matvec_run<true>(op, he_xs, scratch);
  else he_matvec_run<false>(op, he_xs, scratch);
}

#endif
