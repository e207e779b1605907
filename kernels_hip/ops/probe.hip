// kernels_hip/ops/probe.hip — the machine's ceilings, measured by `hipengine bench probe`.
//
//   probe_read      : stream a large buffer once (HBM read bandwidth, the decode roofline's numerator).
//   probe_read_sm   : every SM streams its own slice at once; per-SM time (static splits wait for the slowest).
//   probe_copy      : read one buffer, write another (copy bandwidth; also peer reads/writes over NVLink/xGMI).
//   probe_empty     : does nothing (launch overhead, eager and inside a graph).
//   probe_pingpong  : one thread per GPU bouncing a counter through peer-mapped flags (one-way latency).
//   probe_poll      : how long one flag poll (an L2 hit) takes while the SM streams weights the way the
//                     monokernel's warps do at a grid barrier (the barrier's wait is such polls).
//   probe_chain     : a per-op decode kernel's dependent boundary without its weights (scripts/bench_ops.py
//                     "floor": what a chain of such launches costs per launch however few bytes it reads).
//
// The read kernel is a real reduction (a 32-bit wrapping sum of every word), so the compiler cannot drop
// the loads and the host can check the grid-stride indexing against numpy.
#include "port.h"
#include "ops/rmsnorm.hip"

// Vectors loaded per thread per iteration: independent loads in flight hide HBM latency (Little's law);
// 4 x 16 B per thread with a few blocks per SM/CU saturates HBM3/HBM3e on H200 and MI300X.
constexpr int kProbeUnroll = 4;

HE_INLINE he_u32 he_vec16_sum(he_vec16 v) { return v.x + v.y + v.z + v.w; }

// sum(words of src[0:n_vec]) mod 2^32, accumulated into *out (which the host zeroes).
// src: (n_vec,) 16-byte vectors, 16-byte aligned. Launch any grid; 1-D blocks of whole warps.
HE_KERNEL(1024) probe_read(const he_vec16* src, he_u64 n_vec, he_u32* out) {
  const he_u64 stride = (he_u64)he_grid_dim() * he_block_dim();
  he_u64 i = (he_u64)he_block_idx() * he_block_dim() + he_thread_idx();
  he_u32 acc = 0;
  // Main loop: kProbeUnroll loads issued before any is consumed.
  for (; i + (kProbeUnroll - 1) * stride < n_vec; i += kProbeUnroll * stride) {
    he_vec16 v[kProbeUnroll];
#pragma unroll
    for (int u = 0; u < kProbeUnroll; ++u) v[u] = he_load16_stream(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < kProbeUnroll; ++u) acc += he_vec16_sum(v[u]);
  }
  for (; i < n_vec; i += stride) acc += he_vec16_sum(he_load16_stream(src + i));
  // Warp reduction, then one relaxed atomic per warp: integer addition is associative, so the result is
  // exact whatever the order (the host compares it bit for bit).
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) acc += (he_u32)he_shfl_xor_int((int)acc, o);
  if (he_lane_id() == 0) he_fetch_add_relaxed_device(out, acc);
}

