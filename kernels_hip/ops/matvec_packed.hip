// Matrix-vector products over bf16 weights held losslessly in 13 bits each ("P13"): the same sums, bit for
// bit, as ops/matvec.hip's bf16 stream, from 13/16 of its bytes.
//
// Why it is exact. A bf16 weight is sign (1 bit), exponent E (8) and mantissa (7). The mantissa and the sign
// carry their full information; the exponent does not: a trained (or randomly initialised) matrix uses a few
// dozen of its 256 values. So the host (hipengine/gpu/packed.py) picks for a matrix group an offset D and keeps
// each weight as w' = w · 2^-D with E' = E − D in [64, 95]: E'7..E'5 are then always 010 and only E'4..E'0 are
// stored. The step stages x · 2^D instead of x (rmsnorm.hip's kPost; a power of two, so exact while
// |x| < 2^(127 − D): D ≈ 25-35 for weights of |w| < 1, i.e. activations below ~2^90), and every product is
// the same real number, w' · (x · 2^D) = w · x: each fused multiply-add of the bf16 stream's chains rounds the
// same value, so every partial sum, warp sum and output has the bf16 stream's bits.
// Weights whose exponent falls outside the 32-exponent window (|w| < 2^(E_max − 31 − 127), zeros, subnormals,
// inf / nan: for N(0, σ) weights ~1e-9 of them) cannot be stored; the host marks the units that hold any in a
// bitmap, and a warp that meets one (op.pesc at the unit's start, tested at its end) recomputes that unit's
// sums from the bf16 rows with the stream's own arithmetic (pfix: the same loads, chains and warp sum, on
// x = (x · 2^D) · 2^-D, exact), so the rare unit costs one more dependent row read and nothing is lost.
//
// Layout for a warp of W lanes (W = kWarpSize: the host packs for the device's warp), batch B = 32·W columns
// (kMatvecBatch at unroll 4): row r of a [rows, in] matrix (in % B == 0) is in·13/8 bytes at r·in·13/8, and
// its batch b (columns [bB, bB + B)) 52·W bytes at 52·W·b within it. Lane l holds the 32 weights the bf16
// stream gives it, t = 8k + j (sweep k = 0..3, j = 0..7) at column bB + 8W·k + 8l + j, as
//   [0, 16W)     L-plane A, 16 bytes at 16l: the low bytes (E'0 and the mantissa) of t = 0..15
//   [16W, 32W)   L-plane B, 16 bytes at 16W + 16l: those of t = 16..31
//   [32W, 48W)   K-plane, 16 bytes at 32W + 16l: word k = E'4..E'1 of sweep k's weights, weight j at nibble 2j
//                (j < 4) or 2(j − 4) + 1 (j ≥ 4)
//   [48W, 52W)   S-plane, 4 bytes at 48W + 4l: the sign of t at bit 15 − t/2 + 16·(t % 2)
// so a lane's part of a batch row is three 16-byte loads and one 4-byte load (52 bytes against the bf16
// stream's 64), and sweep k's bf16 pairs come back in four byte permutes: pair (2i, 2i + 1) of the sweep is
//   he_prmt(L word, K word with 010 set above each nibble, 0x5140 / 0x7362) | ((S << (4k + i)) & 0x80008000),
// the bf16 word of w'_{2i+1} : w'_{2i} — then he_wfma8, the bf16 stream's own chain.
#ifndef HE_OPS_MATVEC_PACKED_HIP
#define HE_OPS_MATVEC_PACKED_HIP
#include "port.h"
#include "ops/matvec.hip"

static_assert(kMatvecUnroll == 4, "the packed layout is one batch of four sweeps per lane (HE_MATVEC_UNROLL=4)");
constexpr int kPackedBatchBytes = 52 * kWarpSize;  // one row's batch: 32 weights per lane × 13 bits

// A packed row's bytes (in % kMatvecBatch == 0).
HE_INLINE he_i64 he_packed_row_bytes(int in) { return (he_i64)in / 8 * 13; }

