// Prefill: the multi-token path. Y[M, rows] = X[M, in] · Wᵀ for a chunk of M prompt tokens, reading each
// weight once per chunk (decoding the prompt token by token would read it M times). The attention of a
// chunk is attention_prefill.hip on the matrix cores (else attention_split with grid.y = M: query t sees
// positions ≤ *pos + t), and RoPE + KV append reuse qk_norm_rope with grid.y = M; the projections:
//   matmul_mma_m{16,32,64,128}  the matrix cores (port.h he_mma), chunks of up to 128 tokens — the default;
//   matmul_small_m          plain FMAs, up to 8 tokens per launch — GPUs without matrix cores, and the
//                           comparison path (HIPENGINE_PREFILL_MMA=0).
#ifndef HE_OPS_PREFILL_HIP
#define HE_OPS_PREFILL_HIP
#include "port.h"
#include "ops/matvec.hip"
#include "sync.h"

// Each weight row is loaded once and multiplied with all M token vectors, so a chunk of M prompt tokens
// costs one pass over the weights (the decode path would cost M). X is read through L1/L2 (M·in·4 bytes,
// far smaller than W). Rows of X past M are clamped to row M-1 and their results dropped, so one
// instantiation serves every M ≤ kMaxM.
// mode: 0  Y = XWᵀ (+ bias)           1  Y += XWᵀ (residual add, in place)
//       2  Y = silu(X Wgᵀ) * (X Wuᵀ)  (W2 = Wu)
constexpr int kMaxM = 8;

template <bool kF16>
HE_INLINE void he_matmul_small_m_body(const he_u16* __restrict__ W, const he_u16* __restrict__ W2,
                                      const float* __restrict__ X, const float* __restrict__ bias, float* Y,
                                      int M, int rows, int in, int mode) {
  constexpr int kSweep = kWarpSize * 8;
  const int lane = he_lane_id();
  const int nw = (mode == 2) ? 2 : 1;
  for (int r = he_block_idx() * he_num_warps() + he_warp_id(); r < rows; r += he_grid_dim() * he_num_warps()) {
    float acc[2][kMaxM];
#pragma unroll
    for (int m = 0; m < kMaxM; ++m) { acc[0][m] = 0.f; acc[1][m] = 0.f; }
    for (int c = lane * 8; c < in; c += kSweep) {
      he_vec16 w[2];
      w[0] = he_load16_stream(W + (he_i64)r * in + c);
      w[1] = (nw == 2) ? he_load16_stream(W2 + (he_i64)r * in + c) : w[0];
#pragma unroll
      for (int m = 0; m < kMaxM; ++m) {
        const float* xr = X + (he_i64)(m < M ? m : M - 1) * in + c;
        const he_vec16 a = he_load16(xr), b = he_load16(xr + 4);
        const float xv[8] = {he_u32_as_f32(a.x), he_u32_as_f32(a.y), he_u32_as_f32(a.z), he_u32_as_f32(a.w),
                             he_u32_as_f32(b.x), he_u32_as_f32(b.y), he_u32_as_f32(b.z), he_u32_as_f32(b.w)};
        acc[0][m] += he_wdot8<kF16>(w[0], xv);
        if (nw == 2) acc[1][m] += he_wdot8<kF16>(w[1], xv);
      }
    }
#pragma unroll
    for (int m = 0; m < kMaxM; ++m) {
      const float s0 = he_warp_sum(acc[0][m]);
      const float s1 = (nw == 2) ? he_warp_sum(acc[1][m]) : 0.f;
      if (lane == 0 && m < M) {
        float* dst = Y + (he_i64)m * rows + r;
        if (mode == 0) *dst = s0 + (bias ? bias[r] : 0.f);
        else if (mode == 1) *dst += s0;
        else *dst = he_silu(s0) * s1;
      }
    }
  }
}

HE_KERNEL(kMatvecMaxThreads) matmul_small_m(const he_u16* __restrict__ W, const he_u16* __restrict__ W2,
                               const float* X, const float* __restrict__ bias, float* Y, int M, int rows,
                               int in, int mode, int w_f16) {
  he_pdl_trigger();
  he_pdl_wait();  // port.h: everything below reads or writes step data
  if (w_f16) he_matmul_small_m_body<true>(W, W2, X, bias, Y, M, rows, in, mode);
  else he_matmul_small_m_body<false>(W, W2, X, bias, Y, M, rows, in, mode);
}