// Per-SM read rate with every SM streaming at once: block b reads its own n_per_block vectors
// src[b·n_per_block ...] (kProbeUnroll loads per thread in flight, like probe_read) and thread 0 writes
// out[b·kProbeSmRow ...] = {SM id, cycles from the block's start to its end, wall-clock start, end (ns),
// the 32-bit sum of its words}. The host launches one block per SM (shared memory sized to forbid a second)
// and compares blocks: a static split of a matvec over SMs finishes with the slowest one.
constexpr int kProbeSmRow = 5;
HE_KERNEL(1024) probe_read_sm(const he_vec16* src, he_u64 n_per_block, he_u64* out) {
  extern __shared__ he_u32 probe_sums[];  // [warps]; the launch's (large) dynamic size only sets occupancy
  he_sync_block();
  const he_u64 c0 = he_cycles(), t0 = he_clock_ns();
  const he_vec16* p = src + (he_u64)he_block_idx() * n_per_block;
  const int nt = he_block_dim();
  he_u32 acc = 0;
  he_u64 i = he_thread_idx();
  for (; i + (kProbeUnroll - 1) * nt < n_per_block; i += kProbeUnroll * nt) {
    he_vec16 v[kProbeUnroll];
#pragma unroll
    for (int u = 0; u < kProbeUnroll; ++u) v[u] = he_load16_stream(p + i + u * nt);
#pragma unroll
    for (int u = 0; u < kProbeUnroll; ++u) acc += he_vec16_sum(v[u]);
  }
  for (; i < n_per_block; i += nt) acc += he_vec16_sum(he_load16_stream(p + i));
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) acc += (he_u32)he_shfl_xor_int((int)acc, o);
  if (he_lane_id() == 0) probe_sums[he_warp_id()] = acc;
  he_sync_block();
  if (he_thread_idx() == 0) {
    he_u32 sum = 0;
    for (int w = 0; w < he_num_warps(); ++w) sum += probe_sums[w];
    he_u64* row = out + (he_u64)he_block_idx() * kProbeSmRow;
    row[0] = he_sm_id();
    row[1] = he_cycles() - c0;
    row[2] = t0;
    row[3] = he_clock_ns();
    row[4] = sum;
  }
}

// dst[0:n_vec] = src[0:n_vec]. src and dst may be on different GPUs (peer access enabled).
HE_KERNEL(1024) probe_copy(const he_vec16* src, he_vec16* dst, he_u64 n_vec) {
  const he_u64 stride = (he_u64)he_grid_dim() * he_block_dim();
  he_u64 i = (he_u64)he_block_idx() * he_block_dim() + he_thread_idx();
  for (; i + (kProbeUnroll - 1) * stride < n_vec; i += kProbeUnroll * stride) {
    he_vec16 v[kProbeUnroll];
#pragma unroll
    for (int u = 0; u < kProbeUnroll; ++u) v[u] = he_load16_stream(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < kProbeUnroll; ++u) dst[i + u * stride] = v[u];
  }
  for (; i < n_vec; i += stride) dst[i] = he_load16_stream(src + i);
}

HE_KERNEL(1024) probe_empty() {}

// The skeleton of a per-op matvec launch with no weights: let the next launch start (programmatic dependent
// launch, port.h), wait for the launch before it, stage its output x[0:n] in shared memory with the matvecs'
// own prologue (ops/rmsnorm.hip he_rmsnorm_stage: a plain copy, or RMSNorm by gamma as QKV's and gate/up's),
// then every warp reads 8 words per lane and lane 0 stores the warp's sum at y[global warp] — the matvec's
// prologue, consume and epilogue order. Launched back to back with x and y swapped (scripts/bench_ops.py
// bench_floor), each launch depends on the one before through memory, as the decode step's kernels do.
// n % 4 == 0; dynamic shared memory at least n * 4 bytes (the host pads it to keep two blocks per SM, as the
// matvecs' registers do).
HE_KERNEL(1024) probe_chain(const float* x, const float* __restrict__ gamma, float* y, int n) {
  extern __shared__ float xs[];
  __shared__ float scratch[kMaxWarpsPerBlock];
  he_pdl_trigger();
  he_pdl_wait();
  he_rmsnorm_stage<true>(x, gamma, 1e-5f, n, xs, scratch);
  const int lane = he_lane_id();
  float s = 0.f;
  for (int c = lane * 8; c < n; c += kWarpSize * 8)
#pragma unroll
    for (int j = 0; j < 8; ++j) s += xs[c + j];
  s = he_warp_sum(s);
  if (lane == 0) y[he_block_idx() * he_num_warps() + he_warp_id()] = s * (1.f / (float)n);
}

