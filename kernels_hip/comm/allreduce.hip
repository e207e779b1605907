// kernels_hip/comm/allreduce.hip — custom all-reduce over peer-mapped memory (one process, all GPUs).
//
// Every rank owns one "comm buffer" (fine-grained on AMD) that peers write into directly. Its layout is
// described by ArPeerTable (mirrored by hipengine/comm/allreduce.py::ArPeerTable, sizes asserted on both
// sides) and holds:
//   flags  [3 kinds][nblocks][kArMaxRanks] u32   kind 0 = one-shot, 1 = reduce-scatter, 2 = all-gather;
//                                                 flags[k][b][s] = last epoch rank s signalled to us.
//   os     [2 parity][world][slot_bytes]         one-shot receive slots, one per source rank
//   rs     [2 parity][world][slot_bytes]         two-shot reduce-scatter receive slots
//   ag     [2 parity][slot_bytes]                two-shot gathered result
//   ll     [2 parity][world][2 x slot_bytes]     one-shot LL lines (data word + epoch word, see ar_ll_block)
//
// Protocol (one round = one epoch; the host increments the epoch per call, separately per algorithm):
//   * Flags hold the epoch number, grow monotonically and are never cleared: a waiter asks "has source s
//     reached epoch e yet?" ((int)(flag - e) >= 0, wrap-safe), so there is no reset to race with.
//   * Data regions are double-buffered by epoch parity. A peer can run at most one round ahead of us on a
//     given block: to finish round e+1 it needs our round-(e+1) flag, which we only send after we have
//     finished reading round e. So round e+1 writes (other parity) never clobber round-e data we are
//     still reading, and round e+2 writes cannot start before we are done.
//   * Work is split into tiles of tile_bytes (= block threads x 16 B); tile t always belongs to "virtual
//     block" t % nblocks, on every rank, in every algorithm, whatever the message size. A virtual block
//     only touches its own tiles and its own flag row, so the argument above holds per block and blocks
//     never wait on each other (no grid barrier; the repeated kernel runs K rounds back to back).
//     Every region is therefore addressed by the tile's position in the whole message, never by its
//     position inside a chunk: chunk boundaries move with the message size, and a chunk-relative slot
//     would be written by block b in one round and read by block b' in another (the Python protocol
//     model found exactly that race in a first version).
//   * Sums run in rank order 0..world-1 on every rank (one-shot) or on the chunk's owner (two-shot), so
//     every rank ends with bitwise-identical results.
//   * Every spin-wait has a wall-clock timeout; on expiry it writes a code to the status word and the
//     kernel returns instead of hanging. The host turns that into DeviceError.
//
// Visibility rules we rely on (see port.h for the memory-order vocabulary):
//   writer: every thread stores its data (plain stores, possibly to a peer GPU), then runs a system-scope
//           release fence, then the block barrier; afterwards one thread per peer publishes the epoch with
//           a system-scope release store. The per-thread fence makes each thread's own stores visible at
//           system scope before the barrier, so we do not rely on barrier cumulativity (which AMD's
//           implementation of a single-thread release does not give for other waves' stores).
//   reader: one thread per source polls its flag with system-scope acquire loads; the block barrier then
//           orders everyone after those acquires, and each thread runs a system-scope acquire fence
//           before reading the received data (invalidating any stale cached line on either vendor).
#include "port.h"

constexpr int kArMaxRanks = 8;
constexpr int kArKindOneshot = 0;
constexpr int kArKindReduceScatter = 1;
constexpr int kArKindAllGather = 2;
constexpr int kArKinds = 3;  // rows of the flag array
static_assert(kArKindAllGather + 1 == kArKinds, "flag kinds");

// Status word codes: 0 = ok; kArStatusTimeout | kind << 8 | source rank = gave up waiting for that rank.
constexpr he_u32 kArStatusTimeout = 0x10000u;

