"""Custom all-reduce, host side: one process drives every GPU of the tensor-parallel group.

Each rank owns a comm buffer (``runtime.malloc_fine_grained``: fine-grained on AMD so peers may poll it)
that the other GPUs write into through peer mappings (with peer access enabled, a device pointer of GPU j
is usable from GPU i in the same process under unified addressing). The protocol — epoch-tagged flags that
are never cleared, parity double-buffering, tile -> virtual-block ownership, fixed summation order — is
described in ``kernels_hip/comm/allreduce.hip``; ``ArLayout`` here is the single definition of the buffer
layout that both the kernel (through ``ArPeerTable``) and the pure-Python protocol model use.

``ProtocolModel`` runs the same protocol with ranks x blocks as threads and memory as dicts, so the CPU
tests can hammer it (random delays, 10,000 rounds, world sizes 2/4/8) and show that the buggy variants
(single buffering, boolean flags that are reset) really are caught.
"""
from __future__ import annotations

import ctypes
import random
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import DeviceError

MAX_RANKS = 8
KIND_ONESHOT, KIND_REDUCE_SCATTER, KIND_ALLGATHER = 0, 1, 2
KIND_NAMES = ("one-shot", "reduce-scatter", "all-gather")
STATUS_TIMEOUT = 0x10000
STATUS_CONFIG = 0x20000  # fused all-reduce + RMSNorm launched on a communicator with nblocks != 1
# Algorithm choice, from benchmarks/results/allreduce_tp2_h200.json (2xH200 NV18, in-kernel µs per round):
# LL 2.0-2.3 µs up to 256 KB vs 5-8 µs for the flag-based one-shot; at 512 KB LL 6.0 vs 8.2; from 1 MB
# the one-shot wins (10.8 vs LL 11.3) and two-shot never wins at 2 ranks (same bytes, two round trips).
# Two-shot is kept for >2 ranks, where one-shot pushes (world-1)x the bytes (unmeasured: issue 7).
LL_MAX_BYTES = 512 * 1024
ONESHOT_MAX_BYTES = 256 * 1024  # world > 2: above this, two-shot


class ArPeerTable(ctypes.Structure):
    """Mirror of ``struct ArPeerTable`` in allreduce.hip (static_asserts there check the same numbers)."""

    _fields_ = [("base", ctypes.c_uint64 * MAX_RANKS), ("status", ctypes.c_uint64),
                ("rank", ctypes.c_uint32), ("world", ctypes.c_uint32), ("nblocks", ctypes.c_uint32),
                ("tile_bytes", ctypes.c_uint32), ("off_flags", ctypes.c_uint64), ("off_os", ctypes.c_uint64),
                ("off_rs", ctypes.c_uint64), ("off_ag", ctypes.c_uint64), ("off_ll", ctypes.c_uint64),
                ("slot_bytes", ctypes.c_uint64),
                ("timeout_ns", ctypes.c_uint64)]