// Ping-pong between two GPUs, one thread each. `local` lives on this GPU (polled here), `remote` on the other
// GPU (written from here through peer mapping). Round r: the initiator publishes r into the responder's flag
// and waits to see r in its own; the responder waits for r and answers r. One round = two one-way trips.
// Release/acquire at system scope: the flag value is the only payload, but the same pattern publishes data.
// result[0] = elapsed ns on the initiator (he_clock_ns), result[1] = rounds completed (< rounds on timeout).
HE_KERNEL(64) probe_pingpong(he_u32* local, he_u32* remote, int rounds, int initiator, he_u64 timeout_ns,
                             he_u64* result) {
  if (he_block_idx() != 0 || he_thread_idx() != 0) return;
  const he_u64 start = he_clock_ns();
  int done = 0;
  for (int r = 1; r <= rounds; ++r) {
    if (initiator) he_store_release_system(remote, (he_u32)r);
    bool timed_out = false;
    // Relaxed polling keeps the loop cheap; the acquire load after it orders what follows.
    while (he_load_relaxed_system(local) != (he_u32)r) {
      if (he_clock_ns() - start > timeout_ns) { timed_out = true; break; }
    }
    if (timed_out) break;
    (void)he_load_acquire_system(local);
    if (!initiator) he_store_release_system(remote, (he_u32)r);
    done = r;
  }
  result[0] = he_clock_ns() - start;
  result[1] = (he_u64)done;
}