// One per rank, in that rank's device memory. Python mirror: hipengine/comm/allreduce.py::ArPeerTable.
struct ArPeerTable {
  he_u64 base[kArMaxRanks];  // comm buffer of every rank (peer-mapped device pointers, UVA)
  he_u64 status;             // this rank's status word (he_u32*)
  he_u32 rank, world;
  he_u32 nblocks;            // virtual blocks: tile t belongs to block t % nblocks (fixed per communicator)
  he_u32 tile_bytes;         // bytes per tile = threads per block x 16
  he_u64 off_flags, off_os, off_rs, off_ag, off_ll;  // region offsets inside every comm buffer
  he_u64 slot_bytes;         // largest message, bytes (one-shot slot, gather region)
  he_u64 timeout_ns;         // spin-wait limit
};
// Every field is naturally aligned and the sizes add up to 144, so there is no padding and the offsets
// follow from the declaration order (NVRTC has no offsetof); Python asserts the same size and offsets.
static_assert(sizeof(ArPeerTable) == 8 * kArMaxRanks + 8 + 4 * 4 + 8 * 5 + 8 + 8, "ArPeerTable has padding");
static_assert(sizeof(ArPeerTable) == 144, "ArPeerTable layout changed: update allreduce.py");

// ---- element types: a 16-byte pack is summed in fp32 and rounded once ------------------------------
struct ArF32 {
  static constexpr int kN = 4;
  HE_INLINE static void add(float* a, he_vec16 v) {
    a[0] += he_u32_as_f32(v.x); a[1] += he_u32_as_f32(v.y);
    a[2] += he_u32_as_f32(v.z); a[3] += he_u32_as_f32(v.w);
  }
  HE_INLINE static he_vec16 pack(const float* a) {
    he_vec16 v;
    v.x = he_f32_as_u32(a[0]); v.y = he_f32_as_u32(a[1]); v.z = he_f32_as_u32(a[2]); v.w = he_f32_as_u32(a[3]);
    return v;
  }
};
struct ArBf16 {
  static constexpr int kN = 8;
  HE_INLINE static void add(float* a, he_vec16 v) {
    a[0] += he_bf16lo_to_f32(v.x); a[1] += he_bf16hi_to_f32(v.x);
    a[2] += he_bf16lo_to_f32(v.y); a[3] += he_bf16hi_to_f32(v.y);
    a[4] += he_bf16lo_to_f32(v.z); a[5] += he_bf16hi_to_f32(v.z);
    a[6] += he_bf16lo_to_f32(v.w); a[7] += he_bf16hi_to_f32(v.w);
  }
  HE_INLINE static he_u32 two(float lo, float hi) {
    return (he_u32)he_f32_to_bf16(lo) | ((he_u32)he_f32_to_bf16(hi) << 16);
  }
  HE_INLINE static he_vec16 pack(const float* a) {
    he_vec16 v;
    v.x = two(a[0], a[1]); v.y = two(a[2], a[3]); v.z = two(a[4], a[5]); v.w = two(a[6], a[7]);
    return v;
  }
};

// ---- addressing ---------------------------------------------------------------------------------------
HE_INLINE char* ar_base(const ArPeerTable* T, int r) { return (char*)T->base[r]; }
// Flag that `src` sets in `dst`'s buffer for (kind, virtual block).
HE_INLINE he_u32* ar_flag(const ArPeerTable* T, int dst, int kind, int vb, int src) {
  return (he_u32*)(ar_base(T, dst) + T->off_flags) + ((he_u64)kind * T->nblocks + vb) * kArMaxRanks + src;
}
HE_INLINE bool ar_reached(he_u32 flag, he_u32 epoch) { return (int)(flag - epoch) >= 0; }  // wrap-safe

// AR_FENCE_EVERY_THREAD=1 (default): the per-thread fences described in the header, correct by the letter
// of both vendors' models. =0 keeps only the signalling thread's release (relies on barrier cumulativity,
// which PTX guarantees); it exists to measure what the extra fences cost, not for production use.
#ifndef AR_FENCE_EVERY_THREAD
#define AR_FENCE_EVERY_THREAD 1
#endif

