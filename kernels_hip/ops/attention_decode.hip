// Decode attention with grouped-query heads, split over the sequence ("flash-decoding"), plus the combine.
//
// Layouts
//   q        fp32 [T][num_heads·hd]          T query tokens (1 in decode; a prefill chunk otherwise)
//   caches   he_kv (bf16 or fp16, port.h) [num_kv_heads][max_ctx][hd] one layer; query t sees positions [0, *pos + t]
//   partial  fp32 [T][num_heads][nsplit][hd + 2]  unnormalised o, then (m, l) of that split
//   out      fp32 [T][num_heads·hd]
// Query head h reads kv head h / G (G = num_heads / num_kv_heads, HF's repeat_kv order).
//
// attention_split: grid = (num_kv_heads·nsplit, T); block handles `chunk` positions of one kv head for all
// G query heads of its group, so each K/V row is read from HBM once per step however large G is.
// Flash-decoding with an online softmax kept in registers: each warp owns a slice of the chunk; inside it
// each K/V row is read as 16-byte loads by a group of hd/8 lanes (kAttnUnroll rows of K and V in flight
// per group), the score is reduced with xor shuffles inside the group, and the group updates its running
// (max, sum, output) for every head of the KV group — the max is the warp's in the short-cache build
// (kAttnWarpMax), log2 units. The state of an online softmax (m, l, o) merges associatively, so lane groups
// (plain sums when they share m), then warps (shared memory, fixed order), then splits (attention_combine)
// are combined in a fixed order. No block-wide barrier inside the loop:
// the previous version (scores to shared memory, block reductions per head) spent ~15 µs per launch in
// barriers and dependent latency even at 1K context.
// Scores are in log2 units (q pre-scaled by log2(e)/sqrt(hd)) so the softmax uses exp2.
// Splits that start past the sequence end write l = 0 and are skipped by the combine, so the grid can be
// sized once for max_ctx (graph capture / monokernel) while *pos grows. The plan's `chunk` is the split
// length at max_ctx; while the sequence is shorter each split takes he_attn_chunk(seq) positions instead,
// so every split block has rows (a 1K sequence in a 4K cache: 16 splits of 64, not 4 of 256).
// Requirements: hd % 8 == 0, hd ≤ 8·kWarpSize, the module compiled with HE_ATTN_LPR = attn_lanes(hd),
// G ≤ kAttnMaxGroup; dynamic shared memory
// = (G·hd + warps·G·(hd + 2)) · 4 bytes.
#ifndef HE_OPS_ATTENTION_DECODE_HIP
#define HE_OPS_ATTENTION_DECODE_HIP
#include "port.h"
#include "sync.h"

// Sub-stage marks for the monokernel's stage profile (its MK_PROFILE build defines the hook); nothing here.
#ifndef HE_ATTN_MARK
#define HE_ATTN_MARK(k) ((void)0)
#endif
// The same, by the calling warp's lane 0 rather than the block's thread 0 (a mark only one warp reaches).
#ifndef HE_ATTN_MARK_WARP
#define HE_ATTN_MARK_WARP(k) ((void)0)
#endif

static_assert(HE_PDL_LATE <= 1, "the attention kernels trigger at their top or after their wait (port.h)");
constexpr int kAttnMaxGroup = 8;
constexpr int kAttnUnroll = 4;  // rows of K and of V loaded per lane group before use
// q slices in registers instead of shared memory (the monokernel's long-context build; see the split body).
#ifndef HE_ATTN_Q_REGS
#define HE_ATTN_Q_REGS 0
#endif

// Lanes per K/V row: hd/8 rounded up to a power of two, so the score's xor-shuffle reduction stays inside
// the lane group (lanes past the row's end, e.g. hd = 24 → 3 of 4 lanes busy, contribute zeros). A compile-
// time constant (-DHE_ATTN_LPR from the host: hipengine/gpu/ops.py attn_lanes(hd); 8 = hd 64 when not given)
// so that the shuffles and the merges unroll: with a run-time lane count the split loop spent ~2,000
// instructions per batch per warp and was bound by instruction issue, not by HBM (docs/perf-log.md v10b/v11).
#ifndef HE_ATTN_LPR
#define HE_ATTN_LPR 8
#endif
constexpr int kAttnLpr = HE_ATTN_LPR;
static_assert(kAttnLpr >= 1 && kAttnLpr <= kWarpSize && (kAttnLpr & (kAttnLpr - 1)) == 0,
              "HE_ATTN_LPR: a power of two up to the warp width");
// The head dimension, where the module is built for one (-DHE_ATTN_HD from the host: ops.attention_defines,
// the monokernel's compile_args; both build per head_dim anyway, for HE_ATTN_LPR): the index arithmetic over
// G·hd values (divisions by hd), the q staging and the merges' loops then fold to constants. 0: the run-time
// argument (generic builds: `hipengine kernels check`). A module built for one hd must only be launched with it.
#ifndef HE_ATTN_HD
#define HE_ATTN_HD 0
#endif
HE_INLINE int he_attn_hd(int hd) { return HE_ATTN_HD ? HE_ATTN_HD : hd; }
// Whose running max the online softmax keeps: 1 = the warp's (two xor-max shuffles per head per batch; the
// lane groups then merge by plain sums), 0 = each lane group's (no shuffle per batch; the groups merge with
// a rescale, he_softmax_merge). The warp's is shorter where a warp scores one batch (the merges dominate)
// and longer where it scores many (the shuffles sit in every batch's chain): per-op on H200 against the
// tree before (docs/perf-log.md v40), +3.3% / +0.4% / −3.3% at 1K / 8K / 32K with it, +2.1% / +1.4% / 0%
// with the lane group's.
// The host builds it for KV caches shorter than ops.ATTN_WARP_MAX_CTX (ops.attn_warp_max: both paths, so
// they stay bit-identical; the two builds' sums differ in order).
#ifndef HE_ATTN_WARP_MAX
#define HE_ATTN_WARP_MAX 1
#endif
[[maybe_unused]] constexpr bool kAttnWarpMax = HE_ATTN_WARP_MAX != 0;
// HE_ATTN_FRESH_COMBINE=1 (ops.attention_defines, HIPENGINE_ATTN_FRESH_COMBINE: both paths build alike, so they stay
// bit-identical): the splits leave out the newest row (seq − 1) and the combine adds it — its score for each head,
// then one more online-softmax merge (he_attention_combine_fresh). Decode writes that row in the same step, so the
// split holding it waited for the end of the QKV stage (the monokernel: QKV's second round of units) and ended the
// chain ≈ 1.2 µs after the other splits (H100, 1K, session 47's profile); the combine waits for the splits anyway.
#ifndef HE_ATTN_FRESH_COMBINE
#define HE_ATTN_FRESH_COMBINE 0
#endif
constexpr bool kAttnFreshCombine = HE_ATTN_FRESH_COMBINE != 0;

// Online-softmax state (m, l, o[8]) of a lane group for one head: merge (m2, l2, o2) into it.
HE_INLINE void he_softmax_merge(float& m, float& l, float (&o)[8], float m2, float l2, const float (&o2)[8]) {
  const float M = he_fmax(m, m2);
  // both empty (-inf): keep the empty state instead of computing 2^(-inf - -inf) = NaN
  const float a = (m == he_neg_inf()) ? 0.f : he_exp2(m - M), b = (m2 == he_neg_inf()) ? 0.f : he_exp2(m2 - M);
  l = l * a + l2 * b;
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j] = o[j] * a + o2[j] * b;
  m = M;
}

