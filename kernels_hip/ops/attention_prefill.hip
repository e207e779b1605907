// Prefill attention on the matrix cores: a chunk of T query tokens against the KV cache, causal (query t
// sees positions [0, *pos + t]), grouped-query heads — the prefill's replacement for attention_split run
// once per query token (grid.y = T), which re-read every K/V row for each query and each scored it alone.
//
// Layouts are attention_decode.hip's: q fp32 [T][num_heads·hd], caches he_kv [num_kv_heads][max_ctx][hd],
// partial fp32 [T][num_heads][nsp][hd + 2] = (unnormalised o, m, l) per split in log2 units — so its
// attention_combine (grid (num_heads, T), nsplit = nsp) finishes the job unchanged.
//
// attention_prefill_g<G>: grid (num_kv_heads·nsp, ceil(T / (16·QT))), G·QT warps (one per query head of the
// KV group and 16-query tile; QT = he_ap_qtiles(G), 1 by default), dynamic shared memory he_ap_smem_bytes(G);
// the module built with HE_AP_HD = hd. A block takes 16·QT query tokens of its KV group against one split
// of the keys; the splits divide [0, *pos + T) into nsp ranges of whole 64-key steps (nsp ≤
// attention_decode.hip's kCombineBatch, so the combine folds all of them in one round trip; splits past a
// query's last key are empty, l = 0). Per 64-key step the block stages K (rows =
// keys: the B operand of S = Q·Kᵀ) and Vᵀ (rows = dims: the B operand of O += P·V) in shared memory; each warp
// takes S for its head on port.h's attention tiles (he_att_*), keeps it in registers, masks it (−inf) and runs
// the online softmax of its 16 queries there — row maxima and sums over the lanes that hold a query
// (shuffles), probabilities exp2(s − m) — rescales its O tile and adds P·V with P taken straight from the
// score registers as A fragments. (The first form kept S, P and the row states in shared memory: three
// barriers and a round trip through shared memory per step — the MIO-bound kernel of session 14's ncu
// reading.) Q (scaled by log2(e)/sqrt(hd) after the product) and P enter the matrix cores as hi/lo 16-bit
// pairs (he_mma_load_a_split, he_att_p_frag), K and V exactly, so scores and sums keep ~16 bits: the op tests
// hold the output to 1e-3 of the float64 reference (the decode kernels' fp32 math: 1e-4).
// Requirements: hd = HE_AP_HD (a multiple of 16, the module is built per head size), G ≤ 8.
#ifndef HE_OPS_ATTENTION_PREFILL_HIP
#define HE_OPS_ATTENTION_PREFILL_HIP
#include "port.h"

#ifndef HE_AP_HD
#define HE_AP_HD 64
#endif
constexpr int kApHd = HE_AP_HD;
// HE_AP_XSPLIT (ops.prefill_split): 1 takes Q and P as hi/lo pairs (above); 0 as one 16-bit value each.
#ifndef HE_AP_XSPLIT
#define HE_AP_XSPLIT 1
#endif
constexpr bool kApXSplit = HE_AP_XSPLIT != 0;
static_assert(kApHd % 16 == 0 && kApHd >= 16, "HE_AP_HD: a multiple of 16");
constexpr int kApKeys = 64;           // keys per step
constexpr int kApQ = 16;              // query tokens per warp
// HE_AP_QTILES (ops.ap_qtiles): 16-query tiles per block — warp w takes head w % G and tile w / G, so one
// staging of a step's K and Vᵀ serves 16·QT queries of each head (each block re-reads its split's K/V: the
// chunk's query tiles multiply the K/V traffic, from HBM once a context outgrows L2). Capped per group size at
// 16 warps and 1,024 threads (he_ap_qtiles; the host mirrors it). The sums per warp are the same at any QT.
#ifndef HE_AP_QTILES
#define HE_AP_QTILES 1
#endif
__host__ __device__ constexpr int he_ap_qtiles(int g) {  // both sides: launch bounds, templates
  const int cap = (16 / g < 1024 / (g * kWarpSize)) ? 16 / g : 1024 / (g * kWarpSize);
  return HE_AP_QTILES < cap ? HE_AP_QTILES : (cap > 1 ? cap : 1);
}
constexpr int kApKld = kApHd + 8;     // staged K row (16-bit elements): 16-byte rows, conflict-free B fragments
constexpr int kApVld = kApKeys + 8;   // staged Vᵀ row