// Signal: called by the whole block after its data stores. Fence per thread (see header), barrier, then
// thread p publishes `epoch` into rank p's flag row for us.
HE_INLINE void ar_signal(const ArPeerTable* T, int kind, int vb, he_u32 epoch) {
  if (AR_FENCE_EVERY_THREAD) he_fence_acq_rel_system();  // release: this thread's stores, before the barrier
  he_sync_block();
  const int p = he_thread_idx();
  if (p < (int)T->world && p != (int)T->rank) {
    if (!AR_FENCE_EVERY_THREAD) he_fence_acq_rel_system();
    // release store at system scope: pairs with the acquire poll in ar_wait on GPU p.
    he_store_release_system(ar_flag(T, p, kind, vb, (int)T->rank), epoch);
  }
}

// Polls of a flag between two looks at the status word and the clock. Looking at every poll doubled the
// poll's period: the status load is ordered after the flag's acquire load, so it was a second round trip per
// poll, and the clock read is slower than either (sync.h's waits read the clock every kPollsPerClock polls).
// A wait therefore notices another block's failure, or its own timeout, up to this many polls late.
constexpr int kArPollsPerCheck = 64;

// Wait until every peer has published `epoch` (or later) for (kind, vb). Returns false on timeout or when
// another block already gave up (status word set); the whole block returns the same answer.
HE_INLINE bool ar_wait(const ArPeerTable* T, int kind, int vb, he_u32 epoch) {
  __shared__ int s_failed;
  const int s = he_thread_idx();
  he_u32* status = (he_u32*)T->status;
  if (s == 0) s_failed = 0;
  he_sync_block();
  if (s < (int)T->world && s != (int)T->rank) {
    const he_u32* f = ar_flag(T, (int)T->rank, kind, vb, s);
    // acquire at system scope: once we see the epoch, the source's data stores (released before it) are
    // visible to this thread; the barrier below extends that to the block.
    if (!ar_reached(he_load_acquire_system(f), epoch)) {
      const he_u64 t0 = he_clock_ns();
      for (int polls = 1; !ar_reached(he_load_acquire_system(f), epoch); ++polls) {
        if (polls % kArPollsPerCheck != 0) continue;
        if (he_load_relaxed_device(status) != 0) { s_failed = 1; break; }  // another block timed out: bail
        if (he_clock_ns() - t0 > T->timeout_ns) {
          he_store_relaxed_system(status, kArStatusTimeout | ((he_u32)kind << 8) | (he_u32)s);
          s_failed = 1;
          break;
        }
      }
    }
  }
  he_sync_block();
  const bool ok = s_failed == 0;
  if (AR_FENCE_EVERY_THREAD) he_fence_acq_rel_system();  // acquire side for every reading thread (see header)
  he_sync_block();            // s_failed may be rewritten by the next wait only after everyone read it
  return ok;
}

// ---- one-shot: push everything to everyone, everyone sums --------------------------------------------
// Latency-optimal for small messages: one flag round trip. Each byte crosses every link once per peer.
// Phase 1 (push + signal + wait) is shared with the fused variant below.
HE_INLINE bool ar_oneshot_exchange(const void* in, he_u64 nbytes, const ArPeerTable* T, he_u32 epoch, int vb) {
  const int rank = (int)T->rank, world = (int)T->world, tid = he_thread_idx();
  const he_u64 tile = T->tile_bytes, par = epoch & 1u;
  const he_u64 ntiles = (nbytes + tile - 1) / tile;
  // push our tiles into slot `rank` of every peer's one-shot region (this parity).
  for (he_u64 t = vb; t < ntiles; t += T->nblocks) {
    const he_u64 off = t * tile + (he_u64)tid * 16;
    if (off >= nbytes) continue;
    const he_vec16 v = he_load16((const char*)in + off);
    for (int p = 0; p < world; ++p) {
      if (p == rank) continue;
      char* dst = ar_base(T, p) + T->off_os + (par * world + rank) * T->slot_bytes + off;
      *(he_vec16*)dst = v;
    }
  }
  ar_signal(T, kArKindOneshot, vb, epoch);
  return ar_wait(T, kArKindOneshot, vb, epoch);
}