// The split length for a `seq`-row sequence: the smallest multiple of kAttnChunkAlign positions that covers
// it with nsplit splits, capped by the plan's chunk (nsplit · chunk >= max_ctx >= seq; the host rounds plans
// to the same multiple: ops.attention_plan). Both paths compute it the same way.
constexpr int kAttnChunkAlign = 32;
HE_INLINE int he_attn_chunk(int seq, int nsplit, int chunk) {
  const int c = ((seq + nsplit - 1) / nsplit + kAttnChunkAlign - 1) / kAttnChunkAlign * kAttnChunkAlign;
  return c < chunk ? c : chunk;
}

// Split partials the combine loads per round trip (he_attention_combine).
constexpr int kCombineBatch = 16;
// The split's block size in both paths (ops.ATTN_THREADS, the monokernel's kMkThreads) and the rows such a
// block scores in one batch (warps x rows per warp at once x kAttnUnroll: 128 at hd 64).
constexpr int kAttnThreads = 256;
constexpr int kAttnWarps = kAttnThreads / kWarpSize;
constexpr int kAttnBatchRows = kAttnThreads / kAttnLpr * kAttnUnroll;

// The splits a `seq`-row sequence uses: the plan's nsplit, or only the first kCombineBatch of them when the
// plan has more and that many splits of at most one batch of rows each cover the sequence — each split still
// takes one batch, and the combine folds one round trip of partials instead of several (a 1K sequence in a
// 4K cache at TP=2: 16 splits of 64 rows instead of 32 of 32). The other splits are empty. The split blocks
// and the combine compute it from the same seq, so both paths stay bit-identical.
HE_INLINE int he_attn_splits(int seq, int nsplit) {
  if (nsplit <= kCombineBatch) return nsplit;
  return he_attn_chunk(seq, kCombineBatch, kAttnBatchRows + 1) <= kAttnBatchRows ? kCombineBatch : nsplit;
}
// The split length for `seq` rows under the plan (nsplit, chunk): he_attn_chunk over the splits in use.
HE_INLINE int he_attn_len(int seq, int nsplit, int chunk) {
  const int ns = he_attn_splits(seq, nsplit);
  return ns < nsplit ? he_attn_chunk(seq, ns, kAttnBatchRows) : he_attn_chunk(seq, nsplit, chunk);
}

// Where a split body lets the next kernel launch (its kTrigger): before its wait, or — an early kernel in a
// HE_PDL_LATE build (port.h) — right after it.
template <bool kEarly, bool kTrigger>
struct HeAttnTrigger {
  static constexpr bool before = kTrigger && !(kEarly && HE_PDL_LATE == 1), after = kTrigger && !before;
};

// The wait a kEarly split body makes between its first K/V requests and everything that reads step data: by
// default the per-op kernel's he_pdl_wait (port.h; it cannot fail). The monokernel passes its QKV barrier's wait
// (decode.hip MkWaitQkv, MK_ATTN_EARLY), which returns false when the kernel must end; the bodies then return
// false at once, in every thread of the block (the wait's result is the block's).
// Every wait type also says where the split reads the step's q and its newest K/V row: HeAttnPlainQ's plain loads
// of q and the cache (both paths' default). kFlow (the monokernel's MK_QFLOW build, decode.hip MkFlowWait): q and
// the newest row come as LL words the split polls itself (q2, kv8), so no block barrier stands before the split.
struct HeAttnPlainQ {
  static constexpr bool kFlow = false;
  // q[i], q[i + 1]
  HE_INLINE void q2(const float* q, he_i64 i, float& a, float& b) const {
    a = q[i];
    b = q[i + 1];
  }
  // (a kFlow wait also has kv8(kvh, is_v, c): dims [c, c + 8) of KV head kvh's newest K or V row, as the cache
  // holds them)
};
struct HeAttnPdlWait : HeAttnPlainQ {
  HE_INLINE bool operator()() const {
    he_pdl_wait();
    return true;
  }
};

// The rows [start, start + n) a split takes of a `seq`-row sequence under the plan (nsplit, chunk); 0 when it
// has none (it starts past seq): the block then marks the split empty for the combine (m = −inf, l = 0), after
// the trigger and wait its kernel's place asks for, and the split body returns; 1 when it has rows; −1 when that
// wait failed. Both split bodies start here.
template <int kG, bool kEarly, bool kTrigger, class Wait>
HE_INLINE int he_attn_split_rows(int seq, int kvh, int split, int nsplit, int chunk, int hd, float* partial,
                                 int& start, int& n, const Wait& wait) {
  chunk = he_attn_len(seq, nsplit, chunk);  // splits past the ones in use start past seq: empty
  start = split * chunk;
  n = start < seq ? (seq - start < chunk ? seq - start : chunk) : 0;
  if (kAttnFreshCombine && n != 0 && start + n == seq) --n;  // the newest row is the combine's
  if (n != 0) return 1;
  if (HeAttnTrigger<kEarly, kTrigger>::before) he_pdl_trigger();
  if (kEarly && !wait()) return -1;  // partial is step data
  if (HeAttnTrigger<kEarly, kTrigger>::after) he_pdl_trigger();
  for (int g = he_thread_idx(); g < kG; g += kAttnThreads) {
    float* pr = partial + ((he_i64)(kvh * kG + g) * nsplit + split) * (hd + 2);
    pr[hd] = he_neg_inf();
    pr[hd + 1] = 0.f;
  }
  return 0;
}

// The block's warps' states (o[hd], m, l per head; warp w's head g at ws + w·wstride + g·(hd + 2)) merged in
// warp order (deterministic) into the split's partial; one thread per (head, dim). Both split bodies end here.
template <int kG>
HE_INLINE void he_attn_merge_warps(const float* ws, int wstride, float* partial, int kvh, int split, int nsplit,
                                   int hd) {
  constexpr int G = kG, nt = kAttnThreads, nw = kAttnWarps;
  for (int i = he_thread_idx(); i < G * hd; i += nt) {
    const int g = i / hd, d = i % hd;
    float M = he_neg_inf();
    for (int w = 0; w < nw; ++w) M = he_fmax(M, ws[w * wstride + g * (hd + 2) + hd]);
    float acc = 0.f, L = 0.f;
    for (int w = 0; w < nw; ++w) {
      const float* st = ws + w * wstride + g * (hd + 2);
      const float sc = (st[hd] == he_neg_inf()) ? 0.f : he_exp2(st[hd] - M);
      acc += st[d] * sc;
      L += st[hd + 1] * sc;
    }
    float* pr = partial + ((he_i64)(kvh * G + g) * nsplit + split) * (hd + 2);
    pr[d] = acc;
    if (d == 0) { pr[hd] = M; pr[hd + 1] = L; }
  }
}

