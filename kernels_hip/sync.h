// kernels_hip/sync.h — grid-wide synchronisation for persistent kernels (the monokernel), built only on
// port.h's scoped atomics and fences.
//
// Everything here assumes every block of the grid is resident at once (cooperative launch, grid sized from
// the occupancy query): a block spinning on a flag must never keep the block that would set it off the GPU.
//
// Every wait is bounded. A wait that outlives `timeout_ns` (he_clock_ns) writes an error code into the
// status word and raises the abort word, then returns false; callers return from the kernel, and every
// other block's waits see the abort word and leave too, so a protocol bug (or a block that faulted) ends
// the kernel with a reported error instead of hanging the process. The host turns the code into a
// DeviceError (hipengine/gpu/monokernel.py).
//
// Memory-order argument, once for the whole file (each flag below says which case it is):
//   * Data published to other blocks is written with plain stores, then the writer block's threads meet in
//     he_sync_block() (block-scope acq_rel: the block's stores happen-before thread 0's next access), then
//     thread 0 performs a device-scope RELEASE (fetch_add / store). A reader's thread 0 performs a
//     device-scope ACQUIRE load that observes that value (or a later value of the same counter, which is a
//     release sequence of RMWs), then he_sync_block() hands the ordering to the rest of its block. By
//     causality every plain store before the release is visible to every plain load after the acquire.
//   * On NVIDIA the acquire at gpu scope also invalidates the reader SM's L1, so plain (L1-cached) loads of
//     activations rewritten every stage stay coherent; on AMD the agent-scope acquire does the same for the
//     CU's vector L0/L1. Streaming loads (he_load16_stream) are only used on data no block writes during
//     the kernel, or on KV rows first read after the write (no stale line can exist, see decode.hip).
#pragma once
#include "port.h"

// Error codes written into the status word (the host maps them to messages; keep in sync with
// MK_STATUS in hipengine/gpu/monokernel.py — the layout test checks these numbers).
constexpr he_u32 kStatusRunning = 0;
constexpr he_u32 kStatusDone = 1;
constexpr he_u32 kStatusBarrierTimeout = 2;
constexpr he_u32 kStatusCounterTimeout = 3;
constexpr he_u32 kStatusAborted = 4;  // another block reported an error first
constexpr he_u32 kStatusPeerTimeout = 5;  // tensor parallelism: a peer GPU's words never arrived (monokernel/tp_exchange.h)

// How many polls between clock reads (the clock read is slower than an L2 poll on both vendors).
constexpr int kPollsPerClock = 64;

// Shared state of one grid barrier, in device memory, zeroed by the host before the launch.
//   count  : total arrivals since the launch, monotone (never reset). Arrival is an add with release at
//            device scope (publishes this block's stage outputs; the RMWs form a release sequence,
//            so a reader that observes the final value synchronises with every arriver). Barrier k (k = 1,
//            2, ...) is open once count >= k * nblocks: waiters poll count itself with device-scope ACQUIRE
//            loads. Polling the counter rather than a separate "epoch" word that the last arriver writes
//            saves one dependent L2 round trip per barrier (the last arrival opens it directly). 32-bit
//            wrap-around is harmless: comparisons are on the signed difference.
//   epoch  : unused (kept so the 16-byte layout the host zeroes stays fixed).
//   abort  : non-zero once any block gave up. Relaxed loads in every poll (it only tells waiters to leave;
//            no data is published through it); written with a release store by the block that failed.
struct HeGridBarrier {
  he_u32 count;
  he_u32 epoch;
  he_u32 abort;
  he_u32 pad;
};

// Per-thread view of a wait's deadline and where to report a failure.
struct HeWaitCtx {
  HeGridBarrier* bar;   // device memory
  he_u32* status;       // host-mapped status word (system scope: the host polls it without a sync)
  he_u64 timeout_ns;
  he_u32 sleep_ns;      // back-off between polls (0: spin); hundreds of pollers on one L2 line compete with
                        // the arrivals they wait for
};

// Record the first error: status is written at system scope so the host sees it even while the kernel is
// still tearing down; the abort word (device scope) makes every other block's waits return at once.
HE_INLINE void he_report_error(const HeWaitCtx& w, he_u32 code) {
  he_store_release_system(w.status, code);
  he_store_release_device(&w.bar->abort, 1u);
}

HE_INLINE bool he_aborted(const HeWaitCtx& w) { return he_load_relaxed_device(&w.bar->abort) != 0u; }