// Sum of the 16-byte pack at `off` over ranks 0..world-1 in that order (our own contribution straight from
// `in`): the same bits on every rank. Call after ar_oneshot_exchange returned true for this epoch.
template <class E>
HE_INLINE void ar_oneshot_sum_pack(float* acc, const void* in, he_u64 off, const ArPeerTable* T, he_u32 epoch) {
  const int rank = (int)T->rank, world = (int)T->world;
  const char* mine = ar_base(T, rank) + T->off_os + (he_u64)(epoch & 1u) * world * T->slot_bytes;
  for (int i = 0; i < E::kN; ++i) acc[i] = 0.f;
  for (int s = 0; s < world; ++s)
    E::add(acc, he_load16(s == rank ? (const char*)in + off : mine + (he_u64)s * T->slot_bytes + off));
}

template <class E>
HE_INLINE bool ar_oneshot_block(const void* in, void* out, he_u64 nbytes, const ArPeerTable* T, he_u32 epoch,
                                int vb) {
  if (!ar_oneshot_exchange(in, nbytes, T, epoch, vb)) return false;
  const he_u64 tile = T->tile_bytes, ntiles = (nbytes + tile - 1) / tile;
  for (he_u64 t = vb; t < ntiles; t += T->nblocks) {
    const he_u64 off = t * tile + (he_u64)he_thread_idx() * 16;
    if (off >= nbytes) continue;
    float acc[E::kN];
    ar_oneshot_sum_pack<E>(acc, in, off, T, epoch);
    *(he_vec16*)((char*)out + off) = E::pack(acc);
  }
  return true;
}

// ---- fused: all-reduce + residual add + RMSNorm (the decode step's O-proj / down-proj epilogue) --------
// residual[i] += sum_r partial_r[i];  normed[i] = residual[i] * rsqrt(mean(residual^2) + eps) * gamma[i].
// The norm needs the whole vector, so ONE block handles every tile: the communicator must have
// nblocks == 1 (otherwise the status word reports kArStatusConfig and nothing is written). The hidden
// vector of a decode step is 2-16 KB, a few tiles. residual, gamma, normed are fp32; `partial` is E.
// Every rank computes the same residual bits (fixed-order sum) and so the same normed bits.
constexpr he_u32 kArStatusConfig = 0x20000u;

template <class E>
HE_INLINE bool ar_oneshot_residual_rmsnorm_block(const void* partial, float* residual, const float* gamma,
                                                 float* normed, he_u64 n, float eps, const ArPeerTable* T,
                                                 he_u32 epoch) {
  __shared__ float scratch[kMaxWarpsPerBlock];
  if (T->nblocks != 1) {
    if (he_thread_idx() == 0) he_store_relaxed_system((he_u32*)T->status, kArStatusConfig);
    return false;
  }
  const he_u64 nbytes = n * (16 / E::kN);  // element size = 16 B / elements per pack
  if (!ar_oneshot_exchange(partial, nbytes, T, epoch, 0)) return false;
  const he_u64 packs = nbytes / 16;
  float ss = 0.f;
  for (he_u64 q = he_thread_idx(); q < packs; q += he_block_dim()) {
    float acc[E::kN];
    ar_oneshot_sum_pack<E>(acc, partial, q * 16, T, epoch);
    float* res = residual + q * E::kN;
    for (int i = 0; i < E::kN; ++i) {
      const float r = res[i] + acc[i];
      res[i] = r;
      ss += r * r;
    }
  }
  // he_block_sum sums warps in a fixed order: the scale is the same on every rank.
  const float scale = he_rsqrt(he_block_sum(ss, scratch) / (float)n + eps);
  for (he_u64 i = he_thread_idx(); i < n; i += he_block_dim()) normed[i] = residual[i] * scale * gamma[i];
  return true;
}

