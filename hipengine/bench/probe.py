"""``hipengine bench probe [--json OUT] [--peers]``: the ceilings every other figure is divided by.

  hbm_read    bytes/s streaming a >= 4 GiB buffer once (a real reduction, checked against the host),
              grid sized from the device (SMs/CUs x blocks per SM, best of a few occupancies), median of N
              event-timed runs. Decode is read-bound, so roofline tok/s = hbm_read / bytes per token.
  copy        bytes/s of a device-to-device copy kernel, reads + writes counted.
  launch      µs per empty kernel: eager (back-to-back launches from Python on one stream) and inside a
              captured graph (the floor a monokernel-free design would pay per kernel).
  per-SM read every SM streams its own slice at once (256 KiB, 512 KiB, 16 MiB each); the slowest SM's time
              over the median's (a matvec split evenly over SMs ends with the slowest) and whether the slow
              SMs are the same ones launch after launch.
  flag        µs for one L2-hit flag operation by one thread per SM just after its block's warps requested
              8 KiB each from HBM (the monokernel's barrier): an acquire poll idle, beside streaming warps,
              behind the poller's own warp's loads, async copies or (sm_90+) bulk copies; a relaxed poll; the
              arrival's release.
  --peers     for every GPU pair: peer copy bandwidth (kernel push and driver copy) and the one-way latency of
              a flag written through peer-mapped memory (ping-pong of release/acquire stores at system scope).

``measure_hbm_read_bandwidth(rt)`` is imported by the decode benchmark for its roofline.
"""
from __future__ import annotations

import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from ..errors import DeviceError
from . import git_commit, utc_now

PROBE_SOURCE = "ops/probe.hip"
BLOCK = 256  # threads per block of the bandwidth kernels: 8 warps (NVIDIA) / 4 waves (AMD)
READ_BYTES = 4 << 30  # >= 4 GiB: dozens of times any L2/MALL/Infinity Cache, so every byte comes from HBM
REPS = 10
LAUNCHES = 200  # empty kernels per timed batch
PEER_BYTES = 256 << 20
PING_ROUNDS = 2000
PING_TIMEOUT_NS = 2_000_000_000


def _module(rt):
    return rt.compile(PROBE_SOURCE)


def _median_ms(rt, stream, body, reps: int, warmup: int = 2) -> float:
    """Median device time (ms) of ``body()`` enqueued on ``stream``, bracketed by events."""
    for _ in range(warmup):
        body()
    start, end = rt.event(), rt.event()
    times = []
    for _ in range(reps):
        start.record(stream)
        body()
        end.record(stream)
        times.append(start.elapsed_ms(end))
    return statistics.median(times)


def _read_size(rt, nbytes: int | None) -> int:
    free, _ = rt.mem_info()
    want = READ_BYTES if nbytes is None else int(nbytes)
    # Leave room for everything else on the device; never below 8x L2 or the figure measures the cache.
    size = min(want, int(free * 0.6))
    if size < 8 * rt.l2_bytes:
        raise DeviceError(f"only {free / 2**30:.1f} GiB free on GPU {rt.device_index}: too little to measure "
                          "HBM bandwidth past the L2 cache")
    return size // 16 * 16


def _blocks_per_sm_candidates(rt, fn) -> list[int]:
    occ = max(1, rt.max_active_blocks(fn, BLOCK))
    return sorted({b for b in (1, 2, 4, 8, occ) if b <= occ})