// Dynamic shared memory of attention_prefill_g<G> (Ops.attention mirrors it: ap_shared_bytes): one step's K
// and Vᵀ (the scores and the softmax state live in registers; G does not matter).
HE_INLINE constexpr int he_ap_smem_bytes(int G) { return (void)G, kApKeys * kApKld * 2 + kApHd * kApVld * 2; }

template <int kG, int kQT>
HE_INLINE void he_attention_prefill_block(const float* q, const he_kv* k_cache, const he_kv* v_cache,
                                          float* partial, int pos, int T, int nsp, int nh, int max_ctx,
                                          char* smem) {
  static_assert(kG >= 1 && kG <= 8, "group size out of range");
  constexpr bool kF16 = HE_KV_F16 != 0;
  constexpr int kThreads = kG * kQT * kWarpSize;
  constexpr int kDt = kApHd / 16;    // 16-wide tiles of the head dimension
  constexpr int kKt = kApKeys / 16;  // 16-key tiles of a step
  he_u16* Ks = (he_u16*)smem;          // [kApKeys][kApKld]
  he_u16* Vt = Ks + kApKeys * kApKld;  // [kApHd][kApVld]
  const int tid = he_thread_idx(), g = he_warp_id() % kG;
  const int kvh = he_block_idx() / nsp, sp = he_block_idx() % nsp, tb = he_block_idx_y() * kApQ * kQT;
  const int t0 = tb + (he_warp_id() / kG) * kApQ;  // this warp's first query
  const int h = kvh * kG + g, qld = nh * kApHd;
  const int nq = (T - t0 < kApQ) ? (T - t0 > 0 ? T - t0 : 0) : kApQ;  // query rows of this warp
  // The split's keys: nsp ranges of whole steps over [0, pos + T); the block's queries see up to pos + tend.
  const int len = ((pos + T + nsp - 1) / nsp + kApKeys - 1) / kApKeys * kApKeys;
  const int ks = sp * len;
  const int tend = (T < tb + kApQ * kQT) ? T : tb + kApQ * kQT;
  const int kend = (ks + len < pos + tend) ? ks + len : pos + tend;  // the block's keys: [ks, kend)
  // partial row of query t0 + r: + r·(nh·nsp·(hd + 2)) floats
  float* pr = partial + (((he_i64)t0 * nh + h) * nsp + sp) * (kApHd + 2);
  const he_i64 pr_q = (he_i64)nh * nsp * (kApHd + 2);
  if (ks >= kend) {  // no key of this split is visible to these queries: empty for the combine
    for (int r = he_lane_id(); r < nq; r += kWarpSize) {
      pr[r * pr_q + kApHd] = he_neg_inf();
      pr[r * pr_q + kApHd + 1] = 0.f;
    }
    return;
  }
  HeMmaFrag qh[kDt], ql[kDt];
  const float* qt = q + (he_i64)t0 * qld + h * kApHd;
#pragma unroll
  for (int d = 0; d < kDt; ++d) he_mma_load_a_split<kF16>(qt + 16 * d, qld, qh[d], ql[d], nq);
  HeMmaAcc o[kDt];
#pragma unroll
  for (int d = 0; d < kDt; ++d) he_mma_zero(o[d]);
  float m[kAttQ], l[kAttQ];  // the running max (log2 units) and sum of this lane's queries
#pragma unroll
  for (int j = 0; j < kAttQ; ++j) m[j] = he_neg_inf(), l[j] = 0.f;
  const float qscale = he_rsqrt((float)kApHd) * kLog2e;
  const he_kv* kbase = k_cache + (he_i64)kvh * max_ctx * kApHd;
  const he_kv* vbase = v_cache + (he_i64)kvh * max_ctx * kApHd;
  constexpr int kVec = kApKeys * kApHd / 8;  // 16-byte vectors per K (or V) step

  for (int kb = ks; kb < kend; kb += kApKeys) {
    // K rows into Ks (asynchronous); keys at or past kend are zeros.
    for (int i = tid; i < kVec; i += kThreads) {
      const int key = i / (kApHd / 8), c = (i % (kApHd / 8)) * 8;
      const bool ok = kb + key < kend;
      he_cp_async16(Ks + key * kApKld + c, ok ? (const void*)(kbase + (he_i64)(kb + key) * kApHd + c)
                                             : (const void*)kbase, ok);
    }
    he_cp_async_commit();
    // V rows transposed into Vt: a lane takes two consecutive keys (kp) and 8 dims, so each store is a
    // 32-bit word (key pair) and the lanes of a store hit consecutive words — conflict-free. (One key per lane
    // and 16-bit stores put a warp's 8 dim groups on one bank: 8-way conflicts, 32 stores per lane per step.)
    for (int i = tid; i < kVec / 2; i += kThreads) {
      const int kp = i % (kApKeys / 2), c = (i / (kApKeys / 2)) * 8, k0 = kb + 2 * kp;
      const he_vec16 a = k0 < kend ? he_load16(vbase + (he_i64)k0 * kApHd + c) : he_vec16{0u, 0u, 0u, 0u};
      const he_vec16 b = k0 + 1 < kend ? he_load16(vbase + (he_i64)(k0 + 1) * kApHd + c) : he_vec16{0u, 0u, 0u, 0u};
      const he_u32 wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // dims c + 2j (the words' low halves) and c + 2j + 1 (high halves)
        *(he_u32*)(Vt + (c + 2 * j) * kApVld + 2 * kp) = (wa[j] & 0xffffu) | (wb[j] << 16);
        *(he_u32*)(Vt + (c + 2 * j + 1) * kApVld + 2 * kp) = (wa[j] >> 16) | (wb[j] & 0xffff0000u);
      }
    }
    he_cp_async_wait<0>();
    he_sync_block();
    // S = Q·Kᵀ for this warp's head, 16 queries × 64 keys in registers, scaled into log2 units and masked.
    HeMmaAcc sc[kKt];
#pragma unroll
    for (int j = 0; j < kKt; ++j) {
      he_mma_zero(sc[j]);
#pragma unroll
      for (int d = 0; d < kDt; ++d) {
        const HeMmaFrag b = he_mma_load_b(Ks + 16 * j * kApKld + 16 * d, kApKld);
        he_att_qk<kF16>(sc[j], qh[d], b);
        if constexpr (kApXSplit) he_att_qk<kF16>(sc[j], ql[d], b);
      }
    }
    float mx[kAttQ];
#pragma unroll
    for (int j = 0; j < kAttQ; ++j) mx[j] = he_neg_inf();
#pragma unroll
    for (int j = 0; j < kKt; ++j)
#pragma unroll
      for (int i = 0; i < kMmaAcc; ++i) {
        const int r = he_att_q(i), key = kb + 16 * j + he_att_c(i);
        const bool ok = r < nq && key < ks + len && key <= pos + t0 + r;  // key < kend follows
        sc[j].v[i] = ok ? sc[j].v[i] * qscale : he_neg_inf();
        mx[he_att_qi(i)] = he_fmax(mx[he_att_qi(i)], sc[j].v[i]);
      }
    // Online softmax: the step's max over the lanes of each query, probabilities in place, their sum.
    float alpha[kAttQ], sum[kAttQ];
#pragma unroll
    for (int j = 0; j < kAttQ; ++j) {
      const float mnew = he_fmax(m[j], he_att_row_max(mx[j]));
      alpha[j] = (m[j] == he_neg_inf()) ? 0.f : he_exp2(m[j] - mnew);
      m[j] = mnew;
      sum[j] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < kKt; ++j)
#pragma unroll
      for (int i = 0; i < kMmaAcc; ++i) {
        const float x = sc[j].v[i];
        const float pr_i = (x == he_neg_inf()) ? 0.f : he_exp2(x - m[he_att_qi(i)]);
        sc[j].v[i] = pr_i;
        sum[he_att_qi(i)] += pr_i;
      }
#pragma unroll
    for (int j = 0; j < kAttQ; ++j) l[j] = l[j] * alpha[j] + he_att_row_sum(sum[j]);
    // O = O·alpha + P·V, P straight from the score registers.
#pragma unroll
    for (int d = 0; d < kDt; ++d)
#pragma unroll
      for (int i = 0; i < kMmaAcc; ++i) o[d].v[i] *= alpha[he_att_qi(i)];
#pragma unroll
    for (int kk = 0; kk < kKt; ++kk) {
      HeMmaFrag ph, pl;
      he_att_p_frag<kF16>(sc[kk], ph, pl);
#pragma unroll
      for (int d = 0; d < kDt; ++d) {
        const HeMmaFrag b = he_mma_load_b(Vt + 16 * d * kApVld + 16 * kk, kApVld);
        he_att_pv<kF16>(o[d], ph, b);
        if constexpr (kApXSplit) he_att_pv<kF16>(o[d], pl, b);
      }
    }
    he_sync_block();  // Ks and Vt are rewritten by the next step
  }
  // This split's state for each (query, head): unnormalised o, then (m, l).