// ---- one-shot LL ("low latency"): the epoch travels inside every data word -----------------------------
// Each 4-byte payload word is sent as one 8-byte word {payload, epoch} with a single 8-byte store, which is
// single-copy atomic (aligned; NVLink and xGMI carry it whole — NCCL's and RCCL's LL protocols rest on the
// same fact). A reader that sees `epoch` in the high half therefore sees that round's payload in the low
// half: no fence, no separate flag, no block barrier, one one-way trip over the link. The price is twice
// the bytes, so it serves small messages only. Same parity double-buffering and tile -> virtual block map
// as the one-shot; waiting is per thread on exactly `epoch` (the slot of this parity last held epoch - 2).
// volatile accesses: every poll is a fresh load that bypasses non-coherent caches (PTX: ld.volatile has
// relaxed.sys semantics; AMD: glc loads of fine-grained memory), and the compiler keeps each 8-byte
// access whole.
HE_INLINE bool ar_ll_poll(const volatile he_u64* p, he_u32 epoch, he_u32& word, const ArPeerTable* T, int src) {
  he_u64 v = *p;
  if ((he_u32)(v >> 32) == epoch) { word = (he_u32)v; return true; }
  he_u32* status = (he_u32*)T->status;
  const he_u64 t0 = he_clock_ns();
  for (int polls = 1;; ++polls) {
    v = *p;
    if ((he_u32)(v >> 32) == epoch) { word = (he_u32)v; return true; }
    if (polls % kArPollsPerCheck != 0) continue;  // status and clock every kArPollsPerCheck polls (ar_wait)
    if (he_load_relaxed_device(status) != 0) return false;  // another thread timed out: give up too
    if (he_clock_ns() - t0 > T->timeout_ns) {
      he_store_relaxed_system(status, kArStatusTimeout | ((he_u32)kArKindOneshot << 8) | (he_u32)src);
      return false;
    }
  }
}

template <class E>
HE_INLINE bool ar_ll_block(const void* in, void* out, he_u64 nbytes, const ArPeerTable* T, he_u32 epoch, int vb) {
  const int rank = (int)T->rank, world = (int)T->world, tid = he_thread_idx();
  const he_u64 tile = T->tile_bytes, par = epoch & 1u, slot = 2 * T->slot_bytes;
  const he_u64 ntiles = (nbytes + tile - 1) / tile;
  const he_u64 e32 = (he_u64)epoch << 32;
  // 1. push: the 16-byte pack at `off` becomes four 8-byte LL words at 2 * off in slot `rank` of each peer.
  for (he_u64 t = vb; t < ntiles; t += T->nblocks) {
    const he_u64 off = t * tile + (he_u64)tid * 16;
    if (off >= nbytes) continue;
    const he_vec16 v = he_load16((const char*)in + off);
    for (int p = 0; p < world; ++p) {
      if (p == rank) continue;
      volatile he_u64* dst = (volatile he_u64*)(ar_base(T, p) + T->off_ll + (par * world + rank) * slot + 2 * off);
      dst[0] = e32 | v.x;
      dst[1] = e32 | v.y;
      dst[2] = e32 | v.z;
      dst[3] = e32 | v.w;
    }
  }
  // 2. receive and sum in rank order 0..world-1 (own contribution from `in`): identical bits everywhere.
  // All four words of a source's pack are loaded before any is checked (independent volatile loads: one
  // round trip when the round has landed, instead of four dependent ones); only words that do not carry
  // `epoch` yet are polled.
  const char* mine = ar_base(T, rank) + T->off_ll + par * world * slot;
  for (he_u64 t = vb; t < ntiles; t += T->nblocks) {
    const he_u64 off = t * tile + (he_u64)tid * 16;
    if (off >= nbytes) continue;
    float acc[E::kN];
    for (int i = 0; i < E::kN; ++i) acc[i] = 0.f;
    for (int s = 0; s < world; ++s) {
      he_vec16 v;
      if (s == rank) {
        v = he_load16((const char*)in + off);
      } else {
        const volatile he_u64* src = (const volatile he_u64*)(mine + (he_u64)s * slot + 2 * off);
        he_u64 wd[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) wd[j] = src[j];
        he_u32 x[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if ((he_u32)(wd[j] >> 32) == epoch) x[j] = (he_u32)wd[j];
          else if (!ar_ll_poll(src + j, epoch, x[j], T, s)) return false;
        }
        v = he_vec16{x[0], x[1], x[2], x[3]};
      }
      E::add(acc, v);
    }
    *(he_vec16*)((char*)out + off) = E::pack(acc);
  }
  return true;
}