assert ctypes.sizeof(ArPeerTable) == 144 and ArPeerTable.status.offset == 64
assert ArPeerTable.off_flags.offset == 88 and ArPeerTable.timeout_ns.offset == 136


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class ArLayout:
    """Sizes and offsets of one rank's comm buffer, and the tile/chunk arithmetic of the protocol."""

    world: int
    nblocks: int  # virtual blocks; tile t is always handled by block t % nblocks
    tile_bytes: int  # threads per block x 16
    max_bytes: int  # largest message

    def __post_init__(self):
        if not 1 <= self.world <= MAX_RANKS:
            raise DeviceError(f"custom all-reduce supports 1..{MAX_RANKS} GPUs, got {self.world}")
        if self.tile_bytes % 16 or not 16 <= self.tile_bytes <= 16 * 1024:
            raise DeviceError(f"tile_bytes must be a multiple of 16 up to 16 KiB, got {self.tile_bytes}")

    @property
    def slot_bytes(self) -> int:
        return _round_up(max(self.max_bytes, 16), self.tile_bytes)

    @property
    def off_flags(self) -> int:
        return 0

    @property
    def flags_bytes(self) -> int:
        return 3 * self.nblocks * MAX_RANKS * 4

    @property
    def off_os(self) -> int:
        return _round_up(self.flags_bytes, 256)

    @property
    def off_rs(self) -> int:
        return self.off_os + 2 * self.world * self.slot_bytes

    @property
    def off_ag(self) -> int:
        # reduce-scatter slots are addressed by the tile's place in the whole message (see the kernel
        # header: chunk-relative slots race when the message size changes), so each is slot_bytes too.
        return self.off_rs + 2 * self.world * self.slot_bytes

    @property
    def off_ll(self) -> int:
        return self.off_ag + 2 * self.slot_bytes

    @property
    def total_bytes(self) -> int:
        # LL lines carry an epoch word per payload word: twice the bytes per slot
        return self.off_ll + 2 * self.world * 2 * self.slot_bytes

    # ---- protocol arithmetic (the kernel computes the same from the table) ----
    def ntiles(self, nbytes: int) -> int:
        return -(-nbytes // self.tile_bytes)

    def chunk_tiles(self, nbytes: int) -> int:
        return -(-self.ntiles(nbytes) // self.world)

    def tiles_of_block(self, vb: int, nbytes: int) -> range:
        return range(vb, self.ntiles(nbytes), self.nblocks)

    def grid(self, nbytes: int) -> int:
        """Blocks to launch: virtual blocks past the last tile have no work and skip the round entirely
        (their flags simply stay behind; waits compare with >=, so the next round is unaffected)."""
        return max(1, min(self.nblocks, self.ntiles(nbytes)))

    def table(self, rank: int, bases: list[int], status_ptr: int, timeout_ns: int) -> ArPeerTable:
        t = ArPeerTable()
        for i, b in enumerate(bases):
            t.base[i] = b
        t.status, t.rank, t.world, t.nblocks, t.tile_bytes = status_ptr, rank, self.world, self.nblocks, self.tile_bytes
        t.off_flags, t.off_os, t.off_rs, t.off_ag, t.off_ll = (self.off_flags, self.off_os, self.off_rs, self.off_ag,
                                                             self.off_ll)
        t.slot_bytes, t.timeout_ns = self.slot_bytes, timeout_ns
        return t


def reached(flag: int, epoch: int) -> bool:
    """Wrap-safe ``flag >= epoch`` on uint32 epochs, as the kernel's ar_reached."""
    d = (flag - epoch) & 0xFFFFFFFF
    return d < 0x80000000


def status_message(code: int) -> str:
    if code & STATUS_CONFIG:
        return "fused all-reduce + RMSNorm needs a communicator with nblocks=1"
    kind, src = (code >> 8) & 0xFF, code & 0xFF
    what = KIND_NAMES[kind] if kind < len(KIND_NAMES) else f"kind {kind}"
    return f"all-reduce timed out waiting for rank {src} ({what} flag)"


# ==================================================================================================
# Pure-Python model of the flag/epoch protocol
# ==================================================================================================
class ProtocolError(AssertionError):
    pass


@dataclass
class _Rank:
    flags: dict = field(default_factory=dict)  # (kind, vb, src) -> epoch
    data: dict = field(default_factory=dict)  # (region, parity, slot, tile) -> tuple of values
    conds: dict = field(default_factory=dict)  # vb -> Condition (a poller's wake-up, stands for spinning)
    status: int = 0


class ProtocolModel:
    """Ranks x virtual blocks as threads, each rank's comm buffer as dicts; mirrors ar_oneshot_block /
    ar_twoshot_block step by step. Tiles carry ``tile_elems`` integers.

    ``chunk_relative=True`` reproduces the first kernel version's bug (reduce-scatter slots addressed within
    the chunk, so the writer block of a slot changes with the message size); ``double_buffer=False`` and
    ``reset_flags=True`` reproduce the two classic bugs (peer overwrites a slot
    still being read; a flag reset erases the next round's signal) so tests can show the model catches them.
    """

    def __init__(self, world: int, nblocks: int = 2, tile_elems: int = 2, *, double_buffer: bool = True,
                 reset_flags: bool = False, chunk_relative: bool = False, device_epochs: bool = False,
                 timeout_s: float = 5.0, delay_p: float = 0.02, seed: int = 0,
                 delay_hook=None):
        self.world, self.nblocks, self.tile_elems = world, nblocks, tile_elems
        self.layout = ArLayout(world, nblocks, tile_elems * 16, max_bytes=1 << 20)
        self.double_buffer, self.reset_flags, self.chunk_relative = double_buffer, reset_flags, chunk_relative
        self.device_epochs = device_epochs  # epochs from per-(rank, block) counters, as the _graph kernels
        self.timeout_s, self.delay_p = timeout_s, delay_p
        self.delay_hook = delay_hook  # f(rank, vb, epoch, point) -> seconds to sleep (targeted delays)
        self.mem = [_Rank() for _ in range(world)]
        for m in self.mem:
            m.conds = {vb: threading.Condition() for vb in range(nblocks)}
        self.rng = [random.Random(seed * 1000 + r) for r in range(world * nblocks)]
        self.errors: list[str] = []

    # ---- memory operations ------------------------------------------------------------------------
    def _delay(self, r: int, vb: int, epoch: int, point: str) -> None:
        if self.delay_hook is not None:
            d = self.delay_hook(r, vb, epoch, point)
            if d:
                time.sleep(d)
        rng = self.rng[r * self.nblocks + vb]
        if rng.random() < self.delay_p:
            time.sleep(rng.random() * 2e-4 if rng.random() < 0.1 else 0)  # mostly a GIL yield

    def _signal(self, src: int, dst: int, kind: int, vb: int, epoch: int) -> None:
        m = self.mem[dst]
        with m.conds[vb]:  # release store: data written before is visible once the flag is
            m.flags[(kind, vb, src)] = 1 if self.reset_flags else epoch
            m.conds[vb].notify_all()

    def _wait(self, r: int, kind: int, vb: int, epoch: int) -> bool:
        m = self.mem[r]
        srcs = [s for s in range(self.world) if s != r]

        def arrived():
            if self.reset_flags:
                return all(m.flags.get((kind, vb, s), 0) == 1 for s in srcs)
            return all(reached(m.flags.get((kind, vb, s), 0), epoch) for s in srcs)

        with m.conds[vb]:
            ok = m.conds[vb].wait_for(lambda: arrived() or any(x.status for x in self.mem), self.timeout_s)
            ok = ok and arrived()
            if not ok:
                if not m.status:
                    late = [s for s in srcs if not reached(m.flags.get((kind, vb, s), 0), epoch)]
                    m.status = STATUS_TIMEOUT | (kind << 8) | (late[0] if late else 0)
                    self.errors.append(f"rank {r}: " + status_message(m.status))
                for x in self.mem:  # wake pollers elsewhere so they see the status and bail
                    for c in x.conds.values():
                        with c:
                            c.notify_all()
                return False
        return True

    def _consume(self, r: int, kind: int, vb: int) -> None:
        """Boolean-flag variant only: the reader clears its flags after reading (the racy design)."""
        m = self.mem[r]
        with m.conds[vb]:
            for s in range(self.world):
                if s != r:
                    m.flags[(kind, vb, s)] = 0

    # ---- the two algorithms (same steps as the kernel) ----------------------------------------
    def _par(self, epoch: int) -> int:
        return epoch & 1 if self.double_buffer else 0

    def _oneshot(self, r: int, vb: int, x: list, out: list, nbytes: int, epoch: int) -> bool:
        L, te, par = self.layout, self.tile_elems, self._par(epoch)
        for t in L.tiles_of_block(vb, nbytes):
            for p in range(self.world):
                if p != r:
                    self.mem[p].data[("os", par, r, t)] = tuple(x[t * te:(t + 1) * te])
                    self._delay(r, vb, epoch, "push")
        for p in range(self.world):
            if p != r:
                self._signal(r, p, KIND_ONESHOT, vb, epoch)
        if not self._wait(r, KIND_ONESHOT, vb, epoch):
            return False
        self._delay(r, vb, epoch, "read")
        for t in L.tiles_of_block(vb, nbytes):
            acc = [0] * te
            for s in range(self.world):
                v = x[t * te:(t + 1) * te] if s == r else self.mem[r].data[("os", par, s, t)]
                acc = [a + b for a, b in zip(acc, v)]
                self._delay(r, vb, epoch, "sum")
            out[t * te:(t + 1) * te] = acc
        if self.reset_flags:
            self._delay(r, vb, epoch, "consume")
            self._consume(r, KIND_ONESHOT, vb)
        return True

    def _ll(self, r: int, vb: int, x: list, out: list, nbytes: int, epoch: int) -> bool:
        """ar_ll_block: every word carries its epoch; readers wait per word for exactly ``epoch``."""
        L, te, par = self.layout, self.tile_elems, self._par(epoch)
        for t in L.tiles_of_block(vb, nbytes):
            for p in range(self.world):
                if p == r:
                    continue
                m = self.mem[p]
                for i in range(t * te, (t + 1) * te):
                    with m.conds[vb]:  # one single-copy-atomic 8-byte store {value, epoch}
                        m.data[("ll", par, r, i)] = (epoch, x[i])
                        m.conds[vb].notify_all()
                    self._delay(r, vb, epoch, "push")
        m = self.mem[r]
        for t in L.tiles_of_block(vb, nbytes):
            for i in range(t * te, (t + 1) * te):
                acc = 0
                for s in range(self.world):
                    if s == r:
                        acc += x[i]
                        continue
                    key = ("ll", par, s, i)
                    with m.conds[vb]:
                        ok = m.conds[vb].wait_for(lambda: m.data.get(key, (None,))[0] == epoch
                                                  or any(q.status for q in self.mem), self.timeout_s)
                        if not ok or m.data.get(key, (None,))[0] != epoch:
                            if not m.status:
                                m.status = STATUS_TIMEOUT | s
                                self.errors.append(f"rank {r}: " + status_message(m.status))
                            return False
                        acc += m.data[key][1]
                    self._delay(r, vb, epoch, "sum")
                out[i] = acc
        return True

    def _rs_slot(self, t: int, owner: int, ct: int) -> int:
        return t - owner * ct if self.chunk_relative else t

    def _twoshot(self, r: int, vb: int, x: list, out: list, nbytes: int, epoch: int) -> bool:
        L, te, par, w = self.layout, self.tile_elems, self._par(epoch), self.world
        ct = L.chunk_tiles(nbytes)
        for t in L.tiles_of_block(vb, nbytes):
            owner = t // ct
            if owner != r:
                self.mem[owner].data[("rs", par, r, self._rs_slot(t, owner, ct))] = tuple(x[t * te:(t + 1) * te])
                self._delay(r, vb, epoch, "push")
        for p in range(w):
            if p != r:
                self._signal(r, p, KIND_REDUCE_SCATTER, vb, epoch)
        if not self._wait(r, KIND_REDUCE_SCATTER, vb, epoch):
            return False
        self._delay(r, vb, epoch, "read")
        for t in L.tiles_of_block(vb, nbytes):
            if t // ct != r:
                continue
            acc = [0] * te
            for s in range(w):
                v = x[t * te:(t + 1) * te] if s == r else self.mem[r].data[("rs", par, s, self._rs_slot(t, r, ct))]
                acc = [a + b for a, b in zip(acc, v)]
                self._delay(r, vb, epoch, "sum")
            out[t * te:(t + 1) * te] = acc
            for p in range(w):
                if p != r:
                    self.mem[p].data[("ag", par, 0, t)] = tuple(acc)
        for p in range(w):
            if p != r:
                self._signal(r, p, KIND_ALLGATHER, vb, epoch)
        if not self._wait(r, KIND_ALLGATHER, vb, epoch):
            return False
        for t in L.tiles_of_block(vb, nbytes):
            if t // ct != r:
                out[t * te:(t + 1) * te] = self.mem[r].data[("ag", par, 0, t)]
        return True

    # ---- driver ----------------------------------------------------------------------------------
    def run(self, rounds: int, sizes_elems=(4, 7), algos=("oneshot", "twoshot")) -> list[str]:
        """``rounds`` back-to-back all-reduces; round k uses size sizes_elems[k % len] (in elements, padded to
        whole 16-byte packs of the model: one element = one pack) and algorithm algos[k % len], each with its
        own epoch counter as on the host. Every output is checked against the exact integer sum.
        Returns the error list (empty = no race, no deadlock)."""
        te = self.tile_elems
        plan = []
        epochs = {a: 0 for a in algos}
        for k in range(rounds):
            a = algos[k % len(algos)]
            epochs[a] += 1
            plan.append((a, sizes_elems[k % len(sizes_elems)], epochs[a]))

        def value(r, k, i):  # small integers: sums are exact and any stale or foreign value shows
            return (r + 1) * 1000003 + k * 7919 + i

        def worker(r: int, vb: int):
            ctr = {a: 0 for a in algos}  # this block's device-side epoch counters (device_epochs mode)
            for k, (a, n, epoch) in enumerate(plan):
                nbytes = n * 16  # the layout counts 16-byte packs; one model element stands for one pack
                if vb >= self.layout.grid(nbytes):
                    continue  # as on the GPU: no block is launched past the last tile
                if self.device_epochs:
                    ctr[a] += 1
                    epoch = ctr[a]
                x = [value(r, k, i) for i in range(_round_up(n, te))]
                out = [None] * len(x)
                fn = {"oneshot": self._oneshot, "twoshot": self._twoshot, "ll": self._ll}[a]
                if not fn(r, vb, x, out, nbytes, epoch):
                    return
                for t in self.layout.tiles_of_block(vb, nbytes):
                    for i in range(t * te, min((t + 1) * te, n)):
                        want = sum(value(s, k, i) for s in range(self.world))
                        if out[i] != want:
                            self.errors.append(f"rank {r} round {k} ({a}, epoch {epoch}) element {i}: got "
                                               f"{out[i]}, want {want}")
                            for m in self.mem:
                                m.status = m.status or 1
                            return

        threads = [threading.Thread(target=worker, args=(r, vb), daemon=True)
                   for r in range(self.world) for vb in range(self.nblocks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout_s * 4 + rounds * 0.01)
            if t.is_alive():
                self.errors.append("deadlock: a rank thread did not finish")
                break
        return self.errors


# ==================================================================================================
# GPU communicator
# ==================================================================================================
class CustomAllReduce:
    """All-reduce across ``world`` GPUs of this process over peer-mapped comm buffers.

    ``allreduce(ins, outs, nbytes, dtype)`` launches on every rank's stream and returns without waiting;
    ``check()`` synchronises and raises DeviceError if any rank's kernel timed out. ``ins``/``outs`` are
    per-rank DeviceBuffers (or raw device pointers); nbytes must be a multiple of 16.
    """

    DTYPES = {"float32": "f32", "bfloat16": "bf16", "f32": "f32", "bf16": "bf16"}

    def __init__(self, devices: list[int] | None = None, max_bytes: int = 8 << 20, nblocks: int | None = None,
                 threads: int = 256, timeout_s: float = 5.0, streams: list | None = None,
                 defines: dict | None = None, device_epochs: bool = False):
        from ..gpu.runtime import device_count, get_runtime

        devices = list(range(device_count())) if devices is None else list(devices)
        self.world = len(devices)
        self.rts = [get_runtime(d) for d in devices]
        for i, a in enumerate(self.rts):
            for j, b in enumerate(self.rts):
                if i != j and not a.can_access_peer(b):
                    raise DeviceError(f"GPU {devices[i]} cannot access GPU {devices[j]}'s memory (no peer access); "
                                      "the custom all-reduce needs peer-to-peer: use --allreduce nccl")
        for i, a in enumerate(self.rts):
            for j, b in enumerate(self.rts):
                if i != j:
                    a.enable_peer_access(b)
        if nblocks is None:
            # Every virtual block must be resident at once (blocks spin on peers' blocks of the same
            # index); far below one block per SM keeps room for other work on the GPU.
            nblocks = min(64, min(rt.num_sms for rt in self.rts))
        self.layout = ArLayout(self.world, nblocks, threads * 16, max_bytes)
        self.threads = threads
        self.streams = streams or [rt.stream() for rt in self.rts]
        self.epochs = {"oneshot": 0, "twoshot": 0, "ll": 0}
        # device_epochs: the epoch lives in per-virtual-block device counters (the kernels' _graph variants),
        # so calls can be captured into a CUDA/HIP graph and replayed; host epochs are then never used.
        self.device_epochs = device_epochs
        # The _graph kernels (the TP decode step's) launch with programmatic dependent launch where the runtime
        # has it (gpu/ops.py pdl_enabled): the matvec after an all-reduce requests its weights meanwhile.
        from ..gpu.ops import pdl_enabled

        self.pdl = [device_epochs and pdl_enabled(rt) for rt in self.rts]
        self.ctrs = []
        self.broken: str | None = None
        self.bufs, self.status, self.tables, self.fns = [], [], [], []
        for rt in self.rts:
            buf = rt.malloc_fine_grained(self.layout.total_bytes)
            rt.memset(buf, 0, self.layout.total_bytes)  # flags start at epoch 0; the first round is 1
            st = rt.malloc(16)
            rt.memset(st, 0, 16)
            self.bufs.append(buf)
            self.status.append(st)
            if device_epochs:
                ctr = rt.malloc(3 * nblocks * 4)  # [oneshot, twoshot, ll][nblocks] u32
                rt.memset(ctr, 0, 3 * nblocks * 4)
                self.ctrs.append(ctr)
        bases = [b.ptr for b in self.bufs]
        timeout_ns = int(timeout_s * 1e9)
        for r, rt in enumerate(self.rts):
            tab = self.layout.table(r, bases, self.status[r].ptr, timeout_ns)
            self.tables.append(rt.upload(np.frombuffer(bytes(tab), dtype=np.uint8)))
            self.fns.append(rt.compile("comm/allreduce.hip", defines=defines))
        for rt in self.rts:
            rt.synchronize()

    def function(self, rank: int, algo: str, dtype: str, repeat: bool = False):
        name = f"allreduce_{algo}_{self.DTYPES[dtype]}" + ("_repeat" if repeat else "")
        return self.fns[rank].function(name)

    def pick(self, nbytes: int) -> str:
        if nbytes <= LL_MAX_BYTES:
            return "ll"
        return "oneshot" if self.world == 2 or nbytes <= ONESHOT_MAX_BYTES else "twoshot"

    def allreduce(self, ins: list, outs: list, nbytes: int, dtype: str = "float32", algo: str = "auto",
                  repeats: int = 0, streams: list | None = None) -> None:
        if self.broken:
            raise DeviceError(f"custom all-reduce unusable after an earlier failure: {self.broken}")
        if nbytes % 16 or nbytes <= 0 or nbytes > self.layout.slot_bytes:
            raise DeviceError(f"all-reduce size {nbytes} B must be a positive multiple of 16 up to "
                              f"{self.layout.slot_bytes} B (the communicator's max_bytes)")
        algo = self.pick(nbytes) if algo == "auto" else algo
        streams = streams or self.streams
        grid = self.layout.grid(nbytes)
        if self.device_epochs:
            if repeats:
                raise DeviceError("repeated all-reduce kernels use host epochs: create the communicator "
                                  "without device_epochs")
            row = ("oneshot", "twoshot", "ll").index(algo)
            for r, rt in enumerate(self.rts):
                ctr = self.ctrs[r].ptr + row * self.layout.nblocks * 4
                args = [ctypes.c_void_p(_ptr(ins[r])), ctypes.c_void_p(_ptr(outs[r])), ctypes.c_uint64(nbytes),
                        ctypes.c_void_p(self.tables[r].ptr), ctypes.c_void_p(ctr)]
                rt.launch(self.fns[r].function(f"allreduce_{algo}_{self.DTYPES[dtype]}_graph"), grid,
                          self.threads, args, stream=streams[r], pdl=self.pdl[r])
            return
        n = max(repeats, 1)
        epoch = self.epochs[algo] + 1
        self.epochs[algo] += n
        for r, rt in enumerate(self.rts):
            args = [ctypes.c_void_p(_ptr(ins[r])), ctypes.c_void_p(_ptr(outs[r])), ctypes.c_uint64(nbytes),
                    ctypes.c_void_p(self.tables[r].ptr), ctypes.c_uint32(epoch & 0xFFFFFFFF)]
            if repeats:
                args.append(ctypes.c_uint32(repeats))
            rt.launch(self.function(r, algo, dtype, bool(repeats)), grid, self.threads, args, stream=streams[r])

    def allreduce_residual_rmsnorm(self, partials: list, residuals: list, gammas: list, normeds: list, n: int,
                                   eps: float, dtype: str = "float32", streams: list | None = None) -> None:
        """Fused decode epilogue on every rank: residual += all-reduce(partial); normed = RMSNorm(residual)
        * gamma (residual, gamma, normed fp32; partial ``dtype``). Needs ``CustomAllReduce(nblocks=1)``."""
        if self.broken:
            raise DeviceError(f"custom all-reduce unusable after an earlier failure: {self.broken}")
        if self.layout.nblocks != 1 or self.device_epochs:
            raise DeviceError("fused all-reduce + RMSNorm needs a communicator created with nblocks=1 "
                              "(and host epochs)")
        esize = 4 if self.DTYPES[dtype] == "f32" else 2
        nbytes = n * esize
        if nbytes % 16 or nbytes <= 0 or nbytes > self.layout.slot_bytes:
            raise DeviceError(f"fused all-reduce: {n} elements x {esize} B must be a positive multiple of 16 B "
                              f"up to {self.layout.slot_bytes} B")
        streams = streams or self.streams
        self.epochs["oneshot"] += 1  # shares the one-shot flags and slots (same tile -> block map: nblocks=1)
        epoch = self.epochs["oneshot"] & 0xFFFFFFFF
        name = f"allreduce_residual_rmsnorm_{self.DTYPES[dtype]}"
        for r, rt in enumerate(self.rts):
            args = [ctypes.c_void_p(_ptr(partials[r])), ctypes.c_void_p(_ptr(residuals[r])),
                    ctypes.c_void_p(_ptr(gammas[r])), ctypes.c_void_p(_ptr(normeds[r])), ctypes.c_uint64(n),
                    ctypes.c_float(eps), ctypes.c_void_p(self.tables[r].ptr), ctypes.c_uint32(epoch)]
            rt.launch(self.fns[r].function(name), 1, self.threads, args, stream=streams[r])

    def delay(self, rank: int, ns: int, stream=None) -> None:
        """Enqueue a busy-wait of ``ns`` on rank's stream (tests: skew ranks' arrival)."""
        rt = self.rts[rank]
        rt.launch(self.fns[rank].function("allreduce_delay"), 1, 32, [ctypes.c_uint64(int(ns))],
                  stream=stream or self.streams[rank])

    def check(self) -> None:
        """Wait for all ranks, then raise DeviceError naming the rank a timed-out kernel was waiting for."""
        for s in self.streams:
            s.synchronize()
        for r, rt in enumerate(self.rts):
            code = int(rt.download(self.status[r], (4,), np.uint32)[0])
            if code:
                self.broken = f"rank {r}: " + status_message(code)
                raise DeviceError(status_message(code) + f" (on GPU rank {r}); the TP group must be restarted")

    def close(self) -> None:
        for b in self.bufs + self.status + self.tables + self.ctrs:
            b.free()
        self.bufs, self.status, self.tables, self.ctrs = [], [], [], []


def capture_graphs(rts: list, streams: list, issue) -> list:
    """One graph per rank holding whatever ``issue()`` enqueues on ``streams`` (which may span all ranks, as
    an NCCL group call or a custom all-reduce does). Each rank's capture is begun and ended by a thread of
    its own: in thread-local capture mode a thread with an open capture may not instantiate a graph, and a
    capture must end on the thread that began it, so one thread cannot capture several streams at once."""
    import threading

    n = len(rts)
    started, done = threading.Barrier(n + 1), threading.Event()
    graphs: list = [None] * n
    errors: list = []

    def worker(r: int) -> None:
        try:
            rts[r].begin_capture(streams[r])
        except Exception as e:  # still meet the barrier so the caller does not wait forever
            errors.append(e)
            started.wait()
            return
        started.wait()
        done.wait()
        try:
            graphs[r] = rts[r].end_capture(streams[r])
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    started.wait()
    try:
        if not errors:
            issue()
    finally:
        done.set()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return graphs


def _ptr(x) -> int:
    return x.ptr if hasattr(x, "ptr") else int(x)
