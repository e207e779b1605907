// Tensor parallelism inside the monokernel: included by decode.hip after the MkParams layout (not a unit of its own).
//
// Each rank runs the monokernel on its shard (hipengine/comm/shard.py: its query/KV heads, its FFN columns,
// its vocabulary slice of the LM head). What crosses GPUs per decode step: the O-proj and down-proj
// partial sums (d floats per rank, twice per layer) and one greedy candidate per rank. They travel as LL
// ("low latency") words, the protocol of comm/allreduce.hip's ar_ll_block: every 4-byte value is sent as
// one 8-byte store {payload, epoch}, which is single-copy atomic (aligned; NVLink and xGMI carry it whole),
// so a reader that sees its epoch in the high half holds that round's payload in the low half — no flag,
// no fence, no barrier. The matvec epilogue pushes each row straight into every rank's region as it is
// computed, so the transfer overlaps the rest of the stage.
//
// The LL region of every rank (p.tp_ll[s] = rank s's base, peer-mapped; fine-grained memory on AMD), u64:
//   [kMkLlO][world][d]  O-proj partials, slot s = rank s's rows
//   [kMkLlD][world][d]  down-proj partials
//   [kMkLlC][world][2]  greedy candidates: (logit bits, global index | cancel << 31)
// The host zeroes it before every launch; each use of a region carries that region's next epoch (1, 2, ...),
// counted identically on every rank (all ranks run the same control flow).
//
// The stage after O-proj / down-proj needs every row of the sum, so each block gathers the whole vector
// itself (mk_ll_gather: poll each word until its epoch arrives, add the ranks' terms in rank order) and
// the two grid barriers that used to publish x (after O-proj and after down-proj) are gone: at tp > 1 a
// layer crosses 2 grid barriers instead of 4. The same exchange with world = 1 (the host's
// HIPENGINE_MK_LL=1) removes those barriers on one GPU; its sums are 0.f + v = v, bit-identical to tp = 1.
//
// Reusing a slot without double buffering is safe: rank s writes region O for layer l+1 only after its
// QKV(l+1) gathered our down(l) rows, and we push those only after our gate/up(l) -> down(l) grid barrier,
// i.e. after every one of our blocks finished gathering O(l). (A block that owns rows pushes them only after
// its own gather anyway; the barrier is what covers blocks that own none — e.g. 1,024 O-proj units for
// 1,056 warps.) The same argument with O and D swapped (through our QKV(l+1) -> attention barrier) covers
// D; C is rewritten a whole decode step later. tests/test_tp_exchange_protocol.py runs this protocol as a
// CPU model (2/4/8 ranks, random delays) and catches the variants that break it.
//
// Summation order: rank 0's term carries the residual (x + W_0·a, computed as at tp = 1) and the terms
// are added in rank order starting from 0.f — the per-op TP path's order (ArF32 in comm/allreduce.hip), so
// every rank holds the same bits and the monokernel reproduces the per-op TP path token for token.
enum MkLlRegion { kMkLlO = 0, kMkLlD = 1, kMkLlC = 2 };

HE_INLINE he_u64 mk_ll_word(he_u32 payload, he_u32 epoch) { return ((he_u64)epoch << 32) | payload; }

// Word offset of (region, source slot) inside every rank's LL region.
HE_INLINE he_u64 mk_ll_off(const MkParams& p, int region, int src) {
  return (he_u64)region * p.tp_world * p.d + (he_u64)src * (region == kMkLlC ? 2 : p.d);
}

// O-proj / down-proj (y = W·a + residual). ll == nullptr: HeMvPlain's own epilogue (tp = 1). Otherwise row
// r's value goes, as an LL word of `epoch`, to word off + r of every rank's region (ll = p.tp_ll), this
// rank's included; y is not written.
struct MkMvOut : HeMvPlain {
  const he_u64* ll;
  he_u64 off;
  int world;
  he_u32 epoch;
  HE_INLINE void epi(int u, const float (&acc)[2], const float (&pv)[2]) const {  // pv: HeMvPlain::pre
    if (ll == nullptr) { HeMvPlain::epi(u, acc, pv); return; }
    if (he_lane_id() != 0) return;
    const int r0 = 2 * u, r1 = r0 + 1;
    const bool two = r1 < n_rows;
    const he_u64 w0 = mk_ll_word(he_f32_as_u32(acc[0] + pv[0]), epoch);
    const he_u64 w1 = two ? mk_ll_word(he_f32_as_u32(acc[1] + pv[1]), epoch) : 0ull;
    for (int s = 0; s < world; ++s) {
      volatile he_u64* dst = (volatile he_u64*)ll[s] + off;
      dst[r0] = w0;
      if (two) dst[r1] = w1;
    }
  }
};

// Spin on one LL word until it carries `epoch` (volatile: every poll is a fresh load past the non-coherent
// caches). False on timeout (reported) or when another block gave up.
HE_INLINE bool mk_ll_wait(const HeWaitCtx& w, const volatile he_u64* p, he_u32 epoch, he_u64& v) {
  const he_u64 t0 = he_clock_ns();
  for (int polls = 1;; ++polls) {
    v = *p;
    if ((he_u32)(v >> 32) == epoch) return true;
    if (polls % kPollsPerClock == 0) {
      if (he_aborted(w)) return false;
      if (he_clock_ns() - t0 > w.timeout_ns) {
        he_report_error(w, kStatusPeerTimeout);
        return false;
      }
    }
  }
}