// ---- two-shot: reduce-scatter (each rank sums one chunk) + all-gather --------------------------------
// Bandwidth-optimal for large messages: each byte crosses the links ~2x instead of (world-1)x, at the
// price of two flag round trips. Chunks are whole tiles so a tile has exactly one owner.
template <class E>
HE_INLINE bool ar_twoshot_block(const void* in, void* out, he_u64 nbytes, const ArPeerTable* T, he_u32 epoch,
                                int vb) {
  const int rank = (int)T->rank, world = (int)T->world, tid = he_thread_idx();
  const he_u64 tile = T->tile_bytes, par = epoch & 1u;
  const he_u64 ntiles = (nbytes + tile - 1) / tile;
  const he_u64 chunk_tiles = (ntiles + world - 1) / world;  // owner of tile t: t / chunk_tiles
  // 1. reduce-scatter push: tile t goes to its owner's slot `rank`.
  for (he_u64 t = vb; t < ntiles; t += T->nblocks) {
    const int owner = (int)(t / chunk_tiles);
    const he_u64 off = t * tile + (he_u64)tid * 16;
    if (owner == rank || off >= nbytes) continue;
    *(he_vec16*)(ar_base(T, owner) + T->off_rs + (par * world + rank) * T->slot_bytes + off) =
        he_load16((const char*)in + off);
  }
  ar_signal(T, kArKindReduceScatter, vb, epoch);
  if (!ar_wait(T, kArKindReduceScatter, vb, epoch)) return false;
  // 2. sum our chunk in rank order, push the result into every rank's gather region (and our output).
  const char* rs = ar_base(T, rank) + T->off_rs + par * world * T->slot_bytes;
  for (he_u64 t = vb; t < ntiles; t += T->nblocks) {
    if ((int)(t / chunk_tiles) != rank) continue;
    const he_u64 off = t * tile + (he_u64)tid * 16;
    if (off >= nbytes) continue;
    float acc[E::kN] = {};
    for (int s = 0; s < world; ++s)
      E::add(acc, he_load16(s == rank ? (const char*)in + off : rs + (he_u64)s * T->slot_bytes + off));
    const he_vec16 v = E::pack(acc);
    *(he_vec16*)((char*)out + off) = v;
    for (int p = 0; p < world; ++p)
      if (p != rank) *(he_vec16*)(ar_base(T, p) + T->off_ag + par * T->slot_bytes + off) = v;
  }
  ar_signal(T, kArKindAllGather, vb, epoch);
  if (!ar_wait(T, kArKindAllGather, vb, epoch)) return false;
  // 3. copy the other owners' chunks out of our gather region.
  const char* ag = ar_base(T, rank) + T->off_ag + par * T->slot_bytes;
  for (he_u64 t = vb; t < ntiles; t += T->nblocks) {
    if ((int)(t / chunk_tiles) == rank) continue;
    const he_u64 off = t * tile + (he_u64)tid * 16;
    if (off >= nbytes) continue;
    *(he_vec16*)((char*)out + off) = he_load16(ag + off);
  }
  return true;
}