// kG = num_heads / num_kv_heads as a template parameter: the per-lane state is kG·10 registers, and a
// runtime bound of kAttnMaxGroup cost 155 registers (one block per SM) even for G = 4.
//
// Per batch of kAttnUnroll rows per lane group, the work is arranged so that each instruction serves as
// many (row, head) pairs as possible: K converted once per row and dotted with every head's q slice, one
// shuffle reduction per (row, head), then ONE online-softmax rescale per head per batch
// (max over the batch's scores, one exp2 per score, o·a once) instead of one per row, then V converted once
// per row and accumulated into every head. Rows past the slice are skipped warp-wide when no lane group has
// one (short contexts leave most of a batch empty). The next batch's K loads go out as soon as the scores
// are taken, its V loads after the accumulation, so they fly under the remaining work of this batch.
//
// kEarly (the per-op decode kernel inside a captured graph, attention_decode_g*): called BEFORE the previous
// kernel has completed, with `seq` read from a position word that nothing in the graph writes. Only cache
// rows written by earlier steps are loaded before the wait: the first batch of every row but the newest
// (seq − 1, which the QKV kernel before this one appends); then the block waits (he_pdl_wait, port.h) and
// loads that row, q and everything else after it. The loads, sums and their order are the same as without
// kEarly, so the bits are too.
// kTrigger (the same kernel): he_pdl_trigger() once the first K/V batch is requested, so the next kernel
// (the O-proj) launches — and requests its weights — only behind this block's K/V loads. Triggering at the
// kernel's top let the O-proj's 8.4 MB of weight requests queue in front of them: −1.3% at 1K (v36). In a
// HE_PDL_LATE build (port.h) the early kernel triggers after its wait instead.
template <int kG, bool kEarly, bool kTrigger, class Wait = HeAttnPdlWait>
// q, the caches and partial are rewritten inside the monokernel, so none is `const __restrict__` here (that
// lets the compiler use the non-coherent read-only path) and cache rows use the coherent streaming load.
// Returns false only when a kEarly `wait` failed (the kernel must end).
HE_INLINE bool he_attention_split_fma(const float* q, const he_kv* k_cache,
                                        const he_kv* v_cache, float* partial, int seq,
                                        int kvh, int split, int nsplit, int chunk, int nh, int nkv, int hd,
                                        int max_ctx, float* smem, const Wait& wait = Wait{}) {
  static_assert(kG >= 1 && kG <= kAttnMaxGroup, "group size out of range");
  static_assert(!Wait::kFlow, "the LL-fed split (decode.hip MK_QFLOW) is the matrix-core body's");
  constexpr int G = kG, kL = kAttnLpr, kR = kWarpSize / kAttnLpr;  // lanes per row, rows per warp at once
  constexpr int U = kAttnUnroll;
  constexpr bool kTriggerBefore = HeAttnTrigger<kEarly, kTrigger>::before;
  constexpr bool kTriggerAfter = HeAttnTrigger<kEarly, kTrigger>::after;
  (void)nkv;
  hd = he_attn_hd(hd);
  // the block is kAttnThreads wide in both paths (ops.ATTN_THREADS; decode.hip asserts kMkThreads): constants
  const int t = he_thread_idx();
  constexpr int nt = kAttnThreads, nw = kAttnWarps;
  int start, n;
  const int rows = he_attn_split_rows<kG, kEarly, kTrigger>(seq, kvh, split, nsplit, chunk, hd, partial, start, n, wait);
  if (rows <= 0) return rows == 0;
  float* qs = smem;              // [G][hd]   q pre-scaled by log2(e)/sqrt(hd)
  float* ws = qs + G * hd;       // [nw][G][hd + 2]  per-warp states (o, m, l)
  const int lane = he_lane_id(), sub = lane % kL, rw = lane / kL;
  const bool dim_ok = sub * 8 < hd;
  // Each warp owns a contiguous slice of the chunk; lane group rw takes rows rw, rw + kR, ...
  const int per_warp = (n + nw - 1) / nw;
  const int w0 = he_warp_id() * per_warp, w1 = (w0 + per_warp < n) ? w0 + per_warp : n;
  const he_kv* kbase = k_cache + ((he_i64)kvh * max_ctx + start) * hd + sub * 8;
  const he_kv* vbase = v_cache + ((he_i64)kvh * max_ctx + start) * hd + sub * 8;

  // Issue the first K/V batch before staging q: cache rows do not depend on it. (kEarly: all but the
  // newest row, `fresh`, which is loaded after the wait; -1 = none held back.)
  constexpr bool kHeld = kEarly && !kAttnFreshCombine;  // the newest row is this split's (else the combine's)
  const int fresh = kHeld ? seq - 1 - start : -1;
  he_vec16 kb[U], vb[U];
#pragma unroll
  for (int j = 0; j < U; ++j) {
    const int p = w0 + rw + j * kR;
    const bool ok = p < w1 && dim_ok && (!kHeld || p != fresh);
    kb[j] = ok ? he_load16_stream_rw(kbase + (he_i64)p * hd) : he_vec16{0u, 0u, 0u, 0u};
    vb[j] = ok ? he_load16_stream_rw(vbase + (he_i64)p * hd) : he_vec16{0u, 0u, 0u, 0u};
  }
  if (kTriggerBefore) he_pdl_trigger();
  if (kEarly) {
    if (!wait()) return false;  // the QKV kernel (per-op) or stage (monokernel) is done; its writes are visible
    if (kTriggerAfter) he_pdl_trigger();
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int p = w0 + rw + j * kR;
      if (kHeld && p == fresh && p < w1 && dim_ok) {
        kb[j] = he_load16_stream_rw(kbase + (he_i64)p * hd);
        vb[j] = he_load16_stream_rw(vbase + (he_i64)p * hd);
      }
    }
  }
  const float qscale = he_rsqrt((float)hd) * kLog2e;
  for (int i = t; i < G * hd; i += nt) qs[i] = q[(he_i64)(kvh * G) * hd + i] * qscale;
  he_sync_block();
  HE_ATTN_MARK(0);  // q staged
  // This lane's 8 dims of head g's q: qs[g·hd + qoff ...], read from shared memory at each use — or, with
  // HE_ATTN_Q_REGS=1, held in registers for the whole item: the same values and the same products, so both
  // forms give the same bits. Registers pay where a warp scores several batches (long KV caches: the
  // monokernel's long-context build, hipengine/gpu/monokernel.py q_regs_build) and cost where it scores one
  // (docs/perf-log.md v28); the per-op kernels keep shared memory (more registers would halve their blocks
  // per SM). Lanes past the row's end read head 0's first dims, finite, against their zero K.
  const int qoff = dim_ok ? sub * 8 : 0;
  float qr[HE_ATTN_Q_REGS ? kG : 1][8];
  if (HE_ATTN_Q_REGS) {
#pragma unroll
    for (int g = 0; g < (HE_ATTN_Q_REGS ? kG : 1); ++g)
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) qr[g][jj] = qs[g * hd + qoff + jj];
  }

  float m[kG], l[kG], o[kG][8];
#pragma unroll
  for (int g = 0; g < kG; ++g) {
    m[g] = he_neg_inf();
    l[g] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) o[g][j] = 0.f;
  }
  for (int p0 = w0; p0 < w1; p0 += U * kR) {
    // scores of the batch (log2 units); -inf for rows past the slice
    float s[U][kG];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const bool any = p0 + j * kR < w1;  // warp-uniform: some lane group has a row here
      const bool ok = p0 + rw + j * kR < w1;
      if (any) {
        const he_vec16 k = kb[j];
        const float kf[8] = {he_kvlo_to_f32(k.x), he_kvhi_to_f32(k.x), he_kvlo_to_f32(k.y), he_kvhi_to_f32(k.y),
                             he_kvlo_to_f32(k.z), he_kvhi_to_f32(k.z), he_kvlo_to_f32(k.w), he_kvhi_to_f32(k.w)};
#pragma unroll
        for (int g = 0; g < kG; ++g) {
          float d = 0.f;
#pragma unroll
          for (int jj = 0; jj < 8; ++jj) d += kf[jj] * (HE_ATTN_Q_REGS ? qr[HE_ATTN_Q_REGS ? g : 0][jj] : qs[g * hd + qoff + jj]);
#pragma unroll
          for (int x = kL / 2; x > 0; x >>= 1) d += he_shfl_xor(d, x);
          s[j][g] = ok ? d : he_neg_inf();
        }
      } else {
#pragma unroll
        for (int g = 0; g < kG; ++g) s[j][g] = he_neg_inf();
      }
    }
    const int pn = p0 + U * kR;  // the next batch's first row
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int p = pn + rw + j * kR;
      kb[j] = (p < w1 && dim_ok) ? he_load16_stream_rw(kbase + (he_i64)p * hd) : he_vec16{0u, 0u, 0u, 0u};
    }
    // one online-softmax step per head for the whole batch; scores become weights in place. kAttnWarpMax:
    // the running max is the WARP's (xor-max over its lane groups), so every lane group of a warp scales by
    // the same 2^(m − M) and the groups' states merge by plain sums after the loop.
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      float M = m[g];
#pragma unroll
      for (int j = 0; j < U; ++j) M = he_fmax(M, s[j][g]);
      if (kAttnWarpMax)