// xs[i] = sum over ranks s = 0..world-1 of region[s][i], i < d (whole block; `out`, when not null, gets the
// same values: block 0's copy of the residual stream). Each thread issues the loads of kB elements of kW
// sources before checking any, so a pass costs one round trip when the words are there. Returns false
// (block-uniform) if the kernel must end.
template <int kW>
HE_INLINE bool mk_ll_gather(const MkParams& p, const HeWaitCtx& w, int region, he_u32 epoch, float* xs, float* out) {
  constexpr int kB = 8;
  __shared__ int mk_ll_ok;
  const int t = he_thread_idx(), nt = he_block_dim(), n = p.d, world = p.tp_world;
  const volatile he_u64* base = (const volatile he_u64*)p.tp_ll[p.tp_rank] + mk_ll_off(p, region, 0);
  he_sync_block();  // xs is still being read by slower warps of the previous matvec
  if (t == 0) mk_ll_ok = 1;
  he_sync_block();
  bool ok = true;
  for (int i0 = t; i0 < n && ok; i0 += kB * nt) {
    float acc[kB];
#pragma unroll
    for (int b = 0; b < kB; ++b) acc[b] = 0.f;
    for (int s0 = 0; s0 < world && ok; s0 += kW) {
      he_u64 v[kW][kB];
#pragma unroll
      for (int k = 0; k < kW; ++k)
#pragma unroll
        for (int b = 0; b < kB; ++b) {
          const int i = i0 + b * nt;
          v[k][b] = (s0 + k < world && i < n) ? base[(he_u64)(s0 + k) * n + i] : mk_ll_word(0u, epoch);
        }
#pragma unroll
      for (int k = 0; k < kW; ++k)
#pragma unroll
        for (int b = 0; b < kB; ++b) {
          const int i = i0 + b * nt;
          if (ok && (he_u32)(v[k][b] >> 32) != epoch) ok = mk_ll_wait(w, base + (he_u64)(s0 + k) * n + i, epoch, v[k][b]);
          if (s0 + k < world) acc[b] += he_u32_as_f32((he_u32)v[k][b]);
        }
    }
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      const int i = i0 + b * nt;
      if (i < n) {
        xs[i] = acc[b];
        if (out) out[i] = acc[b];
      }
    }
  }
  if (!ok) mk_ll_ok = 0;
  he_sync_block();
  const bool all = mk_ll_ok != 0;
  he_sync_block();
  return all;
}

HE_INLINE bool mk_ll_gather(const MkParams& p, const HeWaitCtx& w, int region, he_u32 epoch, float* xs, float* out) {
  return p.tp_world == 2 ? mk_ll_gather<2>(p, w, region, epoch, xs, out) : mk_ll_gather<1>(p, w, region, epoch, xs, out);
}

// Greedy pick across ranks, by the block that leads this token on every rank. Thread 0 publishes this
// rank's candidate (best logit, global index) with its cancel word into slot `rank` of every rank's C
// region, then reads all slots in rank order and keeps the larger logit, ties to the smaller index — the
// slices are in rank order, so this is the first maximum over the whole vocabulary, as np.argmax — and
// ORs the cancel words into state.cancel, so every rank takes the same stop decision. Whole block.
HE_INLINE bool mk_ll_pick(const MkParams& p, const HeWaitCtx& w, he_u32 epoch, float best, int bi, int& tok) {
  __shared__ int pick_s, ok_s;
  if (he_thread_idx() == 0) {
    const he_u32 gi = bi == 0x7fffffff ? (he_u32)bi : (he_u32)(bi + p.vocab_off);
    const he_u32 c = p.state->cancel != 0 ? 0x80000000u : 0u;
    const he_u64 off = mk_ll_off(p, kMkLlC, p.tp_rank);
    for (int s = 0; s < p.tp_world; ++s) {
      volatile he_u64* dst = (volatile he_u64*)p.tp_ll[s] + off;
      dst[0] = mk_ll_word(he_f32_as_u32(best), epoch);
      dst[1] = mk_ll_word(gi | c, epoch);
    }
    const volatile he_u64* src = (const volatile he_u64*)p.tp_ll[p.tp_rank] + mk_ll_off(p, kMkLlC, 0);
    float gb = he_neg_inf();
    int gidx = 0x7fffffff, cancel = 0;
    bool ok = true;
    for (int s = 0; s < p.tp_world && ok; ++s) {
      he_u64 a = 0, b = 0;
      ok = mk_ll_wait(w, src + 2 * s, epoch, a) && mk_ll_wait(w, src + 2 * s + 1, epoch, b);
      const float v = he_u32_as_f32((he_u32)a);
      const int i = (int)((he_u32)b & 0x7fffffffu);
      cancel |= ((he_u32)b >> 31) != 0;
      if (v > gb || (v == gb && i < gidx)) { gb = v; gidx = i; }
    }
    p.state->cancel = cancel;
    pick_s = gidx;
    ok_s = ok;
  }
  he_sync_block();
  tok = pick_s;
  const bool ok = ok_s != 0;
  he_sync_block();
  return ok;
}
