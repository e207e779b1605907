// Token selection on the device: greedy argmax and temperature / top-k / top-p / min-p / repetition-penalty
// sampling with a counter-based RNG, so the decode loop never ships the 128K-entry logits to the host.
//
// Semantics (the numpy oracle in hipengine/gpu/ops.py mirrors them line by line):
//   1. repetition penalty over the set of tokens in `history` (each token once, however often it occurs):
//      z = l / rp if l > 0 else l · rp                             (HF RepetitionPenaltyLogitsProcessor)
//   2. temperature == 0 → argmax of z (first index on ties) and stop.
//   3. z /= temperature;  m = max z;  weights e_i = exp(z_i − m)
//   4. top-k: keep z_i ≥ t_k, the largest threshold keeping ≥ k tokens (ties at the boundary all kept)
//   5. top-p: among kept, keep z_i ≥ t_p, the largest threshold whose kept mass ≥ top_p · (kept mass)
//   6. min-p: keep e_i ≥ min_p (e is relative to the top token, which is always kept)
//   7. draw u = Philox4x32-10(key = seed, counter = (step, 0, 0, 0)).x / 2^32 (top 24 bits), and return
//      the first kept index i (in index order) whose running sum of kept weights exceeds u · Σ kept.
// Thresholds are found by bisection on the value axis (each probe a block-wide count or sum), which needs
// no sort and no scratch beyond one fp32 copy of the logits.
// One block of kSampleThreads threads does everything (one SM; ~128 values per thread for a 128K vocab).
#ifndef HE_OPS_SAMPLING_HIP
#define HE_OPS_SAMPLING_HIP
#include "port.h"

constexpr int kSampleThreads = 1024;
constexpr int kBisectIters = 32;   // halvings of the value range: below fp32 resolution of the logits
constexpr int kWordBits = 32;      // bits per bitmap word (not a warp width)

