// The O-projection by KV-head group: y += Wo[:, group g's columns] · att_g, each group's share of every output
// row added into a 64-bit fixed-point accumulator (port.h he_fx_*: integer adds commute, so the eight groups'
// shares sum to the same bits in any order, on every run and on both paths).
//
// Why. The plain O-proj (matvec.hip HeMvPlain) needs every head of att, so the monokernel's attention must end
// in a chain before it: the last split block of each KV head combines its group, stores att, releases a
// heads-combined counter, and every block polls that counter and then stages att — two publications (partials,
// then att) and their round trips. Split by the columns of one KV head's group (G·hd of them: the heads that
// share K/V), the O-proj needs only that group's partials: the blocks of group g wait for its split counter,
// combine its G heads themselves (he_attention_combine, the same arithmetic as the per-op combine kernel) and
// multiply — one publication fewer on the attention → O-proj chain. The price: eight shares per output row,
// summed in fixed point. The fixed-point buffer holds the whole residual stream after the O-proj (group 0's tiles
// add x itself), so its two readers read it alone: the gate/up prologue (HeMvGateUpFx: x is not read) and the
// down-proj's residual rows (HeMvPlainFxRes), which write the completed rows into x and clear the buffer.
//
// Geometry (kCols = G·hd columns per group, kCols / 8 a power of two from 16 to the warp width). A lane's
// 16-byte load holds 8 weights of one row, kCols / 8 lanes cover a row's group columns, so one warp-wide load
// covers kRowsPerLoad = kWarpSize·8 / kCols rows; a warp keeps the weight stream's 4·kMatvecUnroll loads per lane
// (HeMvStream<2>'s registers: its whole 8 KiB on NVIDIA) for kLoads·kRowsPerLoad rows, and a block of kMkThreads
// threads covers kBlockRows = kLoads · kThreads · 8 / kCols rows (128 for Llama-3.2-1B's 256 columns, on both
// warp widths). A lane's 8 products of a row are one FMA chain (he_wfma8), the kCols / 8 lanes of the row are
// summed by a halving butterfly (the 16 rows' sums shuffled 16 + 8 + 4 + 2 times, then plain adds), so every
// row's sum is the same sequence of operations in the monokernel and in the per-op kernel.
#ifndef HE_OPS_MATVEC_GROUP_HIP
#define HE_OPS_MATVEC_GROUP_HIP
#include "port.h"
#include "ops/matvec.hip"

constexpr int kMvgLoads = 4 * kMatvecUnroll;  // a lane's loads: HeMvStream<2>'s a[2][U] and b[2][U]

template <int kCols>
struct HeMvgGeom {
  static constexpr int kLanesPerRow = kCols / 8;
  static_assert(kCols % 8 == 0 && kLanesPerRow >= 16 && kLanesPerRow <= kWarpSize &&
                    (kLanesPerRow & (kLanesPerRow - 1)) == 0,
                "the grouped O-proj needs G*hd / 8 columns' lanes, a power of two from 16 to the warp width");
  static constexpr int kRowsPerLoad = kWarpSize / kLanesPerRow;
  static constexpr int kWarpRows = kMvgLoads * kRowsPerLoad;
  static HE_INLINE int block_rows(int threads) { return kWarpRows * (threads / kWarpSize); }
};

// One warp's share: rows [row0, row0 + kWarpRows) of Wo (row-major [n_rows, in]), columns [g·kCols, (g+1)·kCols).
struct HeMvGroupO {
  const he_u16* W;
  int in;      // Wo's row length (nh·hd)
  int n_rows;  // Wo's rows (the hidden size)
  int g;       // the KV-head group
  int row0;    // this warp's first row
  he_i64* y_fx;  // [n_rows] the fixed-point accumulator the shares are added into
  const float* res;  // group 0's tiles: the residual x, added in fixed point with the share; else nullptr
};

// The row of load i for this lane.
template <int kCols>
HE_INLINE int he_mvg_row(const HeMvGroupO& op, int i) {
  using G = HeMvgGeom<kCols>;
  return op.row0 + i * G::kRowsPerLoad + he_lane_id() / G::kLanesPerRow;
}

template <int kCols>
HE_INLINE he_vec16 he_mvg_load(const HeMvGroupO& op, int i) {
  using G = HeMvgGeom<kCols>;
  const int r = he_mvg_row<kCols>(op, i);
  if (r >= op.n_rows) return he_vec16{0u, 0u, 0u, 0u};
  return he_load16_stream(op.W + (he_i64)r * op.in + op.g * kCols + (he_lane_id() % G::kLanesPerRow) * 8);
}