// ---- standalone kernels -------------------------------------------------------------------------------
// The monokernel includes this file for the __device__ bodies above; it defines AR_NO_KERNELS first so
// these entry points are not compiled into its module.
#ifndef AR_NO_KERNELS
// Launch: grid = min(nblocks, tiles), block = tile_bytes / 16 threads (<= 1024). `nbytes` must be a
// multiple of 16; in/out are this rank's device buffers (out may not alias in for two-shot peers' reads:
// it never does, peers read only our comm buffer). The repeated variants run `repeats` back-to-back rounds
// with epochs epoch0 .. epoch0 + repeats - 1 (the host advances its counter by `repeats`).
// The _graph variants keep the epoch on the device instead, so a captured CUDA/HIP graph can be replayed:
// epoch_ctr[vb] (rank-local, one per virtual block, zeroed at setup) holds the block's last epoch. Kernels
// on one stream run in order and a kernel boundary publishes all of a kernel's writes to the next, so the
// next launch reads the advanced value; every rank runs the same launch sequence with the same sizes, so
// the counters of virtual block vb agree across ranks (blocks not launched for a small message advance on
// no rank). A communicator uses either host epochs or device epochs, never both.
// Every kernel lets the next one launch at once and waits for the previous one first (port.h he_pdl_wait):
// the host may launch them with programmatic dependent launch, so that the kernel after an all-reduce (the
// next matvec) requests its weights while the all-reduce waits on its peers.
#define AR_KERNELS(NAME, ALGO, E)                                                                        \
  HE_KERNEL(1024) NAME(const void* in, void* out, he_u64 nbytes, const ArPeerTable* T, he_u32 epoch) {   \
    he_pdl_trigger();                                                                                    \
    he_pdl_wait();                                                                                       \
    ALGO<E>(in, out, nbytes, T, epoch, he_block_idx());                                                  \
  }                                                                                                      \
  HE_KERNEL(1024) NAME##_graph(const void* in, void* out, he_u64 nbytes, const ArPeerTable* T,           \
                               he_u32* epoch_ctr) {                                                      \
    he_pdl_trigger();                                                                                    \
    he_pdl_wait();                                                                                       \
    const int vb = he_block_idx();                                                                       \
    const he_u32 epoch = epoch_ctr[vb] + 1;                                                              \
    ALGO<E>(in, out, nbytes, T, epoch, vb);                                                              \
    /* every thread read epoch_ctr[vb] before the barriers inside ALGO: safe to advance it now */         \
    if (he_thread_idx() == 0) epoch_ctr[vb] = epoch;                                                     \
  }                                                                                                      \
  HE_KERNEL(1024) NAME##_repeat(const void* in, void* out, he_u64 nbytes, const ArPeerTable* T,          \
                                he_u32 epoch0, he_u32 repeats) {                                         \
    he_pdl_trigger();                                                                                    \
    he_pdl_wait();                                                                                       \
    for (he_u32 k = 0; k < repeats; ++k)                                                                 \
      if (!ALGO<E>(in, out, nbytes, T, epoch0 + k, he_block_idx())) return;                             \
  }

AR_KERNELS(allreduce_oneshot_f32, ar_oneshot_block, ArF32)
AR_KERNELS(allreduce_oneshot_bf16, ar_oneshot_block, ArBf16)
AR_KERNELS(allreduce_ll_f32, ar_ll_block, ArF32)
AR_KERNELS(allreduce_ll_bf16, ar_ll_block, ArBf16)
AR_KERNELS(allreduce_twoshot_f32, ar_twoshot_block, ArF32)
AR_KERNELS(allreduce_twoshot_bf16, ar_twoshot_block, ArBf16)
#undef AR_KERNELS

// Fused epilogue, standalone (grid = 1 block of tile_bytes / 16 threads; communicator with nblocks == 1).
#define AR_FUSED_KERNEL(NAME, E)                                                                         \
  HE_KERNEL(1024) NAME(const void* partial, float* residual, const float* gamma, float* normed, he_u64 n,  \
                       float eps, const ArPeerTable* T, he_u32 epoch) {                                  \
    he_pdl_trigger();                                                                                    \
    he_pdl_wait();                                                                                       \
    ar_oneshot_residual_rmsnorm_block<E>(partial, residual, gamma, normed, n, eps, T, epoch);            \
  }
AR_FUSED_KERNEL(allreduce_residual_rmsnorm_f32, ArF32)
AR_FUSED_KERNEL(allreduce_residual_rmsnorm_bf16, ArBf16)
#undef AR_FUSED_KERNEL

// Busy-waits `ns` nanoseconds (tests: random per-rank delays ahead of an all-reduce on the same stream).
HE_KERNEL(32) allreduce_delay(he_u64 ns) {
  he_pdl_trigger();
  he_pdl_wait();
  const he_u64 t0 = he_clock_ns();
  while (he_clock_ns() - t0 < ns) he_sleep(200);
}
#endif  // AR_NO_KERNELS