#pragma unroll
        for (int x = kWarpSize / 2; x >= kL; x >>= 1) M = he_fmax(M, he_shfl_xor(M, x));
      const float Ms = (M == he_neg_inf()) ? 0.f : M;  // nothing seen yet: every weight below is 2^-inf = 0
      const float a = he_exp2(m[g] - Ms);              // m = -inf: a = 0
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < U; ++j) {
        s[j][g] = he_exp2(s[j][g] - Ms);
        sum += s[j][g];
      }
      l[g] = l[g] * a + sum;
      m[g] = M;
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) o[g][jj] *= a;
    }
#pragma unroll
    for (int j = 0; j < U; ++j) {
      if (p0 + j * kR < w1) {  // warp-uniform, as above
        const he_vec16 v = vb[j];
        const float vf[8] = {he_kvlo_to_f32(v.x), he_kvhi_to_f32(v.x), he_kvlo_to_f32(v.y), he_kvhi_to_f32(v.y),
                             he_kvlo_to_f32(v.z), he_kvhi_to_f32(v.z), he_kvlo_to_f32(v.w), he_kvhi_to_f32(v.w)};
#pragma unroll
        for (int g = 0; g < kG; ++g)
#pragma unroll
          for (int jj = 0; jj < 8; ++jj) o[g][jj] += s[j][g] * vf[jj];
      }
    }
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int p = pn + rw + j * kR;
      vb[j] = (p < w1 && dim_ok) ? he_load16_stream_rw(vbase + (he_i64)p * hd) : he_vec16{0u, 0u, 0u, 0u};
    }
  }
  HE_ATTN_MARK(1);  // this warp's rows scored and accumulated
  // merge the lane groups of the warp (xor offsets ≥ kL pair rows, keep the dim slot): with the warp's
  // running max they share m and the merge is a sum of their l and o, otherwise an online-softmax merge ...
#pragma unroll
  for (int g = 0; g < kG; ++g) {
#pragma unroll
    for (int x = kWarpSize / 2; x >= kL; x >>= 1) {
      if (kAttnWarpMax) {
        l[g] += he_shfl_xor(l[g], x);
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) o[g][jj] += he_shfl_xor(o[g][jj], x);
      } else {
        float o2[8];
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) o2[jj] = he_shfl_xor(o[g][jj], x);
        he_softmax_merge(m[g], l[g], o[g], he_shfl_xor(m[g], x), he_shfl_xor(l[g], x), o2);
      }
    }
  }
  // ... then the warps, through shared memory, in warp order (deterministic).
  if (rw == 0) {
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      float* st = ws + ((he_i64)he_warp_id() * G + g) * (hd + 2);
      if (dim_ok)
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) st[sub * 8 + jj] = o[g][jj];
      if (sub == 0) { st[hd] = m[g]; st[hd + 1] = l[g]; }
    }
  }
  he_sync_block();
  HE_ATTN_MARK(2);  // warps' states in shared memory
  he_attn_merge_warps<kG>(ws, G * (hd + 2), partial, kvh, split, nsplit, hd);
  return true;
}

// ---- the split on the matrix cores (HE_ATTN_MMA) ---------------------------------------------------------
// HE_ATTN_MMA=1 (ops.attention_defines: where the target has port.h's matrix-core tiles and hd is a multiple of
// 16; both paths take the same build, so they stay bit-identical to each other): the split's scores and
// weighted sums on the matrix cores, the KV group's G query heads as the rows of port.h's attention tiles
// (he_att_*: its "queries" are heads here). Each warp takes 16-key tiles of the split (tiles w, w + warps, ...):
// a tile's K rows and Vᵀ are staged in the warp's own shared memory (16-byte loads into registers one tile
// ahead, so the next tile's rows are in flight while this one is multiplied; a warp barrier, not a block
// barrier, between the stores and the fragment loads), then S = Q·Kᵀ (G heads × 16 keys), the online softmax
// on the score registers, O += P·V with P straight from them. q (pre-scaled into log2 units) and P enter as
// hi/lo 16-bit pairs, K and V exactly — ~16 bits of mantissa kept, attention_prefill.hip's form. Per 16 keys
// a warp issues 2·hd/16 fragment products each way where the FMA body spends ~500 instructions on dot
// products, shuffle reductions and the lane groups' merge (docs/perf-log.md v53). The warps' states merge
// as the FMA body's do (he_attn_merge_warps).
#ifndef HE_ATTN_MMA
#define HE_ATTN_MMA 0
#endif
constexpr bool kAttnMma = HE_ATTN_MMA != 0;
static_assert(!kAttnMma || (HE_ATTN_HD > 0 && HE_ATTN_HD % 16 == 0), "HE_ATTN_MMA: HE_ATTN_HD, a multiple of 16");
constexpr int kAmHd = HE_ATTN_HD > 0 ? HE_ATTN_HD : 16;
constexpr int kAmKeys = 16;                               // keys per warp tile
constexpr int kAmKld = kAmHd + 8;                         // staged K row (16-bit elements): conflict-free fragments
constexpr int kAmVld = kAmKeys + 8;                       // staged Vᵀ row
constexpr int kAmQld = kAmHd + 8;                         // the q hi / lo tiles' rows
constexpr int kAmWarpBytes = (kAmKeys * kAmKld + kAmHd * kAmVld) * 2;
constexpr int kAmKVec = kAmKeys * kAmHd / 8;              // 16-byte K vectors per tile
constexpr int kAmVItems = kAmKeys / 2 * kAmHd / 8;        // (key pair, 8 dims) V items per tile
[[maybe_unused]] constexpr int kAmKPer = (kAmKVec + kWarpSize - 1) / kWarpSize;  // per lane
[[maybe_unused]] constexpr int kAmVPer = (kAmVItems + kWarpSize - 1) / kWarpSize;
static_assert(kAmWarpBytes >= kAttnMaxGroup * (kAmHd + 2) * 4, "a warp's merge state fits over its tiles");
// Dynamic shared memory of the matrix-core split, bytes (ops.attention_shared_bytes mirrors it): the q hi and
// lo tiles [G][kAmQld], then each warp's K tile [16][kAmKld] and Vᵀ tile [hd][kAmVld] — over which the warp
// writes its state (o, m, l per head) for the merge once its last tile is done.
HE_INLINE constexpr int he_attn_mma_smem(int G) { return 2 * G * kAmQld * 2 + kAttnWarps * kAmWarpBytes; }