// ---- the matrix-core form ------------------------------------------------------------------------------
// A block of kPfWarps warps owns kPfBN = 16·kPfWarps "virtual" weight rows — rows n0 .. n0+kPfBN-1 of W
// (modes 0, 1), or kPfBN/2 rows of Wg followed by the same rows of Wu (mode 2, so SiLU·mul finds both halves
// in the block) — and 16·kMT token rows of the chunk (kMT ≤ 8: up to 128 tokens; see token tiles below). The
// warps form kMG token groups × kNG weight groups (HePfWarpMap): a warp takes kTM token tiles against kTN of
// the block's 16-row weight tiles, so each A fragment is built once per warp and k-step. K advances kPfBK columns per
// step through a ring of kPfStages shared-memory stages filled by asynchronous copies (port.h
// he_cp_async16: no registers, kPfStages − 1 steps in flight while the matrix cores work on one); the
// weights of the first steps are requested before the wait for the previous kernel. The build (warps,
// stages) is the host's choice (ops.mma_build): 8 warps read X once per 128 weight rows instead of 64 and
// keep twice the warps per SM, where a weight has enough 128-row tiles to fill half the GPU.
// X stays fp32 where it matters: staged as fp32, each A fragment is taken as two 16-bit halves, hi = round(x)
// and lo = round(x − hi) (he_mma_load_a_split), and every tile takes both products (W·hi + W·lo), so the
// activations keep ~16 (bf16) / ~22 (fp16) bits of mantissa instead of 8 / 11 — prefill stays as close to
// the fp32 reference as the FMA path (the weights are exact either way) for twice the matrix work, which
// these chunk sizes leave idle anyway. (fp16 weights: |x| must stay below 65504, as in any fp16 model.)
// Token tiles (grid.z = Z > 1): block z takes tokens [z·16·kMT, (z+1)·16·kMT) of the chunk, so a weight with
// few row tiles fills the GPU with Z·tiles blocks and fewer K splits (each split costs a partial tile's round
// trip through `part` and the last arriver's sum); the weight tile is then read Z times, from L2.
// Split K (grid.y = S > 1, for weights with too few (row, token) tiles to fill the GPU): split s sums columns
// [s·kchunk, (s+1)·kchunk) into its slice of `part`, and the last of a tile's S blocks to arrive (sync.h
// he_arrive_last; count: one zeroed word per (row, token) tile, left zero) adds the S slices in split order —
// the result does not depend on which block finishes last — and applies the epilogue:
//   mode 0: Y = X Wᵀ (+ bias)   1: Y += X Wᵀ   2: Y = silu(X Wgᵀ) * (X Wuᵀ)   (Y [M, rows], row stride rows).
#ifndef HE_PF_WARPS
#define HE_PF_WARPS 4
#endif
constexpr int kPfWarps = HE_PF_WARPS;  // 4 or 8
constexpr int kPfThreads = kPfWarps * kWarpSize;
constexpr int kPfBN = 16 * kPfWarps;  // virtual weight rows per block
constexpr int kPfBK = 32;             // columns per k-step
static_assert(kPfWarps == 4 || kPfWarps == 8, "HE_PF_WARPS: 4 or 8");
// The shared-memory ring: kPfStages − 1 k-steps in flight. The host picks it (ops.mma_build): as many as fit
// two blocks per SM (at most 6) on NVIDIA, as fit gfx942's 64 KiB of LDS there.
#ifndef HE_PF_STAGES
#define HE_PF_STAGES 4
#endif
constexpr int kPfStages = HE_PF_STAGES;
// HE_PF_XSPLIT (ops.prefill_split): 1 takes both halves of X (hi/lo, above); 0 only hi = round(x), X at the
// weights' 16-bit precision as in a bf16 / fp16 framework — half the matrix instructions.
#ifndef HE_PF_XSPLIT
#define HE_PF_XSPLIT 1
#endif
constexpr bool kPfXSplit = HE_PF_XSPLIT != 0;
static_assert(kPfStages >= 2, "HE_PF_STAGES: at least two stages");
constexpr int kPfWld = kPfBK + 8;     // staged weight row, 16-bit elements: 80 B, conflict-free B fragments
constexpr int kPfXld = kPfBK + 8;     // staged X row, floats: 160 B, conflict-free split A fragments
constexpr int kPfCld = kPfBN + 4;     // the epilogue's fp32 result tile stride