def hbm_read(rt, nbytes: int | None = None, reps: int = REPS) -> dict:
    """Read-bandwidth probe with its details: bytes, best grid, per-occupancy medians."""
    fn = _module(rt).function("probe_read")
    n = _read_size(rt, nbytes)
    buf = rt.malloc(n)
    out = rt.malloc(4)
    s = rt.stream()
    try:
        rt.memset(buf, 1, n)  # every 32-bit word is 0x01010101: the sum is known exactly
        expect = (n // 4 * 0x01010101) & 0xFFFFFFFF
        n_vec = n // 16
        tried = {}
        for bps in _blocks_per_sm_candidates(rt, fn):
            grid = rt.num_sms * bps
            args = [buf, ctypes.c_uint64(n_vec), out]

            def body():
                rt.memset(out, 0, 4, stream=s)
                rt.launch(fn, grid, BLOCK, args, stream=s)

            ms = _median_ms(rt, s, body, reps)
            got = int(rt.download(out, (1,), np.uint32)[0])
            if got != expect:
                raise DeviceError(f"probe_read checksum {got:#x} != {expect:#x} (grid {grid}x{BLOCK}): kernel bug")
            tried[bps] = n / (ms / 1e3)
        best = max(tried, key=tried.get)
        return {"bytes": n, "bytes_per_s": tried[best], "grid": rt.num_sms * best, "block": BLOCK,
                "blocks_per_sm": best, "by_blocks_per_sm": {str(k): v for k, v in tried.items()}}
    finally:
        s.synchronize()
        s.destroy()
        buf.free()
        out.free()


def measure_hbm_read_bandwidth(rt, nbytes: int | None = None, reps: int = REPS) -> float:
    """Measured HBM read bandwidth of ``rt``'s device in bytes/s (the decode roofline's numerator)."""
    return hbm_read(rt, nbytes, reps)["bytes_per_s"]


SM_SLICES = (256 << 10, 512 << 10, 16 << 20)  # bytes per SM: a short matvec stage's share, gate/up's, steady
SM_REPS = 40
SM_BLOCK = 1024  # threads: 64 KiB in flight per SM (the monokernel's 8 warps x 8 KiB), enough to saturate HBM


def per_sm_read(rt, slices=SM_SLICES, reps: int = SM_REPS, block: int = SM_BLOCK) -> list[dict]:
    """Every SM/CU streams its own slice at the same time (one block each); per SM, the median time over
    ``reps`` launches. A matvec split statically over SMs ends with the slowest: ``max_over_median`` is what
    that costs, and ``halves_corr`` (per-SM medians of the first vs the second half of the launches) says
    whether the slow SMs are the same ones each time — a property of the SM, not noise."""
    fn = _module(rt).function("probe_read_sm")
    nb = rt.num_sms
    smem = rt.max_shared_per_block  # > half an SM's shared memory: one block per SM
    row = 5  # probe.hip kProbeSmRow
    out = rt.malloc(8 * row * nb)
    s = rt.stream()
    res = []
    try:
        for per in slices:
            n = per * nb
            expect = (per // 4 * 0x01010101) & 0xFFFFFFFF
            # L2 would serve a second read of a small buffer: rotate over copies of >= 4x L2 in all
            ncopy = max(1, -(-4 * rt.l2_bytes // n))
            bufs = []
            try:
                for _ in range(ncopy):
                    bufs.append(rt.malloc(n))
                    rt.memset(bufs[-1], 1, n)
                times, spans = {}, []
                for r in range(reps + 2):
                    rt.launch(fn, nb, block, [bufs[r % ncopy], ctypes.c_uint64(per // 16), out], shared=smem, stream=s)
                    s.synchronize()
                    v = rt.download(out, (nb, row), np.uint64)
                    if (v[:, 4] != expect).any():
                        raise DeviceError("probe_read_sm checksum mismatch: kernel bug")
                    if r < 2:
                        continue  # warm-up
                    spans.append(int(v[:, 3].max()) - int(v[:, 2].min()))  # first start to last end, ns
                    for sm, cyc in zip(v[:, 0].tolist(), v[:, 1].tolist()):
                        times.setdefault(int(sm), []).append(float(cyc))
            finally:
                for b in bufs:
                    b.free()
            sms = sorted(times)
            med = np.array([statistics.median(times[k]) for k in sms])
            h = reps // 2
            a = np.array([statistics.median(times[k][:h]) for k in sms])
            b = np.array([statistics.median(times[k][h:]) for k in sms])
            corr = float(np.corrcoef(a, b)[0, 1]) if len(sms) > 2 and a.std() > 0 and b.std() > 0 else 0.0
            span = statistics.median(spans)
            res.append({"bytes_per_sm": per, "threads": block, "sms": len(sms), "sm_ids": sms,
                        "cycles_median_per_sm": [round(x) for x in med.tolist()],
                        "min_over_median": float(med.min() / np.median(med)),
                        "max_over_median": float(med.max() / np.median(med)),
                        "p90_over_median": float(np.percentile(med, 90) / np.median(med)),
                        "halves_corr": corr,
                        "all_sms_gbps": n / span if span else None})
        return res
    finally:
        s.synchronize()
        s.destroy()
        out.free()


POLL_ROUNDS = 200
# probe.hip probe_poll's modes: what thread 0 does right after its block's warps requested 8 KiB each from HBM
POLL_MODES = {0: "poll, idle", 1: "poll beside 7 streaming warps", 2: "poll behind its own warp's loads",
              3: "relaxed poll behind its own warp's loads", 4: "poll behind its own warp's async copies",
              5: "release (arrival) behind its own warp's loads", 6: "release (arrival) beside 7 streaming warps",
              7: "poll behind its own warp's bulk copies", 8: "release (arrival) behind its own warp's bulk copies"}
POLL_OWN_STREAM = (2, 3, 4, 5, 7, 8)  # modes in which thread 0's own warp streams (its checksum is not 0)
POLL_BULK = (7, 8)  # modes that need the bulk-copy engine (port.h kHasBulkCopy: ops.bulk_copy_supported)


def poll_latency(rt, rounds: int = POLL_ROUNDS, reps: int = 3, bulk_kib: tuple = (16, 24)) -> dict:
    """What a monokernel grid barrier's thread 0 waits for: µs for one operation on a flag (an L2 hit) by thread
    0 of each block (one per SM/CU) right after the block's warps requested 8 KiB each from HBM — a device-scope
    acquire poll (the barrier's wait), a relaxed poll, or the release reduction of the barrier's arrival — with
    thread 0's own warp streaming or not, and with the batch requested as loads or as asynchronous copies
    (probe.hip probe_poll, POLL_MODES). Also the time until thread 0's lane has its own batch ("batch_us").
    Median over blocks of the per-round mean, median of ``reps`` launches; ``us_max`` is the slowest block's.
    The bulk-copy poll is also timed with ``bulk_kib`` KiB per warp in flight (a deeper prefetch), where the
    block's shared memory holds them."""
    from ..gpu.ops import bulk_copy_supported

    fn = _module(rt).function("probe_poll")
    nb, row = rt.num_sms, 5  # probe.hip kProbePollRow
    warps = BLOCK // rt.warp_size
    base_vecs = 16 * rt.warp_size  # kProbePollUnroll 16-byte vectors per lane: 8 KiB per warp on NVIDIA
    bulk = bulk_copy_supported(rt.arch)  # without the engine (AMD CDNA) the bulk modes would trap
    runs = [(mode, name, base_vecs) for mode, name in POLL_MODES.items() if bulk or mode not in POLL_BULK]
    if bulk:
        for kib in bulk_kib:
            vecs = kib * 1024 // 16
            if vecs > base_vecs and warps * vecs * 16 + 8 * warps <= rt.max_shared_per_block:
                runs.append((7, f"{POLL_MODES[7]}, {kib} KiB per warp", vecs))
    max_vecs = max(v for _, _, v in runs)
    nbytes = rounds * nb * warps * max_vecs * 16
    src, flag, out = rt.malloc(nbytes), rt.malloc(256), rt.malloc(8 * row * nb)
    s = rt.stream()
    res = {"rounds": rounds, "blocks": nb, "threads": BLOCK, "bytes_per_round": nb * warps * base_vecs * 16}
    try:
        rt.memset(src, 1, nbytes)
        rt.memset(flag, 0, 256)
        for mode, name, vecs in runs:
            ops, batches, maxes = [], [], []
            for _ in range(reps + 1):
                rt.launch(fn, nb, BLOCK, [src, flag, ctypes.c_int32(mode), ctypes.c_int32(rounds),
                                          ctypes.c_int32(vecs), out],
                          shared=rt.max_shared_per_block, stream=s)
                s.synchronize()
                raw = rt.download(out, (nb, row), np.uint64)
                # thread 0's checksum: its own lane's words (every byte 1) when its warp streams, else 0
                expect = (rounds * 16 * 4 * 0x01010101) & 0xFFFFFFFF if mode in POLL_OWN_STREAM else 0
                if (raw[:, 4] != expect).any():
                    raise DeviceError("probe_poll checksum mismatch: kernel bug")
                v = raw.astype(np.float64)
                ns_per_cycle = v[:, 3] / np.maximum(v[:, 2], 1)
                us = v[:, 0] / rounds * ns_per_cycle / 1e3
                ops.append(float(np.median(us)))
                maxes.append(float(us.max()))
                batches.append(float(np.median(v[:, 1] / rounds * ns_per_cycle / 1e3)))
            res[name] = {"mode": mode, "kib_per_warp": vecs * 16 / 1024, "us": statistics.median(ops[1:]),
                         "us_max": statistics.median(maxes[1:]),
                         "batch_us": statistics.median(batches[1:]) if mode in POLL_OWN_STREAM else None}
        return res
    finally:
        s.synchronize()
        s.destroy()
        for b in (src, flag, out):
            b.free()


def _copy_bps(rt, src, dst, nbytes: int, grid: int, reps: int, stream) -> float:
    fn = _module(rt).function("probe_copy")
    args = [src, dst, ctypes.c_uint64(nbytes // 16)]
    ms = _median_ms(rt, stream, lambda: rt.launch(fn, grid, BLOCK, args, stream=stream), reps)
    return nbytes / (ms / 1e3)


def copy_bandwidth(rt, nbytes: int | None = None, grid: int | None = None, reps: int = REPS) -> dict:
    """Device-local copy kernel; bytes/s counts both the read and the write (2 x size)."""
    half = _read_size(rt, None if nbytes is None else nbytes * 2) // 2 // 16 * 16
    grid = grid or rt.num_sms * 4
    src, dst = rt.malloc(half), rt.malloc(half)
    s = rt.stream()
    try:
        rt.memset(src, 7, half)
        bps = _copy_bps(rt, src, dst, half, grid, reps, s)
        probe = rt.download(dst, (1 << 20,), np.uint8)
        if not (probe == 7).all():
            raise DeviceError("probe_copy produced wrong data: kernel bug")
        return {"bytes": half, "bytes_per_s": 2 * bps, "grid": grid}
    finally:
        s.synchronize()
        s.destroy()
        src.free()
        dst.free()


def launch_overhead(rt, launches: int = LAUNCHES, reps: int = 7) -> dict:
    """µs per empty kernel: eager (device time per launch over a back-to-back batch, and host time per
    launch call) and inside one captured graph."""
    fn = _module(rt).function("probe_empty")
    s = rt.stream()

    def batch():
        for _ in range(launches):
            rt.launch(fn, 1, 64, [], stream=s)

    host = []
    for _ in range(reps):
        t0 = time.perf_counter()
        batch()
        host.append((time.perf_counter() - t0) / launches * 1e6)
        s.synchronize()
    eager = _median_ms(rt, s, batch, reps) * 1e3 / launches
    rt.begin_capture(s)
    batch()
    graph = rt.end_capture(s)
    try:
        in_graph = _median_ms(rt, s, lambda: graph.launch(s), reps) * 1e3 / launches
    finally:
        s.synchronize()
        graph.destroy()
        s.destroy()
    return {"eager_us": eager, "eager_host_call_us": statistics.median(host), "graph_us": in_graph,
            "launches_per_batch": launches}


def peer_pair(ra, rb, nbytes: int = PEER_BYTES, rounds: int = PING_ROUNDS, reps: int = 5) -> dict:
    """Copy bandwidth a -> b (kernel on a writing b's memory, and the driver's copy) and one-way flag latency."""
    if not (ra.can_access_peer(rb) and rb.can_access_peer(ra)):
        return {"a": ra.device_index, "b": rb.device_index, "error": "no peer access between these GPUs"}
    ra.enable_peer_access(rb)
    rb.enable_peer_access(ra)
    out = {"a": ra.device_index, "b": rb.device_index}
    src, dst = ra.malloc(nbytes), rb.malloc(nbytes)
    sa, sb = ra.stream(), rb.stream()
    flag_a, flag_b = ra.malloc_fine_grained(64), rb.malloc_fine_grained(64)
    res_a, res_b = ra.malloc(16), rb.malloc(16)
    try:
        ra.memset(src, 3, nbytes)
        out["copy_kernel_bytes_per_s"] = _copy_bps(ra, src, dst, nbytes, ra.num_sms * 4, reps, sa)
        if not (rb.download(dst, (1 << 16,), np.uint8) == 3).all():
            raise DeviceError(f"peer copy GPU {ra.device_index} -> {rb.device_index} produced wrong data")
        ms = _median_ms(ra, sa, lambda: ra.copy_dtod(dst, src, nbytes, stream=sa), reps)
        out["copy_driver_bytes_per_s"] = nbytes / (ms / 1e3)

        fa, fb = _module(ra).function("probe_pingpong"), _module(rb).function("probe_pingpong")
        one_way = []
        for _ in range(reps):
            ra.memset(flag_a, 0, 64)
            rb.memset(flag_b, 0, 64)
            # Responder first: it must be resident and polling before the initiator's first store lands
            # (it would still see it later, but then the first round's time includes its launch).
            rb.launch(fb, 1, 64, [flag_b, flag_a, ctypes.c_int32(rounds), ctypes.c_int32(0),
                                  ctypes.c_uint64(PING_TIMEOUT_NS), res_b], stream=sb)
            ra.launch(fa, 1, 64, [flag_a, flag_b, ctypes.c_int32(rounds), ctypes.c_int32(1),
                                  ctypes.c_uint64(PING_TIMEOUT_NS), res_a], stream=sa)
            sa.synchronize()
            sb.synchronize()
            ns, done = (int(v) for v in ra.download(res_a, (2,), np.uint64))
            if done != rounds:
                raise DeviceError(f"ping-pong GPU {ra.device_index} <-> {rb.device_index} timed out after "
                                  f"{done}/{rounds} rounds: peer stores are not reaching the other GPU")
            one_way.append(ns / (2 * rounds) / 1e3)
        out["one_way_latency_us"] = statistics.median(one_way)
        out["ping_rounds"] = rounds
    finally:
        sa.synchronize()
        sb.synchronize()
        sa.destroy()
        sb.destroy()
        for b in (src, dst, flag_a, flag_b, res_a, res_b):
            b.free()
    return out


def probe(peers: bool = False, log=print) -> dict:
    from ..gpu.runtime import device_count, get_runtime

    n = device_count()
    if n == 0:
        get_runtime(0)  # raises the runtime's own "no GPU found" DeviceError
    rt = get_runtime(0)
    log(f"GPU 0: {rt.name} ({rt.arch}, {rt.num_sms} {'SMs' if rt.vendor == 'nvidia' else 'CUs'}, "
        f"L2 {rt.l2_bytes / 2**20:.0f} MiB, {rt.total_mem / 2**30:.0f} GiB); {n} GPU(s)")
    result = {"bench": "probe", "commit": git_commit(), "date": utc_now(), "gpu": rt.name, "arch": rt.arch,
              "vendor": rt.vendor, "num_gpus": n, "num_sms": rt.num_sms, "l2_bytes": rt.l2_bytes}
    read = hbm_read(rt)
    result["hbm_read"] = read
    log(f"HBM read      {read['bytes_per_s'] / 1e9:8.1f} GB/s   ({read['bytes'] / 2**30:.1f} GiB, "
        f"grid {read['grid']}x{BLOCK}, {read['blocks_per_sm']} blocks/SM)")
    copy = copy_bandwidth(rt, grid=read["grid"])
    result["copy"] = copy
    log(f"copy (r+w)    {copy['bytes_per_s'] / 1e9:8.1f} GB/s")
    launch = launch_overhead(rt)
    result["launch"] = launch
    log(f"launch eager  {launch['eager_us']:8.2f} µs/kernel (host call {launch['eager_host_call_us']:.2f} µs)")
    log(f"launch graph  {launch['graph_us']:8.2f} µs/kernel")
    result["per_sm_read"] = per_sm = per_sm_read(rt)
    for r in per_sm:
        log(f"per-SM read   {r['bytes_per_sm'] >> 10:6d} KiB each, all at once: slowest {r['max_over_median']:.3f}x, "
            f"p90 {r['p90_over_median']:.3f}x, fastest {r['min_over_median']:.3f}x the median SM's time "
            f"(same SMs slow run to run: corr {r['halves_corr']:.2f}); all SMs {r['all_sms_gbps'] or 0:.0f} GB/s")
    result["poll"] = poll = poll_latency(rt)
    for name, r in poll.items():
        if not isinstance(r, dict):
            continue
        log(f"flag          {r['us']:6.2f} µs (slowest block {r['us_max']:.2f}) {name}"
            + (f"; its lane's 8 KiB batch {r['batch_us']:.2f} µs" if r["batch_us"] is not None else ""))
    if peers:
        if n < 2:
            msg = f"--peers needs at least 2 GPUs; this machine has {n}"
            log(msg)
            result["peers"] = {"skipped": msg}
        else:
            pairs = []
            for a in range(n):
                for b in range(n):
                    if a != b:
                        p = peer_pair(get_runtime(a), get_runtime(b))
                        pairs.append(p)
                        if "error" in p:
                            log(f"peer {a}->{b}: {p['error']}")
                        else:
                            log(f"peer {a}->{b}    copy {p['copy_kernel_bytes_per_s'] / 1e9:7.1f} GB/s (kernel) "
                                f"{p['copy_driver_bytes_per_s'] / 1e9:7.1f} GB/s (driver), "
                                f"one-way flag {p['one_way_latency_us']:.2f} µs")
            result["peers"] = pairs
    return result


def run(args) -> int:
    result = probe(peers=bool(getattr(args, "peers", False)))
    out = getattr(args, "json", None)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    return 0