// Inside the monokernel the body is a call of its own (__noinline__), between two compiler fences
// (monokernel/decode.hip): inlined, it changed the whole kernel's register allocation (255 either way) and
// spilled the matvec stages' descriptors — 66 spill instructions in matvec.hip's code against none with the
// FMA body (ptxas, nvdisasm -g), QKV and gate/up +0.9 / +1.2 µs per layer at 1K (stage profile): the monokernel
// lost 2.4% at 1K where the per-op path gained 2.6%. As a call, 47 such spills (values kept live across it);
// with the fences, which make the kernel reload its parameters after the call instead, 4 (docs/perf-log.md v53).
#if defined(HE_IN_MONOKERNEL)
#define HE_ATTN_MMA_FN __device__ __noinline__
#else
#define HE_ATTN_MMA_FN HE_INLINE
#endif
template <int kG, bool kEarly, bool kTrigger, class Wait = HeAttnPdlWait>
HE_ATTN_MMA_FN bool he_attention_split_mma(const float* q, const he_kv* k_cache, const he_kv* v_cache,
                                           float* partial, int seq, int kvh, int split, int nsplit, int chunk,
                                           int max_ctx, float* smem, const Wait wait = Wait{}) {
  static_assert(kG >= 1 && kG <= kAttnMaxGroup, "group size out of range");
  constexpr int G = kG, HD = kAmHd, nt = kAttnThreads, nw = kAttnWarps, kDt = HD / 16;
  constexpr bool kF16 = HE_KV_F16 != 0;
  constexpr bool kTriggerBefore = HeAttnTrigger<kEarly, kTrigger>::before;
  constexpr bool kTriggerAfter = HeAttnTrigger<kEarly, kTrigger>::after;
  const int t = he_thread_idx(), lane = he_lane_id(), wid = he_warp_id();
  int start, n;
  const int rows = he_attn_split_rows<kG, kEarly, kTrigger>(seq, kvh, split, nsplit, chunk, HD, partial, start, n, wait);
  if (rows <= 0) return rows == 0;
  he_u16* qh = (he_u16*)smem;  // q · log2(e)/sqrt(hd) as hi / lo 16-bit tiles [G][kAmQld]
  he_u16* ql = qh + G * kAmQld;
  char* wbase = (char*)smem + 2 * G * kAmQld * 2;
  he_u16* Ks = (he_u16*)(wbase + wid * kAmWarpBytes);  // this warp's K tile [16 keys][kAmKld]
  he_u16* Vt = Ks + kAmKeys * kAmKld;                   // and Vᵀ tile [hd][kAmVld]
  const he_kv* kbase = k_cache + ((he_i64)kvh * max_ctx + start) * HD;
  const he_kv* vbase = v_cache + ((he_i64)kvh * max_ctx + start) * HD;
  const int ntile = (n + kAmKeys - 1) / kAmKeys;
  // kEarly: the newest row, loaded after the wait — unless the combine takes it (HE_ATTN_FRESH_COMBINE)
  constexpr bool kHeld = kEarly && !kAttnFreshCombine;
  const int fresh = kHeld ? seq - 1 - start : -1;
  const he_vec16 zero{0u, 0u, 0u, 0u};

  // This lane's share of a tile in registers: K vectors (key, 8 dims) and V items (two keys, 8 dims). Keys past
  // the split's end load as zeros (their scores are masked below). `part` (kEarly's first tile, split around
  // the wait): kAll loads every row, kButFresh all but the newest, kFresh that one alone into what the first
  // call left.
  enum { kAll, kButFresh, kFresh };
  he_vec16 kr[kAmKPer], va[kAmVPer], vb[kAmVPer];
  // One 16-byte vector of row `key` (dims [c, c + 8)): from the cache, or (Wait::kFlow) the newest row's LL words.
  // `poll` false (a constant where load is called): the tile is known not to hold the newest row, and the poll's
  // code is not compiled into that load.
  auto row8 = [&](const he_kv* base, bool v, int key, int c, bool poll) {
    if constexpr (Wait::kFlow && kHeld)
      if (poll && key == fresh) return wait.kv8(kvh, v, c);
    return he_load16_stream_rw(base + (he_i64)key * HD + c);
  };
  // whether tile `t` holds the newest row (kEarly; warp-uniform)
  [[maybe_unused]] auto holds_fresh = [&](int t) { return fresh >= t * kAmKeys && fresh < (t + 1) * kAmKeys; };
  auto load = [&](int tile, int part, bool poll = true) {
    const int k0 = tile * kAmKeys;
    auto want = [&](int key) { return part == kAll || (part == kButFresh) == (key != fresh); };
#pragma unroll
    for (int r = 0; r < kAmKPer; ++r) {
      const int i = lane + r * kWarpSize, key = k0 + i / (HD / 8), c = (i % (HD / 8)) * 8;
      const bool ok = (kAmKVec % kWarpSize == 0 || i < kAmKVec) && key < n;
      if (want(key)) kr[r] = ok ? row8(kbase, false, key, c, poll) : zero;
    }
#pragma unroll
    for (int r = 0; r < kAmVPer; ++r) {
      const int i = lane + r * kWarpSize, kp = i % (kAmKeys / 2), c = (i / (kAmKeys / 2)) * 8, key = k0 + 2 * kp;
      const bool in = kAmVItems % kWarpSize == 0 || i < kAmVItems;
      if (want(key)) va[r] = in && key < n ? row8(vbase, true, key, c, poll) : zero;
      if (want(key + 1)) vb[r] = in && key + 1 < n ? row8(vbase, true, key + 1, c, poll) : zero;
    }
  };
  // Registers -> the warp's tiles. Vᵀ as attention_prefill.hip stages it: 32-bit words of a key pair per dim.
  auto stage = [&]() {
#pragma unroll
    for (int r = 0; r < kAmKPer; ++r) {
      const int i = lane + r * kWarpSize;
      if (kAmKVec % kWarpSize == 0 || i < kAmKVec)
        *(he_vec16*)(Ks + (i / (HD / 8)) * kAmKld + (i % (HD / 8)) * 8) = kr[r];
    }
#pragma unroll
    for (int r = 0; r < kAmVPer; ++r) {
      const int i = lane + r * kWarpSize, kp = i % (kAmKeys / 2), c = (i / (kAmKeys / 2)) * 8;
      if (kAmVItems % kWarpSize == 0 || i < kAmVItems) {
        const he_u32 wa[4] = {va[r].x, va[r].y, va[r].z, va[r].w}, wb[4] = {vb[r].x, vb[r].y, vb[r].z, vb[r].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // dims c + 2j (the words' low halves) and c + 2j + 1 (high halves)
          *(he_u32*)(Vt + (c + 2 * j) * kAmVld + 2 * kp) = (wa[j] & 0xffffu) | (wb[j] << 16);
          *(he_u32*)(Vt + (c + 2 * j + 1) * kAmVld + 2 * kp) = (wa[j] >> 16) | (wb[j] & 0xffff0000u);
        }
      }
    }
  };

  // The warp's first tile is requested before q is staged (cache rows do not depend on it) and, kEarly, before
  // the wait — all but the newest row, which the kernel before this one appends.
  if (wid < ntile) load(wid, kHeld ? kButFresh : kAll);
  if (kTriggerBefore) he_pdl_trigger();
  if (kEarly) {
    if (!wait()) return false;  // the QKV kernel (per-op) or stage (monokernel) is done; its writes are visible
    if (kTriggerAfter) he_pdl_trigger();
    // (Wait::kFlow: the newest row's words are polled only where its tile is staged, below — the rest of the block
    // stages q and scores its tiles meanwhile; the same values in the same places, so the same sums.)
    if (kHeld && !Wait::kFlow && wid < ntile) load(wid, kFresh);
  }
  const float qscale = he_rsqrt((float)HD) * kLog2e;
  for (int i = t; i < G * HD / 2; i += nt) {
    const int g = i / (HD / 2), d = (i % (HD / 2)) * 2;
    float q0, q1;
    wait.q2(q, (he_i64)(kvh * G + g) * HD + d, q0, q1);
    he_u32 hi, lo;
    he_split2<kF16>(q0 * qscale, q1 * qscale, hi, lo);
    *(he_u32*)(qh + g * kAmQld + d) = hi;
    *(he_u32*)(ql + g * kAmQld + d) = lo;
  }
  he_sync_block();
  HE_ATTN_MARK(0);  // q staged
  HeMmaAcc o[kDt];
#pragma unroll
  for (int d = 0; d < kDt; ++d) he_mma_zero(o[d]);
  float m[kAttQ], l[kAttQ];  // the running max (log2 units) and sum of this lane's heads
#pragma unroll
  for (int j = 0; j < kAttQ; ++j) m[j] = he_neg_inf(), l[j] = 0.f;
  for (int tile = wid; tile < ntile; tile += nw) {
    // Only the warp whose first tile holds the newest row enters the fresh load: its polls of that row's LL words are
    // ~1,000 instructions of code (one poll loop per 16-byte vector) that every other warp would walk branch by branch.
    if constexpr (Wait::kFlow && kHeld)
      if (tile == wid && HE_UNLIKELY(holds_fresh(wid))) load(wid, kFresh);
    stage();
    he_sync_warp();
    if constexpr (Wait::kFlow && kHeld)  // the newest row's words have all landed (profile builds: attn_fresh)
      if (tile == wid && holds_fresh(wid)) HE_ATTN_MARK_WARP(5);
    // The next tile's rows fly under this one's products. Its load polls the newest row's LL words only where the
    // tile holds that row (kFlow, kEarly: one tile per split); everywhere else a load with no poll code (session 47,
    // H100: +4.3 / +3.2% at 8K / 32K, where a warp walks many tiles; level at 1K).
    if (tile + nw < ntile) {
      const int nx = tile + nw;
      // (the test written out, not holds_fresh(nx): through the lambda clang's gfx942 build spills 22 more VGPRs)
      if (Wait::kFlow && kHeld && HE_UNLIKELY(fresh >= nx * kAmKeys && fresh < (nx + 1) * kAmKeys)) load(nx, kAll);
      else load(nx, kAll, false);
    }
    HeMmaAcc sc;
    he_mma_zero(sc);
#pragma unroll
    for (int d = 0; d < kDt; ++d) {
      const HeMmaFrag b = he_mma_load_b(Ks + 16 * d, kAmKld);  // q's fragments re-read per tile: registers
      he_att_qk<kF16>(sc, he_mma_load_a_rows(qh + 16 * d, kAmQld, G), b);
      he_att_qk<kF16>(sc, he_mma_load_a_rows(ql + 16 * d, kAmQld, G), b);
    }
    float mx[kAttQ];
#pragma unroll
    for (int j = 0; j < kAttQ; ++j) mx[j] = he_neg_inf();
#pragma unroll
    for (int i = 0; i < kMmaAcc; ++i) {
      const bool ok = he_att_q(i) < G && tile * kAmKeys + he_att_c(i) < n;
      sc.v[i] = ok ? sc.v[i] : he_neg_inf();
      mx[he_att_qi(i)] = he_fmax(mx[he_att_qi(i)], sc.v[i]);
    }
    // Online softmax over the tile: its max over the lanes of each head, probabilities in place, their sum.
    float alpha[kAttQ], sum[kAttQ];
#pragma unroll
    for (int j = 0; j < kAttQ; ++j) {
      const float mnew = he_fmax(m[j], he_att_row_max(mx[j]));
      alpha[j] = (m[j] == he_neg_inf()) ? 0.f : he_exp2(m[j] - mnew);
      m[j] = mnew;
      sum[j] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < kMmaAcc; ++i) {
      const float x = sc.v[i];
      const float p = (x == he_neg_inf()) ? 0.f : he_exp2(x - m[he_att_qi(i)]);
      sc.v[i] = p;
      sum[he_att_qi(i)] += p;
    }
#pragma unroll
    for (int j = 0; j < kAttQ; ++j) l[j] = l[j] * alpha[j] + he_att_row_sum(sum[j]);
#pragma unroll
    for (int d = 0; d < kDt; ++d)
#pragma unroll
      for (int i = 0; i < kMmaAcc; ++i) o[d].v[i] *= alpha[he_att_qi(i)];
    HeMmaFrag ph, pl;
    he_att_p_frag<kF16>(sc, ph, pl);
#pragma unroll
    for (int d = 0; d < kDt; ++d) {
      const HeMmaFrag b = he_mma_load_b(Vt + 16 * d * kAmVld, kAmVld);
      he_att_pv<kF16>(o[d], ph, b);
      he_att_pv<kF16>(o[d], pl, b);
    }
    he_sync_warp();  // the next stage() rewrites the tiles
  }
  HE_ATTN_MARK(1);  // this warp's tiles scored and accumulated
  // The warp's state over its own tiles, in the merge's layout [G][hd + 2]: o, then m and l.
  float* st = (float*)(wbase + wid * kAmWarpBytes);
#pragma unroll
  for (int d = 0; d < kDt; ++d)
#pragma unroll
    for (int i = 0; i < kMmaAcc; ++i)
      if (he_att_q(i) < G) st[he_att_q(i) * (HD + 2) + 16 * d + he_att_c(i)] = o[d].v[i];
  if (he_att_leader()) {
#pragma unroll
    for (int j = 0; j < kAttQ; ++j) {
      const int r = he_att_qrow(j);
      if (r < G) {
        st[r * (HD + 2) + HD] = m[j];
        st[r * (HD + 2) + HD + 1] = l[j];
      }
    }
  }
  he_sync_block();
  HE_ATTN_MARK(2);  // warps' states in shared memory
  he_attn_merge_warps<kG>((const float*)wbase, kAmWarpBytes / 4, partial, kvh, split, nsplit, HD);
  return true;
}