// Shared memory of one block: the stage ring during the k-loop, the fp32 result tile after it (dynamic
// shared memory; 4 warps, kPfBK = 32, kMT = 4: 15 KiB per stage, so 60 KiB with 4 stages, within gfx942's
// 64 KiB of LDS).
// The warps of a block over its [16·kMT tokens] × [kPfBN weight rows] tile: kMG token groups × kNG weight
// groups; warp w takes token tiles w % kMG + i·kMG (i < kTM) and weight tiles w / kMG + j·kNG (j < kTN).
template <int kMT>
struct HePfWarpMap {
  static constexpr int kTM = kMT > kPfWarps ? kMT / kPfWarps : 1;
  static constexpr int kMG = kMT / kTM, kNG = kPfWarps / kMG, kTN = kPfWarps / kNG;
  static_assert(kMG * kTM == kMT && kMG * kNG == kPfWarps, "warps over the tile");
};

template <int kMT>
struct HePfSmem {
  static constexpr int kW = kPfBN * kPfWld * 2;     // one stage's weight tile
  static constexpr int kX = 16 * kMT * kPfXld * 4;  // one stage's X tile
  static constexpr int kStage = kW + kX;
  static constexpr int kTile = 16 * kMT * kPfCld * 4;
  static constexpr int kBytes = kPfStages * kStage > kTile ? kPfStages * kStage : kTile;
};