#pragma unroll
  for (int d = 0; d < kDt; ++d)
#pragma unroll
    for (int i = 0; i < kMmaAcc; ++i) {
      const int r = he_att_q(i);
      if (r < nq) pr[r * pr_q + 16 * d + he_att_c(i)] = o[d].v[i];
    }
  if (he_att_leader()) {
#pragma unroll
    for (int j = 0; j < kAttQ; ++j) {
      const int r = he_att_qrow(j);
      if (r < nq) {
        pr[r * pr_q + kApHd] = m[j];
        pr[r * pr_q + kApHd + 1] = l[j];
      }
    }
  }
}

// HE_AP_MIN_BLOCKS (ops.ap_defines, HIPENGINE_AP_MIN_BLOCKS): the warps of that many blocks of 4 warps kept
// resident per SM (the compiler caps the registers to fit). 4 at hd ≤ 64: 128 registers on NVIDIA, ~48 B of
// spills outside the step loop, where left to itself it takes 142 and fits 3 blocks (measured 8% slower at
// 1K, 6% at 32K: v44e); 0 (the compiler's choice) at larger hd, whose O and q fragments alone need more (hd
// 128 capped at 128 registers: 700 B of spills).
#ifndef HE_AP_MIN_BLOCKS
#define HE_AP_MIN_BLOCKS (HE_AP_HD <= 64 ? 4 : 0)
#endif
// As launch bounds: HE_AP_MIN_BLOCKS·4 warps in blocks of G·QT (at least one block); with 0, 8 warps (≤ 255
// registers: no cap).
constexpr int kApMinWarps = HE_AP_MIN_BLOCKS > 0 ? HE_AP_MIN_BLOCKS * 4 : 8;
__host__ __device__ constexpr int he_ap_min_blocks(int g) {
  return kApMinWarps >= g * he_ap_qtiles(g) ? kApMinWarps / (g * he_ap_qtiles(g)) : 1;
}
#define HE_AP_KERNEL(g)                                                                                     \
  constexpr int kApThreads##g = g * he_ap_qtiles(g) * kWarpSize, kApMinBlocks##g = he_ap_min_blocks(g);     \
  HE_KERNEL_MIN(kApThreads##g, kApMinBlocks##g)                                                             \
      attention_prefill_g##g(const float* q, const he_kv* k_cache, const he_kv* v_cache, float* partial,    \
                             const int* pos_p, int T, int nsp, int nh, int nkv, int hd, int max_ctx) {      \
    extern __shared__ he_vec16 he_ap_smem[];                                                                  \
    (void)nkv; (void)hd; /* = gridDim.x / nsp and HE_AP_HD: for the reader (and the host's emulation) */     \
    he_pdl_trigger();                                                                                         \
    he_pdl_wait(); /* port.h: the position, q and the chunk's K/V rows come from the kernels before */      \
    he_attention_prefill_block<g, he_ap_qtiles(g)>(q, k_cache, v_cache, partial, he_ld_step(pos_p), T, nsp,   \
                                                   nh, max_ctx, (char*)he_ap_smem);                           \
  }
HE_AP_KERNEL(1)
HE_AP_KERNEL(2)
HE_AP_KERNEL(3)
HE_AP_KERNEL(4)
HE_AP_KERNEL(5)
HE_AP_KERNEL(6)
HE_AP_KERNEL(7)
HE_AP_KERNEL(8)
#undef HE_AP_KERNEL
#endif