// The split body of both paths: on the matrix cores where the module is built for them (HE_ATTN_MMA), else the
// FMA body above.
// kEarly: `wait` stands between the first K/V requests (all rows but the newest) and the rest; false when it failed.
template <int kG, bool kEarly = false, bool kTrigger = false, class Wait = HeAttnPdlWait>
HE_INLINE bool he_attention_split_block(const float* q, const he_kv* k_cache, const he_kv* v_cache, float* partial,
                                        int seq, int kvh, int split, int nsplit, int chunk, int nh, int nkv, int hd,
                                        int max_ctx, float* smem, const Wait& wait = Wait{}) {
  if constexpr (kAttnMma)
    return he_attention_split_mma<kG, kEarly, kTrigger, Wait>(q, k_cache, v_cache, partial, seq, kvh, split, nsplit,
                                                              chunk, max_ctx, smem, wait);
  else
    return he_attention_split_fma<kG, kEarly, kTrigger, Wait>(q, k_cache, v_cache, partial, seq, kvh, split, nsplit,
                                                              chunk, nh, nkv, hd, max_ctx, smem, wait);
}

// early_pos (the per-op split and combine kernels inside a captured decode graph, Ops.attention): the
// position is read BEFORE he_pdl_wait — allowed because nothing in the graph writes it (the step's end,
// outside the graph, advances it) — so its L2 round trip overlaps the wait for the kernel before instead of
// heading the chain after it. Same value, same bits. Outside a graph (warm-up, prefill, tests) it is 0.
// The load is port.h's he_ld_step (coherent, issued where written) like the late read: a plain `*pos_p` may
// become a non-coherent load the compiler moves at will (tests/test_pdl_sass.py).
HE_INLINE int he_attn_early_pos(const int* pos_p) { return he_ld_step(pos_p); }

// One kernel per group size (attention_split_g1 ... _g8): a kernel's register allocation is the maximum over
// everything it may run, so a single kernel switching on G would pay G = 8's 168 registers for G = 4.
// The module is compiled per lane count (HE_ATTN_LPR, from hd).
#define HE_ATTN_KERNEL(g)                                                                                   \
  HE_KERNEL(256) attention_split_g##g(const float* q, const he_kv* k_cache,                                 \
                                      const he_kv* v_cache, float* __restrict__ partial,                    \
                                      const int* pos_p, int nsplit, int chunk, int nh, int nkv,             \
                                      int hd, int max_ctx, int early_pos) {                                 \
    extern __shared__ float he_attn_smem[];                                                                 \
    he_pdl_trigger_top();                                                                                   \
    const int tq = he_block_idx_y();                                                                        \
    int seq = 0;                                                                                            \
    if (early_pos) seq = he_attn_early_pos(pos_p) + tq + 1;                                                 \
    he_pdl_wait(); /* port.h: the position, q and the newest K/V row come from the kernels before */        \
    he_pdl_trigger_late();                                                                                  \
    if (!early_pos) seq = he_ld_step(pos_p) + tq + 1;                                                       \
    const int kvh = he_block_idx() / nsplit, split = he_block_idx() % nsplit;                               \
    he_attention_split_block<g>(q + (he_i64)tq * nh * hd, k_cache, v_cache,                                 \
                                partial + (he_i64)tq * nh * nsplit * (hd + 2), seq, kvh, split, nsplit, chunk, \
                                nh, nkv, hd, max_ctx, he_attn_smem);                                        \
  }