// The warp's weights into the stream's registers (weights only: issue it before waiting for att).
template <int kCols>
HE_INLINE void he_mvg_fill(const HeMvGroupO& op, HeMvStream<2>& s) {
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int k = 0; k < kMatvecUnroll; ++k) {
      s.a[r][k] = he_mvg_load<kCols>(op, r * kMatvecUnroll + k);
      s.b[r][k] = he_mvg_load<kCols>(op, 2 * kMatvecUnroll + r * kMatvecUnroll + k);
    }
}

// Halve the live sums over lane bit kOff: the lanes with the bit clear keep sums [0, kN/2) (adding their partner's
// copies), the others keep [kN/2, kN) renumbered from 0 — kN/2 shuffles.
template <int kN, int kOff>
HE_INLINE void he_mvg_halve(float (&v)[kMvgLoads]) {
  const bool hi = (he_lane_id() & kOff) != 0;
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) {
    const float keep = hi ? v[i + kN / 2] : v[i], send = hi ? v[i] : v[i + kN / 2];
    v[i] = keep + he_shfl_xor(send, kOff);
  }
}

// Which of the 16 loads' rows this lane holds after the four halvings (he_mvg_finish).
template <int kCols>
HE_INLINE int he_mvg_kept() {
  constexpr int L = HeMvgGeom<kCols>::kLanesPerRow;
  const int lane = he_lane_id();
  return ((lane & (L / 2)) ? 8 : 0) + ((lane & (L / 4)) ? 4 : 0) + ((lane & (L / 8)) ? 2 : 0) + ((lane & (L / 16)) ? 1 : 0);
}

// att: the group's kCols inputs (shared memory). Sums this warp's rows and adds each into op.y_fx.
template <bool kF16, int kCols>
HE_INLINE void he_mvg_finish(const HeMvGroupO& op, const HeMvStream<2>& s, const float* att) {
  using G = HeMvgGeom<kCols>;
  static_assert(kMvgLoads == 16, "the butterfly below is written for 16 sums per lane");
  constexpr int L = G::kLanesPerRow;
  // the row this lane ends with; lanes whose bits below L / 16 are clear hold distinct rows (the others, copies)
  const int r = he_mvg_row<kCols>(op, he_mvg_kept<kCols>());
  const bool writer = (he_lane_id() & (L / 16 - 1)) == 0 && r < op.n_rows;
  const float res = (op.res != nullptr && writer) ? op.res[r] : 0.f;  // requested before the sums
  float xv[8];
  const float* xa = att + (he_lane_id() % G::kLanesPerRow) * 8;
#pragma unroll
  for (int j = 0; j < 8; ++j) xv[j] = xa[j];
  float v[kMvgLoads];
#pragma unroll
  for (int q = 0; q < 2; ++q)
#pragma unroll
    for (int k = 0; k < kMatvecUnroll; ++k) {
      v[q * kMatvecUnroll + k] = he_wfma8<kF16>(s.a[q][k], xv, 0.f);
      v[2 * kMatvecUnroll + q * kMatvecUnroll + k] = he_wfma8<kF16>(s.b[q][k], xv, 0.f);
    }
  // kLanesPerRow lanes per row: log2 of it butterfly levels, the first four halving the 16 sums
  he_mvg_halve<16, L / 2>(v);
  he_mvg_halve<8, L / 4>(v);
  he_mvg_halve<4, L / 8>(v);
  he_mvg_halve<2, L / 16>(v);
  constexpr int kCopies = L / kMvgLoads;  // lanes that hold each row after the halvings: plain adds over them
#pragma unroll
  for (int o = kCopies / 2; o > 0; o >>= 1) v[0] += he_shfl_xor(v[0], o);
  if (writer)
    he_red_add_i64_relaxed_device(op.y_fx + r, he_fx_from_f32(v[0]) + (op.res != nullptr ? he_fx_from_f32(res) : 0));
}

// The readers of the fixed-point residual the grouped O-proj leaves (the whole of x + the O-proj's output):
// gate/up with x_fx as its prologue's only input (HeMvFxOnly: x is not read) ...
struct HeMvGateUpFx : HeMvGateUp {
  static constexpr bool kFxOnly = true;
};
// ... and the down-proj, whose residual rows are res_fx's (residual is not read): the epilogue writes y = the sum
// + that row, and clears it. Lane l loads row 2u + (l & 1)'s 64-bit word in pre() and keeps its raw bits in its two
// pv registers; lanes 0 and 1 finish one row each in the epilogue (the sums are in every lane after the butterfly),
// so nothing waits for the words before the epilogue. (Session 37's form converted them in lane 0's pre(): the
// conversion waited for the load, which returns behind the weights the warp asked for before the stage — the
// in-order law, docs/perf-log.md v25 — and the staging's loads of x waited behind it: down's work +0.35 µs per
// layer on H100. Same value, same bits; measured level in tok/s, session 39.)
struct HeMvPlainFxRes : HeMvPlain {
  HE_INLINE void pre(int u, float (&pv)[2]) const {
    // Every lane loads (one 16-byte request for the warp): a load under a branch leaves ptxas a merge with the
    // not-loaded value, and the register moves after that merge wait for the load — the stall this form removes.
    const int r1 = 2 * u + (he_lane_id() & 1), r = r1 < n_rows ? r1 : n_rows - 1;
    const he_i64 w = res_fx[r];
    constexpr int kWordBits = 8 * sizeof(he_u32);
    pv[0] = he_u32_as_f32((he_u32)w);
    pv[1] = he_u32_as_f32((he_u32)((he_u64)w >> kWordBits));
  }
  HE_INLINE void epi(int u, const float (&acc)[2], const float (&pv)[2]) const {
    const int l = he_lane_id(), r = 2 * u + l;
    if (l >= 2 || r >= n_rows) return;
    y[r] = (l == 0 ? acc[0] : acc[1]) + he_fx_to_f32(he_i64_of_words(he_f32_as_u32(pv[0]), he_f32_as_u32(pv[1])));
    res_fx[r] = 0;
  }
};