// Wait (one thread) until *flag >= target, comparing with wrap-around so monotone 32-bit counters may wrap.
// Acquire at device scope on success (the flag's writer used a device-scope release). Returns false on
// timeout (after reporting `code`) or when another block aborted.
HE_INLINE bool he_wait_geq_device(const HeWaitCtx& w, const he_u32* flag, he_u32 target, he_u32 code) {
  if ((int)(he_load_acquire_device(flag) - target) >= 0) return true;
  const he_u64 t0 = he_clock_ns();
  for (int polls = 0;; ++polls) {
    if ((int)(he_load_acquire_device(flag) - target) >= 0) return true;
    if (he_aborted(w)) return false;
    if (w.sleep_ns) he_sleep(w.sleep_ns);
    if (polls % kPollsPerClock == 0 && he_clock_ns() - t0 > w.timeout_ns) {
      he_report_error(w, code);
      return false;
    }
  }
}

// Grid barrier. All threads of every block call it (it contains he_sync_block). `epoch` is this block's
// count of barriers passed (kept in a register by the caller, identical in every thread; all blocks pass
// the same barriers in the same order). Returns false if the kernel must end (timeout/abort); the result is
// the same in every thread of the block.
//
// Split in two so a caller can overlap the wait with independent work (the monokernel requests the next
// stage's weights between the two): he_grid_arrive() then he_grid_wait(); he_grid_barrier() is both.
// One thread publishes with a device-scope release: a release-only reduction (red.release), so the thread
// does not wait for the atomic's reply (nor order its later loads after it: its poll's acquire does that).
// The last block to arrive then polls at once; an acq_rel fetch_add here measured 0.3-1% slower
// (docs/perf-log.md v22).
HE_INLINE void he_arrive_add(he_u32* counter, he_u32 v) { he_red_add_release_device(counter, v); }

HE_INLINE void he_grid_arrive(const HeWaitCtx& w) {
  he_sync_block();  // every thread's stage outputs happen-before thread 0's release below (block scope)
  // release RMW at device scope: publishes this block's outputs to whoever acquires a later value.
  if (he_thread_idx() == 0) he_arrive_add(&w.bar->count, 1u);
}

HE_INLINE bool he_grid_wait(const HeWaitCtx& w, he_u32& epoch, int nblocks) {
  __shared__ int he_bar_ok;
  const he_u32 target = (epoch + 1u) * (he_u32)nblocks;
  if (he_thread_idx() == 0) he_bar_ok = he_wait_geq_device(w, &w.bar->count, target, kStatusBarrierTimeout);
  he_sync_block();  // hands thread 0's acquire to the block (block-scope acq_rel)
  const bool ok = he_bar_ok != 0;
  he_sync_block();  // he_bar_ok may be rewritten by the next barrier only after everyone read it
  ++epoch;
  return ok;
}

HE_INLINE bool he_grid_barrier(const HeWaitCtx& w, he_u32& epoch, int nblocks) {
  he_grid_arrive(w);
  return he_grid_wait(w, epoch, nblocks);
}

// Wait (whole block) until *counter >= target; the counter's writers used device-scope releases after
// publishing their data. Returns false if the kernel must end.
HE_INLINE bool he_block_wait_geq(const HeWaitCtx& w, const he_u32* counter, he_u32 target) {
  __shared__ int he_wait_ok;
  if (he_thread_idx() == 0) he_wait_ok = he_wait_geq_device(w, counter, target, kStatusCounterTimeout);
  he_sync_block();
  const bool ok = he_wait_ok != 0;
  he_sync_block();
  return ok;
}

// Counter arrival without waiting (the "last block does the combine" pattern): every thread calls it after
// writing its block's part; returns true in every thread of exactly one block — the last of `expected`
// arrivals — which then sees all parts (acq_rel RMW at device scope). The last arriver resets the counter
// (relaxed; the next use is ordered after a grid barrier, whose release/acquire publishes the reset — or,
// in a per-op kernel (ops/attention_decode.hip), after this kernel's completion).
HE_INLINE bool he_arrive_last(he_u32* counter, he_u32 expected) {
  __shared__ int he_last;
  he_sync_block();
  if (he_thread_idx() == 0) {
    const he_u32 old = he_fetch_add_acq_rel_device(counter, 1u);
    he_last = old == expected - 1u;
    if (he_last) he_store_relaxed_device(counter, 0u);
  }
  he_sync_block();
  const bool last = he_last != 0;
  he_sync_block();
  return last;
}