HE_ATTN_KERNEL(1)
HE_ATTN_KERNEL(2)
HE_ATTN_KERNEL(3)
HE_ATTN_KERNEL(4)
HE_ATTN_KERNEL(5)
HE_ATTN_KERNEL(6)
HE_ATTN_KERNEL(7)
HE_ATTN_KERNEL(8)
#undef HE_ATTN_KERNEL

// Head g's partials (ph) folded into the running (M, L, o) of dim d: splits [0, ns), kCombineBatch a round trip
// (all 3·kCombineBatch loads of a batch issued before any is used), each batch merged in split order — the loop of
// he_attention_combine below, for he_attention_combine_fresh. (he_attention_combine keeps its own copy: calling this
// instead, NVVM scheduled the whole default monokernel anew, 48,752 → 48,576 SASS instructions; the measured build
// stays as it was.)
HE_INLINE void he_attn_fold(const float* ph, int ns, int d, int hd, float& M, float& L, float& o) {
  for (int s0 = 0; s0 < ns; s0 += kCombineBatch) {
    float v[kCombineBatch], ms[kCombineBatch], ls[kCombineBatch];
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b) {
      const float* e = ph + (s0 + b) * (hd + 2);
      const bool ok = s0 + b < ns;
      v[b] = ok ? e[d] : 0.f;
      ms[b] = ok ? e[hd] : he_neg_inf();
      ls[b] = ok ? e[hd + 1] : 0.f;  // empty splits (l = 0) hold stale values: skipped below
    }
    float Mb = M;
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b)
      if (ls[b] > 0.f) Mb = he_fmax(Mb, ms[b]);
    const float a = (M == he_neg_inf()) ? 0.f : he_exp2(M - Mb);
    L *= a;
    o *= a;
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b) {
      const float w = ls[b] > 0.f ? he_exp2(ms[b] - Mb) : 0.f;
      L += w * ls[b];
      o += ls[b] > 0.f ? w * v[b] : 0.f;  // not w · v: an empty split's stale o may be NaN/inf
    }
    M = Mb;
  }
}

// out[h] = Σ_s 2^(m_s − M) o_s / Σ_s 2^(m_s − M) l_s  over non-empty splits (l_s > 0).
// One thread per output value (head g of the heads combined here, dim d). Splits are taken kCombineBatch at a
// time: all 3·kCombineBatch loads of a batch (o_s[d], m_s, l_s) are issued before any is used (one L2
// round trip per batch; nsplit ≤ 16 at short context is one batch), then the batch is folded into a
// running (M, L, o) in split order — the online-softmax merge, as inside a split. No shared memory and no
// block reduction: the result depends only on (nsplit, the partials), never on the block size or on how
// many heads one block combines, so the per-head kernel (attention_combine) and the monokernel's
// whole-group combine produce the same bits. (Measured on H200: a plain unrolled loop with the merge inside
// was not batched by the compiler — 6.6 µs per combine instead of ~2.)
// pr: partials of the first head (heads nsplit·(hd + 2) floats apart); out: heads hd floats apart.
// nsplit: the plan's (partials of consecutive heads are nsplit·(hd + 2) floats apart); seq: the sequence
// length the splits covered — only its he_attn_splits(seq, nsplit) splits are folded.
HE_INLINE void he_attention_combine(const float* pr, int nh_here, int nsplit, int seq, int hd, float* out) {
  const int t = he_thread_idx(), nt = he_block_dim();
  const int hs = nsplit * (hd + 2);  // floats per head of partials
  const int ns = he_attn_splits(seq, nsplit);
  for (int i = t; i < nh_here * hd; i += nt) {
    const int g = i / hd, d = i % hd;
    const float* ph = pr + (he_i64)g * hs;
    float M = he_neg_inf(), L = 0.f, o = 0.f;
    for (int s0 = 0; s0 < ns; s0 += kCombineBatch) {
      float v[kCombineBatch], ms[kCombineBatch], ls[kCombineBatch];
#pragma unroll
      for (int b = 0; b < kCombineBatch; ++b) {
        const float* e = ph + (s0 + b) * (hd + 2);
        const bool ok = s0 + b < ns;
        v[b] = ok ? e[d] : 0.f;
        ms[b] = ok ? e[hd] : he_neg_inf();
        ls[b] = ok ? e[hd + 1] : 0.f;  // empty splits (l = 0) hold stale values: skipped below
      }
      float Mb = M;
#pragma unroll
      for (int b = 0; b < kCombineBatch; ++b)
        if (ls[b] > 0.f) Mb = he_fmax(Mb, ms[b]);
      const float a = (M == he_neg_inf()) ? 0.f : he_exp2(M - Mb);
      L *= a;
      o *= a;
#pragma unroll
      for (int b = 0; b < kCombineBatch; ++b) {
        const float w = ls[b] > 0.f ? he_exp2(ms[b] - Mb) : 0.f;
        L += w * ls[b];
        o += ls[b] > 0.f ? w * v[b] : 0.f;  // not w · v: an empty split's stale o may be NaN/inf
      }
      M = Mb;
    }
    out[(he_i64)g * hd + d] = o / L;
  }
}

// HE_ATTN_FRESH_COMBINE's source of the newest row: head h's q[d] as the split reads it (before the log2(e)/sqrt(hd)
// scale) and dim d of row `row` of KV head kvh's K (when wk) and V, as floats. HeAttnFreshPlain: plain loads, after
// the kernel or barrier that wrote them (the per-op kernels; the monokernel's barrier builds). decode.hip's
// MkFlowFresh polls the QKV stage's LL words instead (MK_QFLOW).
struct HeAttnFreshPlain {
  const float* q;  // this token's [nh][hd]
  const he_kv* k_cache;
  const he_kv* v_cache;
  int max_ctx;
  HE_INLINE void fetch(int h, int kvh, int row, int d, int hd, bool wk, float& qv, float& kv, float& vv) const {
    const he_i64 c = ((he_i64)kvh * max_ctx + row) * hd + d;
    qv = q[(he_i64)h * hd + d];
    kv = wk ? he_kvlo_to_f32(k_cache[c]) : 0.f;
    vv = wk ? he_kvlo_to_f32(v_cache[c]) : 0.f;
  }
};