// Sweep k of one row's batch (w: the row's four registers of the stream, as he_mvp_load filled them) as the
// bf16 stream's he_vec16 of that sweep: the same eight weights, scaled by 2^-D.
HE_INLINE he_vec16 he_mvp_sweep(const he_vec16 (&w)[kMatvecUnroll], int k) {
  const he_vec16 L = w[k >> 1];
  const he_u32 l0 = (k & 1) ? L.z : L.x, l1 = (k & 1) ? L.w : L.y;
  const he_u32 K = k == 0 ? w[2].x : k == 1 ? w[2].y : k == 2 ? w[2].z : w[2].w;
  const he_u32 S = w[3].x << (4 * k);
  const he_u32 ke = (K & 0x0f0f0f0fu) | 0x20202020u, ko = ((K >> 4) & 0x0f0f0f0fu) | 0x20202020u;
  he_vec16 q;
  q.x = he_prmt(l0, ke, 0x5140u) | (S & 0x80008000u);
  q.y = he_prmt(l0, ke, 0x7362u) | ((S << 1) & 0x80008000u);
  q.z = he_prmt(l1, ko, 0x5140u) | ((S << 2) & 0x80008000u);
  q.w = he_prmt(l1, ko, 0x7362u) | ((S << 3) & 0x80008000u);
  return q;
}

// What every packed op adds to its bf16 op: the packed rows' base, the units bitmap, the offset 2^D and 2^-D.
struct HeMvPackedPart {
  const he_u8* Wp;     // packed rows, in the bf16 op's row order
  const he_u32* esc;   // [ceil(units / 32)]: bit u set = unit u holds a weight outside the window
  float post, unpost;  // 2^D, 2^-D
};

// The packed op's stream hooks over a bf16 op Base (its units, rows, pre and epi), with prow(u, pp): the
// packed rows of unit u. Used by he_mv_load / he_mv_finish (ops/matvec.hip) when Op::kPacked.
template <class Base, class Self>
struct HeMvPackedOps {
  static constexpr bool kPacked = true;

  HE_INLINE const Base& base() const { return *static_cast<const Self*>(this); }
  HE_INLINE const HeMvPackedPart& part() const { return static_cast<const Self*>(this)->pk; }

  template <int kRows>
  HE_INLINE void pload(int u, int c0, he_vec16 (&w)[kRows][kMatvecUnroll]) const {
    if (!kMvWholePairs && c0 >= base().in) {  // the pair's second batch of an odd batch count
      he_mv_zero(w);
      return;
    }
    const he_u8* pp[kRows];
    static_cast<const Self*>(this)->prow(u, pp);
    const int lane = he_lane_id();
    const he_i64 off = (he_i64)(c0 / kMatvecBatch) * kPackedBatchBytes;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const he_u8* b = pp[r] + off;
      w[r][0] = he_load16_stream(b + 16 * lane);
      w[r][1] = he_load16_stream(b + 16 * kWarpSize + 16 * lane);
      w[r][2] = he_load16_stream(b + 2 * 16 * kWarpSize + 16 * lane);
      w[r][3].x = he_load4_stream(b + 48 * kWarpSize + 4 * lane);
    }
  }

  // he_mv_consume's whole-batch loop on the decoded sweeps: the same chains in the same order.
  template <int kRows>
  HE_INLINE void pconsume(const he_vec16 (&w)[kRows][kMatvecUnroll], int c0, const float* xs,
                          float (&acc)[kRows][2]) const {
    if (!kMvWholePairs && c0 >= base().in) return;
    const int lane = he_lane_id();
#pragma unroll
    for (int k = 0; k < kMatvecUnroll; ++k)
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        acc[r][k & 1] = he_wfma8<false>(he_mvp_sweep(w[r], k), xs + c0 + k * kMatvecSweep + lane * 8, acc[r][k & 1]);
  }

  // Unit u holds a weight the packed form cannot (the host's bitmap). Every lane loads the word (one request).
  HE_INLINE bool pesc(int u) const { return (part().esc[u >> 5] >> (u & 31)) & 1u; }

  // Unit u's sums from its bf16 rows, exactly as the bf16 stream computes them (he_matvec_load's loads,
  // he_mv_consume's chains over batches in column order, the warp sum) on x = xs · 2^-D.
  template <int kRows>
  HE_INLINE void pfix(int u, const float* xs, float (&sum)[kRows]) const {
    const he_u16* rp[kRows];
    base().rows(u, rp);
    const int lane = he_lane_id(), in = base().in;
    const float unpost = part().unpost;
    float acc[kRows][2];
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = 0.f;
    for (int c0 = 0; c0 < in; c0 += kMatvecBatch) {
      he_vec16 w[kRows][kMatvecUnroll];
      he_matvec_load<kRows>(rp, in, c0, w);
#pragma unroll
      for (int k = 0; k < kMatvecUnroll; ++k) {
        const float* xp = xs + c0 + k * kMatvecSweep + lane * 8;
        float xl[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) xl[j] = xp[j] * unpost;
#pragma unroll
        for (int r = 0; r < kRows; ++r) acc[r][k & 1] = he_wfma8<false>(w[r][k], xl, acc[r][k & 1]);
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) sum[r] = he_warp_sum(acc[r][0] + acc[r][1]);
  }
};

