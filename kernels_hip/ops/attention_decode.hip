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
constexpr bool kAttnWarpMax = HE_ATTN_WARP_MAX != 0;

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
template <int kG, bool kEarly = false, bool kTrigger = false>
// q, the caches and partial are rewritten inside the monokernel, so none is `const __restrict__` here (that
// lets the compiler use the non-coherent read-only path) and cache rows use the coherent streaming load.
HE_INLINE void he_attention_split_block(const float* q, const he_kv* k_cache,
                                        const he_kv* v_cache, float* partial, int seq,
                                        int kvh, int split, int nsplit, int chunk, int nh, int nkv, int hd,
                                        int max_ctx, float* smem) {
  static_assert(kG >= 1 && kG <= kAttnMaxGroup, "group size out of range");
  constexpr int G = kG, kL = kAttnLpr, kR = kWarpSize / kAttnLpr;  // lanes per row, rows per warp at once
  constexpr int U = kAttnUnroll;
  // kTrigger's place: before the wait, or (an early kernel in a HE_PDL_LATE build, port.h) right after it
  constexpr bool kTriggerBefore = kTrigger && !(kEarly && HE_PDL_LATE == 1), kTriggerAfter = kTrigger && !kTriggerBefore;
  (void)nkv;
  hd = he_attn_hd(hd);
  // the block is kAttnThreads wide in both paths (ops.ATTN_THREADS; decode.hip asserts kMkThreads): constants
  const int t = he_thread_idx();
  constexpr int nt = kAttnThreads, nw = kAttnWarps;
  chunk = he_attn_len(seq, nsplit, chunk);  // splits past the ones in use start past seq: empty
  const int start = split * chunk;
  const int n = start < seq ? (seq - start < chunk ? seq - start : chunk) : 0;
  if (n == 0) {  // nothing to attend in this split: mark it empty for the combine
    if (kTriggerBefore) he_pdl_trigger();
    if (kEarly) he_pdl_wait();  // partial is step data
    if (kTriggerAfter) he_pdl_trigger();
    for (int g = t; g < G; g += nt) {
      float* pr = partial + ((he_i64)(kvh * G + g) * nsplit + split) * (hd + 2);
      pr[hd] = he_neg_inf();
      pr[hd + 1] = 0.f;
    }
    return;
  }
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
  const int fresh = kEarly ? seq - 1 - start : -1;
  he_vec16 kb[U], vb[U];
#pragma unroll
  for (int j = 0; j < U; ++j) {
    const int p = w0 + rw + j * kR;
    const bool ok = p < w1 && dim_ok && (!kEarly || p != fresh);
    kb[j] = ok ? he_load16_stream_rw(kbase + (he_i64)p * hd) : he_vec16{0u, 0u, 0u, 0u};
    vb[j] = ok ? he_load16_stream_rw(vbase + (he_i64)p * hd) : he_vec16{0u, 0u, 0u, 0u};
  }
  if (kTriggerBefore) he_pdl_trigger();
  if (kEarly) {
    he_pdl_wait();  // port.h: the previous kernel (QKV) has completed; its writes are visible
    if (kTriggerAfter) he_pdl_trigger();
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int p = w0 + rw + j * kR;
      if (p == fresh && p < w1 && dim_ok) {
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
  for (int i = t; i < G * hd; i += nt) {
    const int g = i / hd, d = i % hd;
    float M = he_neg_inf();
    for (int w = 0; w < nw; ++w) M = he_fmax(M, ws[(w * G + g) * (hd + 2) + hd]);
    float acc = 0.f, L = 0.f;
    for (int w = 0; w < nw; ++w) {
      const float* st = ws + (w * G + g) * (hd + 2);
      const float sc = (st[hd] == he_neg_inf()) ? 0.f : he_exp2(st[hd] - M);
      acc += st[d] * sc;
      L += st[hd + 1] * sc;
    }
    float* pr = partial + ((he_i64)(kvh * G + g) * nsplit + split) * (hd + 2);
    pr[d] = acc;
    if (d == 0) { pr[hd] = M; pr[hd + 1] = L; }
  }
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

HE_KERNEL(256) attention_combine(const float* partial, const int* pos_p, int nsplit,
                                 int nh, int hd, float* __restrict__ out, int early_pos) {
  // The next kernel (the O-proj) may launch at once and request its weights during the splits: on this path
  // that measured faster than launching it after them (docs/perf-log.md v33), unlike the monokernel's v24.
  he_pdl_trigger_top();
  const int h = he_block_idx(), tq = he_block_idx_y();
  int seq = 0;
  if (early_pos) seq = he_attn_early_pos(pos_p) + tq + 1;
  he_pdl_wait();  // port.h: everything below reads or writes step data
  he_pdl_trigger_late();
  if (!early_pos) seq = he_ld_step(pos_p) + tq + 1;
  he_attention_combine(partial + ((he_i64)tq * nh + h) * nsplit * (hd + 2), 1, nsplit, seq, hd,
                       out + ((he_i64)tq * nh + h) * hd);
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
      he_attention_combine(partial + (he_i64)kvh * (g) * nsplit * (hd + 2), (g), nsplit, seq, hd,           \
                           out + (he_i64)kvh * (g) * hd);                                                   \
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