// he_attention_combine with the newest row (seq − 1) added: the splits left it out (HE_ATTN_FRESH_COMBINE). h0: the
// first of the nh_here heads combined here, all of one KV group of G heads; stage: (nh_here + 2)·hd floats of
// shared memory (q · scale of every head here, then the row's K and V). Every thread of the block calls it (a block
// barrier inside). A thread's part of the row and its partials are in flight together: one round trip.
// The row's score for head g is Σ_d (q_d · scale) · k_d as one FMA chain in dim order — the same in every thread,
// on both paths and at any warp width (the split's matrix-core sum of q's hi / lo halves is not needed for it) —
// and it joins the splits' (M, L, o) as one more online-softmax state: (s, 1, v).
template <class Fresh>
HE_INLINE void he_attention_combine_fresh(const float* pr, int nh_here, int nsplit, int seq, int hd, float* out, int h0,
                                          int G, float* stage, const Fresh& fresh) {
  hd = he_attn_hd(hd);
  const int t = he_thread_idx(), nt = he_block_dim(), n = nh_here * hd;
  const int hs = nsplit * (hd + 2);
  const int ns = he_attn_splits(seq, nsplit);
  const float qscale = he_rsqrt((float)hd) * kLog2e;
  float* qs = stage;
  float* ks = stage + n;
  float* vs = ks + hd;
  for (int i0 = 0; i0 < n; i0 += nt) {  // every thread takes every round: the barrier below
    const int i = i0 + t;
    const bool act = i < n;
    const int g = act ? i / hd : 0, d = act ? i % hd : 0;
    // the row's values requested first (round 0 stages them all), then the partials: the fold's loads are issued
    // before its first use, and the stores below wait for the row's loads alone, which return first
    float qv = 0.f, kv = 0.f, vv = 0.f;
    if (i0 == 0 && act) fresh.fetch(h0 + g, h0 / G, seq - 1, d, hd, i < hd, qv, kv, vv);
    float M = he_neg_inf(), L = 0.f, o = 0.f;
    if (act) he_attn_fold(pr + (he_i64)g * hs, ns, d, hd, M, L, o);
    if (i0 == 0) {
      if (act) {
        qs[i] = qv * qscale;
        if (i < hd) ks[i] = kv, vs[i] = vv;
      }
      for (int j = t + nt; j < n; j += nt) {  // values past the first round's (nh_here·hd > the block)
        float qj, kj, vj;
        fresh.fetch(h0 + j / hd, h0 / G, seq - 1, j % hd, hd, j < hd, qj, kj, vj);
        qs[j] = qj * qscale;
        if (j < hd) ks[j] = kj, vs[j] = vj;
      }
      he_sync_block();
    }
    if (!act) continue;
    const float* qg = qs + g * hd;
    float s = 0.f;
    for (int c = 0; c < hd; ++c) s = he_fma(qg[c], ks[c], s);
    const float Mb = he_fmax(M, s);
    const float a = (M == he_neg_inf()) ? 0.f : he_exp2(M - Mb), w = he_exp2(s - Mb);
    out[(he_i64)g * hd + d] = he_fma(o, a, w * vs[d]) / he_fma(L, a, w);
  }
}

// fresh != 0 (a module built with HE_ATTN_FRESH_COMBINE, after attention_split): the splits left out each token's
// newest row, so the combine adds it from q and the caches (the prefill's splits, attention_prefill.hip, cover
// every row: 0).
HE_KERNEL(256) attention_combine(const float* partial, const int* pos_p, int nsplit,
                                 int nh, int hd, float* __restrict__ out, int early_pos, const float* q,
                                 const he_kv* k_cache, const he_kv* v_cache, int nkv, int max_ctx, int fresh) {
  // The next kernel (the O-proj) may launch at once and request its weights during the splits: on this path
  // that measured faster than launching it after them (docs/perf-log.md v33), unlike the monokernel's v24.
  he_pdl_trigger_top();
  const int h = he_block_idx(), tq = he_block_idx_y();
  int seq = 0;
  if (early_pos) seq = he_attn_early_pos(pos_p) + tq + 1;
  he_pdl_wait();  // port.h: everything below reads or writes step data
  he_pdl_trigger_late();
  if (!early_pos) seq = he_ld_step(pos_p) + tq + 1;
  const float* pr = partial + ((he_i64)tq * nh + h) * nsplit * (hd + 2);
  float* o = out + ((he_i64)tq * nh + h) * hd;
#if HE_ATTN_FRESH_COMBINE
  __shared__ float stage[3 * 8 * kWarpSize];  // (1 + 2)·hd floats, hd ≤ 8·kWarpSize (ops.attention)
  if (fresh) {
    he_attention_combine_fresh(pr, 1, nsplit, seq, hd, o, h, nh / nkv, stage,
                               HeAttnFreshPlain{q + (he_i64)tq * nh * hd, k_cache, v_cache, max_ctx});
    return;
  }
#else
  (void)q, (void)k_cache, (void)v_cache, (void)nkv, (void)max_ctx, (void)fresh;
#endif
  he_attention_combine(pr, 1, nsplit, seq, hd, o);
}
// ---- decode: split + combine in one kernel ----------------------------------------------------------------
// One query token (T = 1). The (kv head, split) blocks of attention_split; then the last of a KV head's nsplit
// blocks to arrive combines that head's G query heads into `out` (sync.h he_arrive_last: acq_rel counter at
// device scope, so it sees every split's partial; it resets the counter for the next layer's kernel, which
// runs after this one has completed). Saves the combine kernel's launch and its wait for the splits to
// complete; he_attention_combine gives the same bits for G heads at once as for one (see above), so the
// result is attention_split + attention_combine's. count: nkv words, zero before the first launch.
// early != 0: see he_attention_split_block's kEarly — the host passes it only for launches inside a
// captured decode graph (*pos_p is written before the graph, never inside it).
// Not instantiated in the monokernel's module (HE_IN_MONOKERNEL, monokernel/decode.hip): it runs the split
// body itself, and with these kernels beside it NVVM compiled its code differently (12,000 SASS lines moved).
#ifndef HE_IN_MONOKERNEL
// The last split block's combine of its KV head's G heads (HE_ATTN_FRESH_COMBINE: with the newest row, staged in the
// split's shared memory, free again after he_arrive_last's barriers).
template <int kG>
HE_INLINE void he_attn_decode_combine(const float* q, const he_kv* k_cache, const he_kv* v_cache, const float* partial,
                                      float* out, int seq, int kvh, int nsplit, int hd, int max_ctx, float* smem) {
  const float* pr = partial + (he_i64)kvh * kG * nsplit * (hd + 2);
  float* o = out + (he_i64)kvh * kG * hd;
  if constexpr (kAttnFreshCombine)
    he_attention_combine_fresh(pr, kG, nsplit, seq, hd, o, kvh * kG, kG, smem,
                               HeAttnFreshPlain{q, k_cache, v_cache, max_ctx});
  else
    he_attention_combine(pr, kG, nsplit, seq, hd, o);
}
#define HE_ATTN_DECODE_KERNEL(g)                                                                            \
  HE_KERNEL(256) attention_decode_g##g(const float* q, const he_kv* k_cache,                                \
                                       const he_kv* v_cache, float* __restrict__ partial,                   \
                                       const int* pos_p, he_u32* __restrict__ count,                        \
                                       float* __restrict__ out, int nsplit, int chunk, int nh, int nkv,     \
                                       int hd, int max_ctx, int early) {                                    \
    extern __shared__ float he_attn_smem[];                                                                 \
    const int kvh = he_block_idx() / nsplit, split = he_block_idx() % nsplit;                               \
    int seq;                                                                                                \
    if (early) {                                                                                            \
      seq = he_attn_early_pos(pos_p) + 1;                                                                   \
      he_attention_split_block<g, true, true>(q, k_cache, v_cache, partial, seq, kvh, split, nsplit, chunk, \
                                              nh, nkv, hd, max_ctx, he_attn_smem);                          \
    } else {                                                                                                \
      he_pdl_wait(); /* port.h: the position, q and the newest K/V row come from the kernels before */      \
      seq = he_ld_step(pos_p) + 1;                                                                          \
      he_attention_split_block<g, false, true>(q, k_cache, v_cache, partial, seq, kvh, split, nsplit, chunk, \
                                               nh, nkv, hd, max_ctx, he_attn_smem);                         \
    }                                                                                                       \
    if (he_arrive_last(count + kvh, (he_u32)nsplit))                                                        \
      he_attn_decode_combine<g>(q, k_cache, v_cache, partial, out, seq, kvh, nsplit, hd, max_ctx,           \
                                he_attn_smem);                                                              \
  }
HE_ATTN_DECODE_KERNEL(1)
HE_ATTN_DECODE_KERNEL(2)
HE_ATTN_DECODE_KERNEL(3)
HE_ATTN_DECODE_KERNEL(4)
HE_ATTN_DECODE_KERNEL(5)
HE_ATTN_DECODE_KERNEL(6)
HE_ATTN_DECODE_KERNEL(7)
HE_ATTN_DECODE_KERNEL(8)
#undef HE_ATTN_DECODE_KERNEL
#endif  // HE_IN_MONOKERNEL
#endif