template <bool kF16, int kMT>
HE_INLINE void he_matmul_mma_body(const he_u16* __restrict__ W, const he_u16* __restrict__ W2, const float* X,
                                  const float* bias, float* Y, int M, int rows, int in, int mode, int kchunk,
                                  int rotate, float* part, he_u32* count, char* smem) {
  using Sm = HePfSmem<kMT>;
  constexpr int kBM = 16 * kMT;
  constexpr int kWVec = kPfBN * kPfBK / 8;  // 16-byte copies per stage: weights
  constexpr int kXVec = kBM * kPfBK / 4;    // and X
  constexpr int kWPer = (kWVec + kPfThreads - 1) / kPfThreads, kXPer = (kXVec + kPfThreads - 1) / kPfThreads;
  const int tid = he_thread_idx(), nt = he_block_idx(), split = he_block_idx_y(), S = he_grid_dim_y();
  // This block's token tile: rows [m0, m0 + M) of X and Y (the host launches ceil(M / kBM) of them).
  const int m0 = he_block_idx_z() * kBM;
  M = (M - m0 < kBM) ? M - m0 : kBM;
  X += (he_i64)m0 * in;
  Y += (he_i64)m0 * rows;
  // The (row, token) tile's index among tiles·Z, for part and count (read again where used: fewer live registers).
  auto tile_id = [&]() { return he_block_idx_z() * he_grid_dim() + nt; };
  const int kbeg = split * kchunk, kend = (kbeg + kchunk < in) ? kbeg + kchunk : in;
  const int nsteps = (kend - kbeg + kPfBK - 1) / kPfBK;
  // rotate: tile t starts its k-loop at step t % nsteps and wraps around, so the blocks in flight read
  // different columns of X at a time instead of all the same ones (a fixed order per tile: deterministic).
  const int rot = (rotate && nsteps > 0) ? tile_id() % nsteps : 0;
  const int half = kPfBN / 2;

  // This thread's copies of a stage: source rows (always a mapped address: row 0 where the row is past the
  // weight / the chunk, which wok / xok then mark), columns inside the step, offsets inside the stage (−1: no
  // such copy). Copies go to the ring through its shared address, taken once (port.h he_smem).
  const HeSmem ring = he_smem(smem);
  const he_u16* wp[kWPer];
  int wc[kWPer], ws[kWPer];
  bool wok[kWPer];
#pragma unroll
  for (int i = 0; i < kWPer; ++i) {
    const int idx = tid + i * kPfThreads, vr = idx / (kPfBK / 8);
    wc[i] = (idx % (kPfBK / 8)) * 8;
    ws[i] = (idx < kWVec) ? vr * kPfWld * 2 + wc[i] * 2 : -1;
    const int n = (mode == 2) ? nt * half + (vr % half) : nt * kPfBN + vr;
    const he_u16* base = (mode == 2 && vr >= half) ? W2 : W;
    wok[i] = idx < kWVec && n < rows;
    wp[i] = base + (wok[i] ? (he_i64)n * in : 0) + wc[i];
  }
  const float* xp[kXPer];
  int xc[kXPer], xs[kXPer];
  bool xok[kXPer];
#pragma unroll
  for (int i = 0; i < kXPer; ++i) {
    const int idx = tid + i * kPfThreads, m = idx / (kPfBK / 4);
    xc[i] = (idx % (kPfBK / 4)) * 4;
    xs[i] = (idx < kXVec) ? Sm::kW + m * kPfXld * 4 + xc[i] * 4 : -1;
    xok[i] = idx < kXVec && m < M;
    xp[i] = X + (xok[i] ? (he_i64)m * in : 0) + xc[i];
  }
  // The copies of the step in stage `stage` whose columns start at k0. in % 8 == 0 and kchunk % kPfBK == 0: a
  // 16-byte copy is wholly inside [kbeg, kend) or wholly outside; only a split's last columns can be short.
  auto copy_w = [&](int stage, int k0) {
    const bool whole = k0 + kPfBK <= kend;
#pragma unroll
    for (int i = 0; i < kWPer; ++i)
      if (ws[i] >= 0) {
        const bool ok = wok[i] && (whole || k0 + wc[i] < kend);
        he_cp_async16_at(ring, stage * Sm::kStage + ws[i], wp[i] + (ok ? k0 : 0), ok);
      }
  };
  auto copy_x = [&](int stage, int k0) {
    const bool whole = k0 + kPfBK <= kend;
#pragma unroll
    for (int i = 0; i < kXPer; ++i)
      if (xs[i] >= 0) {
        const bool ok = xok[i] && (whole || k0 + xc[i] < kend);
        he_cp_async16_at(ring, stage * Sm::kStage + xs[i], xp[i] + (ok ? k0 : 0), ok);
      }
  };
  // The columns of step s: kbeg + ((s + rot) % nsteps)·kPfBK (the k-loop below steps them without dividing).
  auto step_k0 = [&](int s) { return kbeg + ((s + rot) % nsteps) * kPfBK; };

  using Map = HePfWarpMap<kMT>;
  constexpr int kTM = Map::kTM, kTN = Map::kTN, kMG = Map::kMG, kNG = Map::kNG;
  HeMmaAcc acc[kTM][kTN];
#pragma unroll
  for (int i = 0; i < kTM; ++i)
#pragma unroll
    for (int j = 0; j < kTN; ++j) he_mma_zero(acc[i][j]);
  // The ring's first kPfStages - 1 steps: weights before the wait (they never depend on the previous kernel),
  // X after it; one copy group per step (group 0 also holds the early weights of steps 1 ..).
  for (int s = 0; s < kPfStages - 1; ++s)
    if (s < nsteps) copy_w(s, step_k0(s));
  he_pdl_wait();  // port.h: X, Y, part and count are step data
  for (int s = 0; s < kPfStages - 1; ++s) {
    if (s < nsteps) copy_x(s, step_k0(s));
    he_cp_async_commit();
  }
  const int warp = he_warp_id(), mg = warp % kMG, ng = warp / kMG;
  // The next step to request (step + kPfStages − 1): its stage and its column step, advanced with wrap-around.
  int nstage = kPfStages - 1, ncol = nsteps > 0 ? (kPfStages - 1 + rot) % nsteps : 0;
  for (int step = 0, stage = 0; step < nsteps; ++step) {
    he_cp_async_wait<kPfStages - 2>();  // this thread's copies of `step` have landed ...
    he_sync_block();                    // ... and everyone's; everyone is done with step - 1's stage
    if (step + kPfStages - 1 < nsteps) {  // into the stage step - 1 used
      copy_w(nstage, kbeg + ncol * kPfBK);
      copy_x(nstage, kbeg + ncol * kPfBK);
      nstage = (nstage + 1 == kPfStages) ? 0 : nstage + 1;
      ncol = (ncol + 1 == nsteps) ? 0 : ncol + 1;
    }
    he_cp_async_commit();
    const char* st = smem + stage * Sm::kStage;
    stage = (stage + 1 == kPfStages) ? 0 : stage + 1;
    const he_u16* Ws = (const he_u16*)st;
    const float* Xs = (const float*)(st + Sm::kW);
#pragma unroll
    for (int kk = 0; kk < kPfBK; kk += 16) {
      HeMmaFrag hi[kTM], lo[kTM];
#pragma unroll
      for (int i = 0; i < kTM; ++i)
        he_mma_load_a_split<kF16>(Xs + (mg + i * kMG) * 16 * kPfXld + kk, kPfXld, hi[i], lo[i]);
#pragma unroll
      for (int j = 0; j < kTN; ++j) {
        const HeMmaFrag b = he_mma_load_b(Ws + (ng + j * kNG) * 16 * kPfWld + kk, kPfWld);
#pragma unroll
        for (int i = 0; i < kTM; ++i) {
          he_mma<kF16>(acc[i][j], hi[i], b);
          if constexpr (kPfXSplit) he_mma<kF16>(acc[i][j], lo[i], b);  // else lo is dead code
        }
      }
    }
  }
  he_cp_async_wait<0>();
  he_sync_block();  // the ring is free: the result tile reuses it

  // The block's [kBM, kPfBN] result tile, fp32, in shared memory.
  float* C = (float*)smem;
#pragma unroll
  for (int i = 0; i < kTM; ++i)
#pragma unroll
    for (int j = 0; j < kTN; ++j)
#pragma unroll
      for (int r = 0; r < kMmaAcc; ++r)
        C[((mg + i * kMG) * 16 + he_mma_acc_m(r)) * kPfCld + (ng + j * kNG) * 16 + he_mma_acc_n(r)] = acc[i][j].v[r];
  he_sync_block();
  if (S > 1) {
    // 16-byte vectors: each thread stores kV of them, and the last arriver loads kSB splits' kV at once
    // before adding them (ceil(S / kSB) dependent round trips of kSB·kV loads each: 32 vectors in flight
    // per thread with 4 warps, 16 with 8, within the registers of two blocks per SM).
    constexpr int kTile = kBM * kPfBN, kV = kTile / 4 / kPfThreads;
    static_assert(kTile % (4 * kPfThreads) == 0, "result tile in whole vectors per thread");
    constexpr int kSB = (kPfWarps == 4 ? 32 : 16) / kV;
    static_assert(kSB >= 1, "at least one split per round trip");
    const int tiles = he_grid_dim() * he_grid_dim_z(), tile = tile_id();
    he_vec16* mine = (he_vec16*)(part + ((he_i64)split * tiles + tile) * kTile);
#pragma unroll
    for (int v = 0; v < kV; ++v) {
      const int e = 4 * (tid + v * kPfThreads);
      mine[e / 4] = *(const he_vec16*)(C + (e / kPfBN) * kPfCld + e % kPfBN);
    }
    he_fence_acq_rel_device();  // release: this thread's slice stores, before the arrival (AMD: per thread)
    if (!he_arrive_last(count + tile, (he_u32)S)) return;
    he_fence_acq_rel_device();  // acquire: every split's slice
    const he_vec16* all = (const he_vec16*)(part + (he_i64)tile * kTile);  // split s at + s·tiles·kTile floats
    const he_i64 sstride = (he_i64)tiles * kTile / 4;
    float sum[kV][4];
#pragma unroll
    for (int v = 0; v < kV; ++v)
#pragma unroll
      for (int c = 0; c < 4; ++c) sum[v][c] = 0.f;
    for (int s0 = 0; s0 < S; s0 += kSB) {  // split order: the result does not depend on the arrival order
      he_vec16 cur[kSB][kV];
#pragma unroll
      for (int b = 0; b < kSB; ++b)
#pragma unroll
        for (int v = 0; v < kV; ++v)
          cur[b][v] = (s0 + b < S) ? all[(s0 + b) * sstride + tid + v * kPfThreads] : he_vec16{0u, 0u, 0u, 0u};
#pragma unroll
      for (int b = 0; b < kSB; ++b)
        if (s0 + b < S) {
#pragma unroll
          for (int v = 0; v < kV; ++v) {
            sum[v][0] += he_u32_as_f32(cur[b][v].x);
            sum[v][1] += he_u32_as_f32(cur[b][v].y);
            sum[v][2] += he_u32_as_f32(cur[b][v].z);
            sum[v][3] += he_u32_as_f32(cur[b][v].w);
          }
        }
    }
#pragma unroll
    for (int v = 0; v < kV; ++v) {
      const int e = 4 * (tid + v * kPfThreads);
#pragma unroll
      for (int c = 0; c < 4; ++c) C[(e / kPfBN) * kPfCld + e % kPfBN + c] = sum[v][c];
    }
    he_sync_block();
  }
  if (mode == 2) {
    for (int e = tid; e < M * half; e += kPfThreads) {
      const int m = e / half, j = e % half, n = nt * half + j;
      if (n < rows) Y[(he_i64)m * rows + n] = he_silu(C[m * kPfCld + j]) * C[m * kPfCld + half + j];
    }
    return;
  }
  // Y (mode 1) or the bias (mode 0) in batches of kEB loads per thread issued together: one round trip per
  // batch. (Loaded and stored one element at a time, every load waited for the store before it — Y may
  // alias the bias — 64 dependent round trips per thread at 128 tokens: most of O's and down's time.)
  constexpr int kEB = 16;
  for (int e0 = tid; e0 < M * kPfBN; e0 += kEB * kPfThreads) {
    float add[kEB];
#pragma unroll
    for (int b = 0; b < kEB; ++b) {
      const int e = e0 + b * kPfThreads, m = e / kPfBN, n = nt * kPfBN + e % kPfBN;
      add[b] = 0.f;
      if (e < M * kPfBN && n < rows) {
        if (mode == 1) add[b] = Y[(he_i64)m * rows + n];
        else if (bias) add[b] = bias[n];
      }
    }
#pragma unroll
    for (int b = 0; b < kEB; ++b) {
      const int e = e0 + b * kPfThreads, m = e / kPfBN, j = e % kPfBN, n = nt * kPfBN + j;
      if (e < M * kPfBN && n < rows) Y[(he_i64)m * rows + n] = C[m * kPfCld + j] + add[b];
    }
  }
}