// Philox4x32-10 (Salmon et al., SC'11): 10 rounds of multiply-xor on a 128-bit counter with a 64-bit key.
HE_INLINE void he_philox4x32_10(he_u32 (&c)[4], he_u32 k0, he_u32 k1) {
  for (int r = 0; r < 10; ++r) {
    const he_u64 p0 = (he_u64)0xD2511F53u * c[0], p1 = (he_u64)0xCD9E8D57u * c[2];
    const he_u32 hi0 = (he_u32)(p0 >> kWordBits), lo0 = (he_u32)p0, hi1 = (he_u32)(p1 >> kWordBits), lo1 = (he_u32)p1;
    c[0] = hi1 ^ c[1] ^ k0;
    c[1] = lo1;
    c[2] = hi0 ^ c[3] ^ k1;
    c[3] = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}

// Block-wide arg-max of every thread's (best, bi): on return every thread holds the block's. Ties go to the
// smaller index and NaN never wins (`>`), so with threads that scan in index order the result is the first
// index of the maximum — the rule of every greedy pick here (one-block sampler, grid-wide selections).
// wv / wi: __shared__ [kMaxWarpsPerBlock].
HE_INLINE void he_block_argmax(float& best, int& bi, float* wv, int* wi) {
  he_warp_argmax(best, bi);
  if (he_lane_id() == 0) { wv[he_warp_id()] = best; wi[he_warp_id()] = bi; }
  he_sync_block();
  best = wv[0];
  bi = wi[0];
  for (int w = 1; w < he_num_warps(); ++w)
    if (wv[w] > best || (wv[w] == best && wi[w] < bi)) { best = wv[w]; bi = wi[w]; }
  he_sync_block();
}

// Block-wide (count, sum of weights) of kept entries with z ≥ thr.
HE_INLINE void he_kept_stats(const float* z, int n, float m, float thr, float& count, float& mass, float* scratch) {
  float c = 0.f, s = 0.f;
  for (int i = he_thread_idx(); i < n; i += he_block_dim()) {
    const float v = z[i];
    if (v >= thr) { c += 1.f; s += he_exp(v - m); }
  }
  count = he_block_sum(c, scratch);
  mass = he_block_sum(s, scratch);
}

// Shared memory: kMaxWarpsPerBlock floats of scratch + kSampleThreads floats of slice sums + the history
// bitmap (ceil(n/32) words) as dynamic shared memory.
// logits and history are rewritten inside the monokernel: plain pointers (no non-coherent read-only path).
HE_INLINE int he_sample_block(const float* logits, int n, const int* history,
                              int hist_len, float temperature, int top_k, float top_p, float min_p, float rep_pen,
                              he_u32 seed_lo, he_u32 seed_hi, he_u32 step, float* z, float* scratch,
                              float* slice_sums, he_u32* bitmap) {
  const int t = he_thread_idx(), nt = he_block_dim();
  const int words = (n + kWordBits - 1) / kWordBits;
  const bool penalize = rep_pen != 1.f && hist_len > 0;
  if (penalize) {
    for (int w = t; w < words; w += nt) bitmap[w] = 0u;
    he_sync_block();
    for (int j = t; j < hist_len; j += nt) {
      const int tok = history[j];
      if (tok >= 0 && tok < n) he_atomic_or_relaxed_block(&bitmap[tok / kWordBits], 1u << (tok % kWordBits));
    }
    he_sync_block();
  }
  const float inv_t = temperature > 0.f ? 1.f / temperature : 1.f;
  float best = he_neg_inf();
  int best_i = 0x7fffffff;
  for (int i = t; i < n; i += nt) {
    float v = logits[i];
    if (penalize && ((bitmap[i / kWordBits] >> (i % kWordBits)) & 1u)) v = v > 0.f ? v / rep_pen : v * rep_pen;
    if (temperature > 0.f) v *= inv_t;
    z[i] = v;
    if (v > best) { best = v; best_i = i; }  // strided order: first index wins within a thread
  }
  // block argmax (ties → smaller index)
  __shared__ float am_v[kMaxWarpsPerBlock];
  __shared__ int am_i[kMaxWarpsPerBlock];
  he_block_argmax(best, best_i, am_v, am_i);
  const float m = best;
  const int arg = best_i;
  if (!(temperature > 0.f)) return arg;

  // thresholds on z (all threads compute the same values: the reductions broadcast)
  float local_min = -he_neg_inf();
  for (int i = t; i < n; i += nt) local_min = he_fmin(local_min, z[i]);
  const float zmin = -he_block_max(-local_min, scratch);
  float thr = zmin;  // the kept set is z ≥ thr; start with everything
  float count, mass;
  if (top_k > 0 && top_k < n) {
    float a = zmin, b = m;  // invariant: count(z ≥ a) ≥ k
    for (int it = 0; it < kBisectIters; ++it) {
      const float mid = 0.5f * (a + b);
      he_kept_stats(z, n, m, mid, count, mass, scratch);
      if (count >= (float)top_k) a = mid; else b = mid;
    }
    thr = a;
  }
  if (top_p < 1.f) {
    he_kept_stats(z, n, m, thr, count, mass, scratch);
    const float target = top_p * mass;
    float a = thr, b = m;  // invariant: mass(z ≥ a) ≥ target
    for (int it = 0; it < kBisectIters; ++it) {
      const float mid = 0.5f * (a + b);
      float c2, m2;
      he_kept_stats(z, n, m, mid, c2, m2, scratch);
      if (m2 >= target) a = mid; else b = mid;
    }
    thr = a;
  }
  if (min_p > 0.f) thr = he_fmax(thr, m + he_log2(min_p) / kLog2e);  // e^(z−m) ≥ min_p
  thr = he_fmin(thr, m);                                               // the top token is always kept

  // inverse CDF in index order: each thread owns a contiguous slice
  const int per = (n + nt - 1) / nt;
  const int b0 = t * per, b1 = (b0 + per < n) ? b0 + per : n;
  float s = 0.f;
  for (int i = b0; i < b1; ++i) if (z[i] >= thr) s += he_exp(z[i] - m);
  slice_sums[t] = s;
  he_sync_block();
  __shared__ int chosen;
  __shared__ float prefix_base;
  if (t == 0) {
    he_u32 c[4] = {step, 0u, 0u, 0u};
    he_philox4x32_10(c, seed_lo, seed_hi);
    const float u = (float)(c[0] >> 8) * (1.f / 16777216.f);
    float total = 0.f;
    for (int j = 0; j < nt; ++j) total += slice_sums[j];
    const float target = u * total;
    float run = 0.f;
    int owner = -1;
    for (int j = 0; j < nt; ++j) {
      if (slice_sums[j] > 0.f) {
        if (target < run + slice_sums[j]) { owner = j; break; }
        owner = j;  // rounding fallback: the last non-empty slice
      }
      run += slice_sums[j];
    }
    if (owner >= 0 && !(target < run + slice_sums[owner])) run -= slice_sums[owner];
    chosen = owner;
    prefix_base = target - run;  // remaining mass to walk inside the owner's slice
  }
  he_sync_block();
  __shared__ int result;
  if (t == chosen) {
    float left = prefix_base;
    int last = -1, pick = -1;
    for (int i = b0; i < b1; ++i) {
      if (z[i] >= thr) {
        last = i;
        left -= he_exp(z[i] - m);
        if (left < 0.f) { pick = i; break; }
      }
    }
    result = pick >= 0 ? pick : last;
  }
  he_sync_block();
  return chosen >= 0 ? result : arg;
}

// Samples one token from logits [n]. history [hist_len] int32: tokens seen so far (prompt + generated),
// for the repetition penalty. seed (64 bits as two words) and step (position) key the RNG, so the same
// request replays the same tokens. Writes out_token[0]; z [n] is fp32 scratch (may alias logits).
HE_KERNEL(1024) sample(const float* logits, int n, const int* history, const int* hist_len_p,
                       float temperature, int top_k, float top_p, float min_p, float rep_pen, he_u32 seed_lo,
                       he_u32 seed_hi, const int* step_p, int* __restrict__ out_token, float* z) {
  he_pdl_trigger();
  he_pdl_wait();  // port.h: everything below reads or writes step data
  extern __shared__ he_u32 he_bitmap[];
  __shared__ float scratch[kMaxWarpsPerBlock];
  __shared__ float slice_sums[kSampleThreads];
  const int tok = he_sample_block(logits, n, history, he_ld_step(hist_len_p), temperature, top_k, top_p, min_p,
                                  rep_pen, seed_lo, seed_hi, (he_u32)he_ld_step(step_p), z, scratch, slice_sums,
                                  he_bitmap);
  if (he_thread_idx() == 0) out_token[0] = tok;
}

// Greedy selection spread over the grid (the per-op path; the monokernel does the same inside its token
// selection, mk_argmax_grid). argmax_blocks: block b arg-maxes the contiguous slice [b·per, (b+1)·per) of
// logits[n] (per = ceil(n / grid)) and writes its candidate (value, index bits) to cand[2b], cand[2b + 1];
// argmax_pick (one block) reduces the nb candidates in block order — index order — and writes out_token[0].
// Same tie and NaN rule as the one-block sampler's greedy path (he_block_argmax), so the same token, without
// one SM streaming the whole 0.5 MB of a 128K vocabulary's logits (≈ 33 µs per token on H200).
HE_KERNEL(kMaxBlockThreads) argmax_blocks(const float* logits, int n, float* __restrict__ cand) {
  __shared__ float wv[kMaxWarpsPerBlock];
  __shared__ int wi[kMaxWarpsPerBlock];
  he_pdl_trigger();
  he_pdl_wait();  // port.h: the logits come from the kernel before
  const int nb = he_grid_dim(), t = he_thread_idx(), nt = he_block_dim();
  const int per = (n + nb - 1) / nb, b0 = he_block_idx() * per;
  const int b1 = b0 + per < n ? b0 + per : n;
  float best = he_neg_inf();
  int bi = 0x7fffffff;
  for (int i = b0 + t; i < b1; i += nt) {
    const float v = logits[i];
    if (v > best) { best = v; bi = i; }
  }
  he_block_argmax(best, bi, wv, wi);
  if (t == 0) {
    cand[2 * he_block_idx()] = best;
    cand[2 * he_block_idx() + 1] = he_u32_as_f32((he_u32)bi);
  }
}

// argmax_pick's fold: the first index of the largest of argmax_blocks' nb candidates (every thread gets it).
HE_INLINE int he_argmax_fold(const float* cand, int nb, float* wv, int* wi) {
  float best = he_neg_inf();
  int bi = 0x7fffffff;
  for (int b = he_thread_idx(); b < nb; b += he_block_dim()) {
    const float v = cand[2 * b];
    const int i = (int)he_f32_as_u32(cand[2 * b + 1]);
    if (v > best || (v == best && i < bi)) { best = v; bi = i; }
  }
  he_block_argmax(best, bi, wv, wi);
  return bi;
}

HE_KERNEL(kMaxBlockThreads) argmax_pick(const float* cand, int nb, int* __restrict__ out_token) {
  __shared__ float wv[kMaxWarpsPerBlock];
  __shared__ int wi[kMaxWarpsPerBlock];
  he_pdl_trigger();
  he_pdl_wait();  // port.h: the candidates come from argmax_blocks
  const int bi = he_argmax_fold(cand, nb, wv, wi);
  if (he_thread_idx() == 0) out_token[0] = bi;
}

// End of a decode step, on the device: the sampled token becomes the next step's input and joins the
// history; the position advances. One thread. Keeps the captured graph's arguments constant.
HE_INLINE void he_decode_advance(int token, int* history, int* hist_len, int* pos, int hist_cap) {
  const int h = *hist_len;
  if (h < hist_cap) { history[h] = token; *hist_len = h + 1; }
  *pos = *pos + 1;
}

HE_KERNEL(kMaxBlockThreads) decode_advance(const int* token, int* __restrict__ history, int* __restrict__ hist_len,
                             int* __restrict__ pos, int hist_cap) {
  he_pdl_trigger();
  he_pdl_wait();  // port.h: everything below reads or writes step data
  if (he_thread_idx() != 0) return;
  he_decode_advance(he_ld_step(token), history, hist_len, pos, hist_cap);
}

// Hand the sampled token to the host without a synchronisation (the per-op path's generation loop,
// GpuBackend.generate_from_state): host_words is mapped host memory, [0] the count of tokens written,
// [1 + i] token i. The token goes into its slot with a plain store, then the count with a system-scope
// release, so a host that reads count n (and then the slots below it) sees those tokens. `count` is the
// device's copy of the index (zeroed by the host per request). One thread.
HE_INLINE void he_emit_token(int token, int* count, int* host_words, int cap) {
  const int n = *count;
  if (n >= cap) return;  // the host sizes cap for the request; it reports a missing token as an error
  host_words[1 + n] = token;
  *count = n + 1;
  he_store_release_system((he_u32*)host_words, (he_u32)(n + 1));
}

HE_KERNEL(kMaxBlockThreads) emit_token(const int* token, int* __restrict__ count, int* host_words,
                                       int cap) {
  he_pdl_trigger();
  he_pdl_wait();  // port.h: everything below reads or writes step data
  if (he_thread_idx() != 0) return;
  he_emit_token(he_ld_step(token), count, host_words, cap);
}

// The greedy step's end in one launch (the per-op path; Ops.argmax_step): decode_advance for the token the
// step consumed, argmax_pick over argmax_blocks' candidates into *token, emit_token of it — three one-block
// kernels, two launch hops fewer per token. Thread 0 reads the consumed token before it writes the new
// one; the other effects are the three kernels' own, in their order. Not in the monokernel's module.
#ifndef HE_IN_MONOKERNEL
HE_KERNEL(kMaxBlockThreads) argmax_pick_step(const float* cand, int nb, int* __restrict__ token,
                                             int* __restrict__ history, int* __restrict__ hist_len,
                                             int* __restrict__ pos, int hist_cap, int* __restrict__ count,
                                             int* host_words, int cap) {
  __shared__ float wv[kMaxWarpsPerBlock];
  __shared__ int wi[kMaxWarpsPerBlock];
  he_pdl_trigger();
  he_pdl_wait();  // port.h: the candidates and the step's token come from the kernels before
  if (he_thread_idx() == 0) he_decode_advance(he_ld_step(token), history, hist_len, pos, hist_cap);
  const int bi = he_argmax_fold(cand, nb, wv, wi);
  if (he_thread_idx() == 0) {
    *token = bi;
    he_emit_token(bi, count, host_words, cap);
  }
}
#endif
#endif