// probe_poll: the round trip of a device-scope poll of a flag (an L2 hit: the word never changes) issued by
// thread 0 of each block right after the block's warps requested kProbePollUnroll 16-byte loads per lane from
// HBM (8 KiB per warp: the monokernel stream's pair, which every warp requests between its barrier arrival and
// its wait). Per round: the block's warps meet, every streaming warp issues its batch, thread 0 does the
// mode's operation once every warp of the block has issued its batch (a block barrier between: otherwise which
// goes first is the warp scheduler's choice, and the answer depends on it) and reads the cycle counter once the
// operation has completed, the warps consume their batches, and thread 0 reads the counter again when its lane's
// batch is there. Block b's slice per round is fresh HBM
// (rounds x grid x warps x 8 KiB must stay under src's size, so nothing hits L2). Modes:
//   0  acquire poll, no warp streams (the idle round trip)
//   1  acquire poll, every warp but warp 0 streams (the poller's warp has nothing in flight)
//   2  acquire poll, every warp streams (the monokernel's barrier)
//   3  relaxed poll, every warp streams (an acquire minus its L1 invalidation)
//   4  acquire poll, every warp's batch requested as asynchronous copies into shared memory (he_cp_async16)
//   5  the barrier arrival's release reduction (he_red_add_release_device on a scratch word), every warp streams
//   6  the same release, every warp but warp 0 streams
//   7  acquire poll, every warp's batch requested as one bulk copy into shared memory (the TMA; kHasBulkCopy
//      targets only: the host does not launch it elsewhere)
//   8  the arrival's release behind the same bulk copies
// batch_vecs: 16-byte vectors per warp per round, at least kProbePollUnroll·kWarpSize (the loads and async copies
// move that many; a bulk copy moves all batch_vecs, so modes 7 and 8 can put more bytes in flight per warp).
// out[b·kProbePollRow ...] = {operation cycles summed over rounds, batch cycles summed, the block's total
// cycles, its total ns (he_clock_ns: calibrates cycles), a checksum that keeps the loads alive}.
constexpr int kProbePollUnroll = 16;
constexpr int kProbePollRow = 5;
constexpr int kProbeReleaseWord = 32;  // modes 5, 6, 8 add to flag[kProbeReleaseWord]: another 128-byte line
constexpr he_u64 kProbeCopyTimeoutNs = 1000000000ull;  // modes 7, 8: a bulk copy's wait gives up after 1 s
HE_KERNEL(256) probe_poll(const he_vec16* src, he_u32* flag, int mode, int rounds, int batch_vecs, he_u64* out) {
  // Dynamic shared memory (the host asks for the most a block may have: one block per SM): modes 4, 7, 8 stage
  // the batches there, [warps][kProbePollUnroll][kWarpSize], and modes 7, 8 put one mbarrier per warp after them.
  extern __shared__ he_vec16 probe_ring[];
  const int lane = he_lane_id(), w = he_warp_id(), nw = he_num_warps();
  he_u64* probe_mbar = (he_u64*)(probe_ring + (he_u64)nw * batch_vecs);
  const bool streams = mode >= 2 ? mode != 6 || w != 0 : mode == 1 && w != 0;
  const bool async = mode == 4, bulk = kHasBulkCopy && mode >= 7;
  const bool poller = he_thread_idx() == 0;
  he_vec16* ring = probe_ring + (he_u64)w * batch_vecs;
  he_u32 acc = 0, seen = 0;
  he_u64 op_cyc = 0, batch_cyc = 0;
  if (bulk && lane == 0) {
    he_mbar_init(probe_mbar + w, 1u);
    he_mbar_init_fence();
  }
  he_sync_block();
  const he_u64 c_start = he_cycles(), t_start = he_clock_ns();
  for (int r = 0; r < rounds; ++r) {
    he_sync_block();
    const he_vec16* p = src + (((he_u64)r * he_grid_dim() + he_block_idx()) * nw + w) * batch_vecs;
    he_vec16 v[kProbePollUnroll];
    const he_u64 c0 = he_cycles();
    if (streams && bulk) {
      if (lane == 0) {  // the slot was read last round (the block barrier above): generic reads, then the copy
        he_fence_proxy_async();
        he_mbar_expect_arrive(probe_mbar + w, (he_u32)batch_vecs * 16u);
        he_bulk_load(ring, p, (he_u32)batch_vecs * 16u, probe_mbar + w);
      }
    } else if (streams && async) {
#pragma unroll
      for (int u = 0; u < kProbePollUnroll; ++u)
        he_cp_async16(ring + u * kWarpSize + lane, p + u * kWarpSize + lane, true);
      he_cp_async_commit();
    } else if (streams) {
#pragma unroll
      for (int u = 0; u < kProbePollUnroll; ++u) v[u] = he_load16_stream(p + u * kWarpSize + lane);
    }
    he_sync_block();  // every batch requested (not arrived) before thread 0's operation
    if (poller) {
      if (mode == 5 || mode == 6 || mode == 8) {
        he_red_add_release_device(flag + kProbeReleaseWord, 1u);  // another line than the polled word
        op_cyc += he_cycles() - c0;  // the release fence blocks the thread until it is done
      } else {
        const he_u32 f = mode == 3 ? he_load_relaxed_device(flag) : he_load_acquire_device(flag);
        seen += f;
        // The counter is read where the value is needed (a branch on it), so not before the load came back.
        if (f != 0x9e3779b9u) op_cyc += he_cycles() - c0;
      }
    }
    if (streams) {
      if (bulk) {
        // Bounded: a copy that never lands traps (the host's launch check reports it) instead of hanging.
        for (he_u64 t0 = 0; !he_mbar_try_wait(probe_mbar + w, (he_u32)r & 1u);) {
          if (t0 == 0) t0 = he_clock_ns();
          else if (he_clock_ns() - t0 > kProbeCopyTimeoutNs) he_trap();
        }
#pragma unroll
        for (int u = 0; u < kProbePollUnroll; ++u) v[u] = ring[u * kWarpSize + lane];
      } else if (async) {
        he_cp_async_wait<0>();
#pragma unroll
        for (int u = 0; u < kProbePollUnroll; ++u) v[u] = ring[u * kWarpSize + lane];
      }
#pragma unroll
      for (int u = 0; u < kProbePollUnroll; ++u) acc += he_vec16_sum(v[u]);
      if (poller && acc != 0x7f4a7c15u) batch_cyc += he_cycles() - c0;
    }
  }
  he_sync_block();
  if (poller) {
    he_u64* row = out + (he_u64)he_block_idx() * kProbePollRow;
    row[0] = op_cyc;
    row[1] = batch_cyc;
    row[2] = he_cycles() - c_start;
    row[3] = he_clock_ns() - t_start;
    row[4] = (he_u64)(acc + seen);
  }
}