// Launch: grid (tiles, S, Z), kPfThreads threads, HePfSmem<kMT>::kBytes of dynamic shared memory; tiles =
// ceil(rows / kPfBN) (mode 2: ceil(rows / (kPfBN / 2))); Z = ceil(M / (16·kMT)) token tiles; in % 8 == 0;
// kchunk a multiple of kPfBK with S·kchunk ≥ in and (S − 1)·kchunk < in; when S > 1, part:
// S·tiles·Z·16·kMT·kPfBN floats and count: tiles·Z zeroed words.
// Two blocks per SM (the ring is sized for it: ops.mma_build), so registers are capped to fit two.
#define HE_MATMUL_MMA_KERNEL(NAME, MT)                                                                        \
  HE_KERNEL_MIN(kPfThreads, 2)                                                                                \
      NAME(const he_u16* __restrict__ W, const he_u16* __restrict__ W2, const float* X, const float* bias,    \
           float* Y, int M, int rows, int in, int mode, int w_f16, int kchunk, int rotate, float* part,       \
           he_u32* count) {                                                                                   \
    extern __shared__ he_vec16 he_pf_smem[]; /* HePfSmem<MT>::kBytes (Ops.prefill_matmul), 16-byte aligned */ \
    char* smem = (char*)he_pf_smem;                                                                           \
    he_pdl_trigger();                                                                                         \
    if (w_f16)                                                                                                \
      he_matmul_mma_body<true, MT>(W, W2, X, bias, Y, M, rows, in, mode, kchunk, rotate, part, count, smem);  \
    else                                                                                                      \
      he_matmul_mma_body<false, MT>(W, W2, X, bias, Y, M, rows, in, mode, kchunk, rotate, part, count, smem); \
  }
HE_MATMUL_MMA_KERNEL(matmul_mma_m16, 1)  // M <= 16
HE_MATMUL_MMA_KERNEL(matmul_mma_m32, 2)  // M <= 32
HE_MATMUL_MMA_KERNEL(matmul_mma_m64, 4)  // M <= 64
HE_MATMUL_MMA_KERNEL(matmul_mma_m128, 8)  // M <= 128
#undef HE_MATMUL_MMA_KERNEL
#endif