// y = W·x (+ residual) over packed rows: HeMvPlain's units (two rows), pre and epi.
struct HeMvPlainP : HeMvPlain, HeMvPackedOps<HeMvPlain, HeMvPlainP> {
  HeMvPackedPart pk;
  HE_INLINE void prow(int u, const he_u8* (&pp)[2]) const {
    const int r0 = 2 * u, r1 = r0 + 1 < n_rows ? r0 + 1 : r0;
    pp[0] = pk.Wp + r0 * he_packed_row_bytes(in);
    pp[1] = pk.Wp + r1 * he_packed_row_bytes(in);
  }
};

// y = silu(Wg·x) * (Wu·x) over packed rows (gate and up share D: they share the staged x).
struct HeMvGateUpP : HeMvGateUp, HeMvPackedOps<HeMvGateUp, HeMvGateUpP> {
  HeMvPackedPart pk;  // Wp: the packed gate rows
  const he_u8* Wup;   // the packed up rows
  HE_INLINE void prow(int u, const he_u8* (&pp)[2]) const {
    pp[0] = pk.Wp + u * he_packed_row_bytes(in);
    pp[1] = Wup + u * he_packed_row_bytes(in);
  }
};

HE_INLINE HeMvPlainP he_mvp_plain(const HeMvPlain& b, const he_u8* Wp, const he_u32* esc, float post, float unpost) {
  HeMvPlainP op;
  static_cast<HeMvPlain&>(op) = b;
  op.pk = HeMvPackedPart{Wp, esc, post, unpost};
  return op;
}
HE_INLINE HeMvGateUpP he_mvp_gate_up(const HeMvGateUp& b, const he_u8* Wgp, const he_u8* Wup, const he_u32* esc,
                                     float post, float unpost) {
  HeMvGateUpP op;
  static_cast<HeMvGateUp&>(op) = b;
  op.pk = HeMvPackedPart{Wgp, esc, post, unpost};
  op.Wup = Wup;
  return op;
}

// The per-op kernels (the op tests; not in the monokernel's module): matvec / matvec_gate_up over packed rows,
// with the bf16 rows for the rare units (W, Wg, Wu) as well.
#ifndef HE_IN_MONOKERNEL
HE_KERNEL(kMatvecMaxThreads) matvec_packed(const he_u8* __restrict__ Wp, const he_u32* __restrict__ esc,
                                           const he_u16* __restrict__ W, float post, float unpost, const float* x,
                                           const float* __restrict__ gamma, float eps, const float* residual,
                                           float* y, int rows, int in) {
  extern __shared__ float he_xs[];
  __shared__ float scratch[kMaxWarpsPerBlock];
  const HeMvPlain b{x, gamma, eps, in, W, residual, y, rows, nullptr, nullptr};
  he_matvec_run<false>(he_mvp_plain(b, Wp, esc, post, unpost), he_xs, scratch);
}

HE_KERNEL(kMatvecMaxThreads) matvec_gate_up_packed(const he_u8* __restrict__ Wgp, const he_u8* __restrict__ Wup,
                                                   const he_u32* __restrict__ esc, const he_u16* __restrict__ Wg,
                                                   const he_u16* __restrict__ Wu, float post, float unpost,
                                                   const float* x, const float* __restrict__ gamma, float eps,
                                                   float* y, int rows, int in) {
  extern __shared__ float he_xs[];
  __shared__ float scratch[kMaxWarpsPerBlock];
  const HeMvGateUp b{x, gamma, eps, in, Wg, Wu, y, rows, nullptr};
  he_matvec_run<false>(he_mvp_gate_up(b, Wgp, Wup, esc, post, unpost), he_xs, scratch);
}
#endif

#endif
