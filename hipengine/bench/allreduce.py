"""``hipengine bench allreduce --tp N [--sizes 1K..4M] [--json OUT] [--plot OUT.png]``

Per message size (float32 elements; the decode step's all-reduce is one hidden vector, 4-16 KB):
  custom one-shot / two-shot, standalone  one launch per all-reduce from Python, timed with device events
                                          over a batch of back-to-back calls (launch overhead included)
  custom ..., in a graph                  a batch captured into one graph per rank (device-side epochs)
  custom ..., in-kernel                   K rounds inside one launch (the ``_repeat`` kernels); per round
  NCCL/RCCL eager                         one ncclAllReduce per call, batch timed like the standalone
  NCCL/RCCL in a graph                    a batch captured into one CUDA/HIP graph per rank, per call
Every path is validated first: integer-valued inputs (exact sums in float32), the expected sum on every
rank, and bitwise-identical results across ranks. Medians of several batches; bus bandwidth as NCCL
defines it (algbw x 2(n-1)/n). Inputs are not rotated: a decode step's all-reduce input was just written
by the same GPU and sits in L2, which is the case this measures.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from ..comm.allreduce import LL_MAX_BYTES, ONESHOT_MAX_BYTES, capture_graphs
from ..errors import DeviceError, HipEngineError
from . import git_commit

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v  # never NVLink multicast (see nccl.py)

UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20}
BATCH = 50  # calls per timed batch
REPEATS = 7  # batches per figure; the median is reported
IN_KERNEL_ROUNDS = 200
LL_TIMED_MAX_BYTES = 1 << 20  # LL doubles the bytes on the wire: only worth timing for small messages


def parse_size(s: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", s)
    if not m or m.group(2).upper() not in UNITS:
        raise HipEngineError(f"bad size {s!r}: use e.g. 4K, 1M, 256")
    return int(m.group(1)) * UNITS[m.group(2).upper()]


def parse_sizes(spec: str) -> list[int]:
    """'1K..4M' -> powers of two from 1K to 4M; '4K,16K' -> that list. Sizes are rounded up to 16 bytes."""
    if ".." in spec:
        lo, hi = (parse_size(x) for x in spec.split("..", 1))
        if lo <= 0 or hi < lo:
            raise HipEngineError(f"bad size range {spec!r}")
        out, s = [], lo
        while s <= hi:
            out.append(s)
            s *= 2
    else:
        out = [parse_size(x) for x in spec.split(",") if x.strip()]
    if not out:
        raise HipEngineError(f"no sizes in {spec!r}")
    return [max(16, -(-s // 16) * 16) for s in out]


def _inputs(world: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # |x| <= 64 integers: any sum of <= 8 ranks is exact in float32 (and in bf16 up to 256).
    return [rng.integers(-64, 65, n).astype(np.float32) for _ in range(world)]


class Harness:
    def __init__(self, tp: int, max_bytes: int):
        from ..comm.allreduce import CustomAllReduce
        from ..gpu.runtime import device_count

        n = device_count()
        if n < tp:
            raise DeviceError(f"bench allreduce --tp {tp} needs {tp} GPUs, found {n}")
        self.tp = tp
        self.custom = CustomAllReduce(list(range(tp)), max_bytes=max_bytes)
        self.rts = self.custom.rts
        self.streams = self.custom.streams
        # a second communicator with device-side epochs, so its calls can live in a graph like NCCL's
        self.custom_g = CustomAllReduce(list(range(tp)), max_bytes=max_bytes, streams=self.streams,
                                        device_epochs=True)
        self.nccl = None
        self.nccl_error = None
        try:
            from ..comm.nccl import NcclComm

            self.nccl = NcclComm(list(range(tp)))
        except HipEngineError as e:
            self.nccl_error = str(e)
        self.ins = [rt.malloc(max_bytes) for rt in self.rts]
        self.outs = [rt.malloc(max_bytes) for rt in self.rts]
        self.ev = [(rt.event(), rt.event()) for rt in self.rts]

    # ---- helpers -------------------------------------------------------------------------------
    def upload(self, xs: list[np.ndarray]) -> None:
        self.sync()  # the copies below are synchronous but not ordered with our (non-blocking) streams
        for r, (rt, x) in enumerate(zip(self.rts, xs)):
            rt.copy_htod(self.ins[r], x)
            rt.memset(self.outs[r], 0xFF, x.nbytes)  # NaN poison: an unwritten output element shows

    def sync(self) -> None:
        for s in self.streams:
            s.synchronize()

    def results(self, n: int) -> list[np.ndarray]:
        self.sync()
        return [rt.download(o, (n,), np.float32) for rt, o in zip(self.rts, self.outs)]

    def timed(self, issue, per_call_div: int) -> float:
        """Median over REPEATS of (slowest rank's event time for one issue()) / per_call_div, in µs."""
        samples = []
        for _ in range(REPEATS):
            self.sync()
            for (a, _), s in zip(self.ev, self.streams):
                a.record(s)
            issue()
            for (_, b), s in zip(self.ev, self.streams):
                b.record(s)
            samples.append(max(a.elapsed_ms(b) for a, b in self.ev) * 1e3 / per_call_div)
        return statistics.median(samples)

    # ---- paths ---------------------------------------------------------------------------------
    def custom_call(self, algo: str, nbytes: int, repeats: int = 0):
        return lambda: self.custom.allreduce(self.ins, self.outs, nbytes, "float32", algo, repeats=repeats)

    def custom_graph(self, algo: str, nbytes: int, calls: int):
        return capture_graphs(self.rts, self.streams, lambda: [
            self.custom_g.allreduce(self.ins, self.outs, nbytes, "float32", algo) for _ in range(calls)])

    def nccl_call(self, n: int):
        return lambda: self.nccl.allreduce(self.ins, self.outs, n, "float32", streams=self.streams)

    def nccl_graph(self, n: int, calls: int):
        """One graph per rank holding `calls` all-reduces (captured together in one NCCL group per call)."""
        return capture_graphs(self.rts, self.streams, lambda: [
            self.nccl.allreduce(self.ins, self.outs, n, "float32", streams=self.streams) for _ in range(calls)])

    def check(self, what: str, xs: list[np.ndarray]) -> None:
        want = np.sum(np.stack(xs).astype(np.float64), axis=0)
        got = self.results(xs[0].size)
        self.custom.check()
        self.custom_g.check()
        for r, g in enumerate(got):
            if not np.array_equal(g, want):
                bad = int(np.flatnonzero(g != want)[0])
                raise DeviceError(f"{what}: rank {r} element {bad} = {g[bad]}, expected {want[bad]}")
            if g.tobytes() != got[0].tobytes():
                raise DeviceError(f"{what}: rank {r} differs bitwise from rank 0")


def _nccl_row(h: Harness, row: dict, xs: list[np.ndarray], n: int) -> None:
    h.upload(xs)
    h.nccl_call(n)()
    h.check("NCCL eager", xs)
    row["nccl_eager_us"] = h.timed(lambda: [h.nccl_call(n)() for _ in range(BATCH)], BATCH)
    h.sync()
    graphs = h.nccl_graph(n, BATCH)
    try:
        h.upload(xs)
        for g, s in zip(graphs, h.streams):
            g.launch(s)
        h.check("NCCL graph", xs)
        row["nccl_graph_us"] = h.timed(lambda: [g.launch(s) for g, s in zip(graphs, h.streams)], BATCH)
    finally:
        h.sync()
        for g in graphs:
            g.destroy()


def run_bench(tp: int, sizes: list[int], log=print) -> dict:
    h = Harness(tp, max(sizes))
    rows = []
    for nbytes in sizes:
        n = nbytes // 4
        xs = _inputs(tp, n, seed=nbytes)
        row = {"bytes": nbytes}
        # validate every path before timing it
        paths = [("oneshot", "custom one-shot"), ("twoshot", "custom two-shot")]
        if nbytes <= LL_TIMED_MAX_BYTES:
            paths.insert(0, ("ll", "custom one-shot LL"))
        for algo, name in paths:
            h.upload(xs)
            h.custom_call(algo, nbytes)()
            h.check(name, xs)
            h.upload(xs)
            h.custom_call(algo, nbytes, repeats=7)()
            h.check(name + " repeated", xs)
        for algo, _ in paths:
            h.custom_call(algo, nbytes)()  # warm-up
            row[f"custom_{algo}_us"] = h.timed(lambda: [h.custom_call(algo, nbytes)() for _ in range(BATCH)], BATCH)
            row[f"custom_{algo}_inkernel_us"] = h.timed(h.custom_call(algo, nbytes, IN_KERNEL_ROUNDS),
                                                        IN_KERNEL_ROUNDS)
            h.custom.check()
            graphs = h.custom_graph(algo, nbytes, BATCH)
            try:
                h.upload(xs)
                for g, s in zip(graphs, h.streams):
                    g.launch(s)
                h.check(f"custom {algo} graph", xs)
                row[f"custom_{algo}_graph_us"] = h.timed(lambda: [g.launch(s) for g, s in zip(graphs, h.streams)],
                                                         BATCH)
                h.custom_g.check()
            finally:
                h.sync()
                for g in graphs:
                    g.destroy()
        if h.nccl is not None:
            try:
                _nccl_row(h, row, xs, n)
            except DeviceError as e:  # keep the custom figures; say what failed
                row["nccl_error"] = str(e)
                log(f"NCCL at {nbytes} B: {e}")
        best_custom = min(row[f"custom_{a}_inkernel_us"] for a, _ in paths)
        row["custom_best_inkernel_busbw_GBs"] = nbytes / (best_custom * 1e-6) * 2 * (tp - 1) / tp / 1e9
        if "nccl_graph_us" in row:
            row["nccl_graph_busbw_GBs"] = nbytes / (row["nccl_graph_us"] * 1e-6) * 2 * (tp - 1) / tp / 1e9
        rows.append(row)
        log(_fmt_row(row))
    info = {
        "bench": "allreduce", "tp": tp, "dtype": "float32", "commit": git_commit(),
        "gpu": h.rts[0].name, "arch": h.rts[0].arch, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "nccl": (h.nccl.lib.path + " " + h.nccl.lib.version()) if h.nccl else f"unavailable: {h.nccl_error}",
        "auto_pick": {"ll_max_bytes": LL_MAX_BYTES, "oneshot_max_bytes_world_gt_2": ONESHOT_MAX_BYTES},
        "nblocks": h.custom.layout.nblocks, "threads": h.custom.threads,
        "method": f"median of {REPEATS} batches; standalone/eager = device-event time of {BATCH} back-to-back "
                  f"Python launches / {BATCH}; in-kernel = {IN_KERNEL_ROUNDS} rounds in one launch / "
                  f"{IN_KERNEL_ROUNDS}; graph (custom with device epochs, NCCL) = {BATCH} captured calls / {BATCH}; "
                  "slowest rank",
        "rows": rows,
    }
    if h.nccl:
        h.nccl.close()
    h.custom.close()
    h.custom_g.close()
    return info


COLS = [("custom_ll_us", "ll"), ("custom_ll_graph_us", "ll-g"), ("custom_ll_inkernel_us", "ll-k"),
        ("custom_oneshot_us", "1shot"), ("custom_twoshot_us", "2shot"), ("custom_oneshot_graph_us", "1shot-g"),
        ("custom_twoshot_graph_us", "2shot-g"), ("custom_oneshot_inkernel_us", "1shot-k"),
        ("custom_twoshot_inkernel_us", "2shot-k"), ("nccl_eager_us", "nccl"), ("nccl_graph_us", "nccl-g")]


def _size(b: int) -> str:
    return f"{b >> 20}M" if b >= 1 << 20 and not b % (1 << 20) else (f"{b >> 10}K" if b >= 1024 and not b % 1024 else str(b))


def _fmt_row(row: dict) -> str:
    cells = [f"{row[k]:9.2f}" if k in row else f"{'-':>9}" for k, _ in COLS]
    return f"{_size(row['bytes']):>6} " + " ".join(cells) + f" {row['custom_best_inkernel_busbw_GBs']:9.1f}"


def table(info: dict) -> str:
    head = f"{'size':>6} " + " ".join(f"{n:>9}" for _, n in COLS) + f" {'busbw-k':>9}"
    lines = [f"all-reduce, {info['tp']} x {info['gpu']}, float32, µs per call (median); busbw GB/s of the best "
             f"in-kernel custom", head]
    lines += [_fmt_row(r) for r in info["rows"]]
    return "\n".join(lines)


def plot(info: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    xs = [r["bytes"] for r in info["rows"]]
    for key, name in COLS:
        ys = [r.get(key) for r in info["rows"]]
        if any(y is not None for y in ys):
            ax.plot(xs, ys, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message bytes")
    ax.set_ylabel("µs per all-reduce (median)")
    ax.set_title(f"all-reduce, {info['tp']} x {info['gpu']} — {info['commit'][:10]} {info['date'][:10]}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args) -> int:
    try:
        sizes = parse_sizes(args.sizes)
        if args.tp < 2:
            raise HipEngineError("bench allreduce needs --tp 2 or more")
        t0 = time.time()
        info = run_bench(args.tp, sizes, log=lambda s: print(s, file=sys.stderr, flush=True))
        info["wall_s"] = round(time.time() - t0, 1)
    except HipEngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(info, indent=1))
    if args.plot:
        plot(info, args.plot)
    print(table(info))
    return 0