// ---- the per-op kernels (the monokernel runs the same bodies in its stages; decode.hip MK_O_GROUP) ------------
// Not in the monokernel's module: kernels beside its own change how NVVM compiles it (attention_decode.hip).
#ifndef HE_IN_MONOKERNEL
// One KV-head group's columns per block tile: G·hd, a build choice (hipengine/gpu/ops.py matvec_group_o).
#ifndef HE_MVG_COLS
#define HE_MVG_COLS 256
#endif
// y_fx += Wo[:, group g's columns] · att_g (+ x on group 0's tiles), in fixed point. Grid: one block per (group,
// tile of block_rows rows), block b = group b / tiles, tile b % tiles — the monokernel's first nkv·tiles blocks'
// shares, row for row and lane for lane, so each row's share is the same bits on both paths. The warp's weights are
// requested before the wait (weights only: no kernel writes them); att (the combine kernel's output) and x after it.
HE_KERNEL(kMatvecMaxThreads) matvec_group_o(const he_u16* __restrict__ W, const float* att, const float* x,
                                           he_i64* y_fx, int in, int n_rows, int w_f16) {
  using G = HeMvgGeom<HE_MVG_COLS>;
  __shared__ float atts[HE_MVG_COLS];
  he_pdl_trigger_top();
  const int rows = G::block_rows(he_block_dim()), tiles = n_rows / rows;
  const int g = he_block_idx() / tiles;
  const HeMvGroupO op{W, in, n_rows, g, (he_block_idx() % tiles) * rows + he_warp_id() * G::kWarpRows, y_fx,
                      g == 0 ? x : nullptr};
  HeMvStream<2> s;
  he_mvg_fill<HE_MVG_COLS>(op, s);
  he_pdl_wait();  // port.h: att, x and y_fx come from the kernels before
  he_pdl_trigger_late();
  for (int i = he_thread_idx(); i < HE_MVG_COLS; i += he_block_dim()) atts[i] = att[(he_i64)g * HE_MVG_COLS + i];
  he_sync_block();
  if (w_f16) he_mvg_finish<true, HE_MVG_COLS>(op, s, atts);
  else he_mvg_finish<false, HE_MVG_COLS>(op, s, atts);
}

// gate/up whose prologue input is x_fx alone (the grouped O-proj's residual): y = silu(Wg·x̂) * (Wu·x̂).
HE_KERNEL(kMatvecMaxThreads) matvec_gate_up_fx(const he_u16* __restrict__ Wg, const he_u16* __restrict__ Wu,
                                              const he_i64* x_fx, const float* __restrict__ gamma, float eps, float* y,
                                              int rows, int in, int w_f16) {
  extern __shared__ float he_xs[];
  __shared__ float scratch[kMaxWarpsPerBlock];
  const HeMvGateUpFx op{{nullptr, gamma, eps, in, Wg, Wu, y, rows, x_fx}};
  if (w_f16) he_matvec_run<true>(op, he_xs, scratch);
  else he_matvec_run<false>(op, he_xs, scratch);
}

// The down-projection whose residual rows are res_fx's: y = W·x + res_fx (then res_fx cleared, row by row).
HE_KERNEL(kMatvecMaxThreads) matvec_fx_res(const he_u16* __restrict__ W, const float* x, he_i64* res_fx, float* y,
                                          int rows, int in, int w_f16) {
  extern __shared__ float he_xs[];
  __shared__ float scratch[kMaxWarpsPerBlock];
  const HeMvPlainFxRes op{{x, nullptr, 0.f, in, W, nullptr, y, rows, nullptr, res_fx}};
  if (w_f16) he_matvec_run<true>(op, he_xs, scratch);
  else he_matvec_run<false>(op, he_xs, scratch);
}
#endif  // HE_IN_MONOKERNEL

#endif  // HE_OPS_MATVEC_GROUP_HIP
