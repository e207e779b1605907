"""Tensor-parallel decode (TpGpuBackend) against tp=1.

On the CPU: an emulated multi-GPU node. Every kernel launch runs through the numpy oracles of
test_gpu_engine.EmulatedRuntime, but here each GPU has its own address range (a rank touching another
rank's buffer fails as a wild pointer), streams are real queues (work runs only when the host synchronises,
reads back, or a collective needs it, in the laziest order that is still valid), graphs are captured per
stream and replayed, and the collectives are matched as on the device: the custom all-reduce by its
peer-table group and epoch (read from the device-side counters of the ``_graph`` kernels), NCCL by each
rank's k-th call on the communicator. A rank waiting on a collective no peer joins is a deadlock error.

On 2+ GPUs (multigpu): TP=2 greedy output equals TP=1 for 256 tokens on a random llama-3.2-1b preset, and
the TP=2 decode rate is printed.
"""
import ctypes
import time
from collections import deque

import numpy as np
import pytest

from hipengine.backend import SamplingParams
from hipengine.errors import DeviceError, UnsupportedError
from hipengine.gpu.runtime import DeviceBuffer
from test_gpu_engine import BASE, EmulatedRuntime  # the per-kernel numpy oracles (reused, not copied)

# ==== the emulated node ========================================================================================


class _Op:
    """One queued unit of device work; run() returns False while it must wait (a collective)."""

    def __init__(self, fn):
        self.fn = fn

    def fresh(self):
        return _Op(self.fn)

    def run(self, dev) -> bool:
        self.fn(dev)
        return True


class _Collective:
    """One rank's part of an all-reduce: arrives once (registers its buffers), done once every rank has."""

    def __init__(self, node, match, ins, out, nbytes, dtype):
        self.node, self.match = node, match  # match(dev) -> (key, rank, world), evaluated at arrival
        self.ins, self.out, self.nbytes, self.dtype = ins, out, nbytes, dtype
        self.key = self.dev = None

    def fresh(self):
        return _Collective(self.node, self.match, self.ins, self.out, self.nbytes, self.dtype)

    def run(self, dev) -> bool:
        if self.key is None:
            self.dev = dev
            self.node.arrive(*self.match(dev), self)
        return self.key in self.node.done


class _Stream:
    def __init__(self, dev):
        self.dev, self.queue, self.capturing = dev, deque(), None

    def put(self, op):
        if self.capturing is not None:
            self.capturing.append(op)
        else:
            self.queue.append(op)

    def synchronize(self):
        self.dev.node.drain(self)


class _Graph:
    def __init__(self, ops):
        self.ops = ops

    def launch(self, stream):
        for op in self.ops:
            stream.put(op.fresh())  # per-replay state (a collective's arrival) starts fresh

    def destroy(self):
        pass


class EmulatedDevice(EmulatedRuntime):
    def __init__(self, node, index, nbytes=128 << 20):
        super().__init__(nbytes)
        self.node, self.device_index = node, index
        self.base = (index + 2) << 40  # disjoint address ranges: no rank can alias another's memory
        self.streams = []
        self.peers = set()

    # memory, in this device's own range
    def malloc(self, n):
        b = super().malloc(n)
        return DeviceBuffer(b.ptr - BASE + self.base, b.nbytes, self)

    malloc_fine_grained = malloc

    def view(self, ptr, dtype, count):
        off = int(ptr) - self.base
        n = count * np.dtype(dtype).itemsize
        assert 0 <= off and off + n <= self.mem.size, f"GPU {self.device_index}: wild pointer {int(ptr):#x}"
        return self.mem[off:off + n].view(dtype)

    # streams, copies ordered on them
    def stream(self):
        s = _Stream(self)
        self.streams.append(s)
        return s

    def synchronize(self):
        for s in self.streams:
            self.node.drain(s)

    def copy_htod(self, dst, src, stream=None):
        data = np.ascontiguousarray(src).copy()  # pageable source: staged at the call
        if stream is None:
            EmulatedRuntime.copy_htod(self, dst, data)  # legacy stream: not ordered with ours (as on the GPU)
        else:
            stream.put(_Op(lambda d, a=self._addr(dst): EmulatedRuntime.copy_htod(d, a, data)))

    def copy_dtoh(self, dst, src, stream=None):
        if stream is None:
            self.synchronize()  # the CUDA backend synchronises the context first
        else:
            self.node.drain(stream)  # to pageable memory: returns when the copy is done
        EmulatedRuntime.copy_dtoh(self, dst, src)

    def copy_dtod(self, dst, src, nbytes, stream=None):
        op = _Op(lambda d, a=self._addr(dst), b=self._addr(src): EmulatedRuntime.copy_dtod(d, a, b, nbytes))
        stream.put(op) if stream is not None else op.run(self)

    def memset(self, dst, byte, nbytes, stream=None):
        op = _Op(lambda d, a=self._addr(dst): d.view(a, np.uint8, nbytes).fill(byte & 0xFF))
        stream.put(op) if stream is not None else op.run(self)

    # capture / launch
    def begin_capture(self, stream):
        assert stream is not None and stream.capturing is None
        stream.capturing = []

    def end_capture(self, stream):
        g, stream.capturing = _Graph(stream.capturing), None
        return g

    def launch(self, fn, grid, block, args, shared=0, stream=None, cooperative=False, pdl=False):
        vals = [a.value if isinstance(a, ctypes._SimpleCData) else a for a in args]
        vals = [0 if v is None else (v.ptr if isinstance(v, DeviceBuffer) else v) for v in vals]
        grid = (grid, 1) if isinstance(grid, int) else tuple(grid)
        if fn.name.startswith("allreduce_"):
            op = self._allreduce_op(fn.name, grid, vals)
        else:
            op = _Op(lambda d, n=fn.name: d._execute(n, grid, vals))
        assert stream is not None, "executor launches must name a stream"
        stream.put(op)

    # (compile: the base emulator's, which reads the defines its kernels follow — the KV dtype, the fresh combine)

    def can_access_peer(self, other):
        return True

    def enable_peer_access(self, other):
        self.peers.add(other.device_index)

    # the custom all-reduce kernels: matched across ranks by (peer-table group, algorithm, epoch)
    def _allreduce_op(self, name, grid, v):
        from hipengine.comm.allreduce import ArPeerTable

        parts = name.split("_")  # allreduce_<algo>_<dtype>[_graph]
        algo, dtype, graph = parts[1], parts[2], name.endswith("_graph")
        assert not name.endswith("_repeat") and "residual" not in name, name
        src, dst, nbytes, table = v[0], v[1], v[2], v[3]

        def match(d):
            t = ArPeerTable.from_buffer_copy(d.view(table, np.uint8, ctypes.sizeof(ArPeerTable)).tobytes())
            assert t.world >= 1 and all(t.base[i] for i in range(t.world))
            if t.world > 1:  # peers' buffers are written through peer mappings
                assert set(range(t.world)) - {t.rank} <= d.peers, "peer access not enabled"
            if graph:  # device epochs: one counter per launched virtual block (a small message launches
                ctr = d.view(v[4], np.uint32, grid[0])  # fewer blocks, so the counters drift apart by design)
                ctr[:] += 1
                epoch = tuple(int(e) for e in ctr)
            else:
                epoch = int(v[4])
            return ("custom", tuple(t.base[i] for i in range(t.world)), algo, epoch), t.rank, t.world

        return _Collective(self.node, match, src, dst, nbytes, dtype)


class EmulatedNode:
    def __init__(self, n):
        self.devices = [EmulatedDevice(self, i) for i in range(n)]
        self.arrived = {}  # key -> {rank: collective}
        self.done = set()
        self.collectives = 0

    def runtime(self, index=0):
        if index >= len(self.devices):
            raise DeviceError(f"GPU {index} requested but only {len(self.devices)} found")
        return self.devices[index]

    def arrive(self, key, rank, world, c):
        c.key = key
        got = self.arrived.setdefault(key, {})
        assert rank not in got, f"rank {rank} joined collective {key} twice"
        got[rank] = c
        if len(got) == world:
            sizes = {x.nbytes for x in got.values()}
            assert len(sizes) == 1, f"ranks disagree on the all-reduce size: {sizes}"
            dt = {"f32": np.float32, "float32": np.float32}[c.dtype]
            n = c.nbytes // np.dtype(dt).itemsize
            devs = {r: x.dev for r, x in got.items()}
            acc = None
            for r in range(world):  # fixed rank order, fp32: every rank gets the same bits
                x = devs[r].view(got[r].ins, dt, n).copy()
                acc = x if acc is None else (acc + x).astype(dt)
            for r in range(world):
                devs[r].view(got[r].out, dt, n)[:] = acc
            self.done.add(key)
            self.collectives += 1

    def drain(self, target):
        """Run queued work until ``target``'s queue is empty; other streams run only while target waits."""
        while target.queue:
            if self._step(target):
                continue
            if not any(self._step(s) for d in self.devices for s in d.streams if s is not target):
                waiting = [(d.device_index, getattr(s.queue[0], "key", None))
                           for d in self.devices for s in d.streams if s.queue]
                raise DeviceError(f"emulated all-reduce deadlock: streams waiting {waiting}")

    def _step(self, s) -> bool:
        if not s.queue:
            return False
        if s.queue[0].run(s.dev):
            s.queue.popleft()
            return True
        return False


class EmulatedNccl:
    """NcclComm over the emulated node: each rank's k-th all-reduce matches every other rank's k-th."""

    def __init__(self, node, devices):
        self.node, self.devices, self.world = node, list(devices), len(devices)
        self.calls = [0] * self.world

    def allreduce(self, sends, recvs, count, dtype="float32", op="sum", streams=None):
        assert op == "sum" and streams is not None
        for r in range(self.world):
            def match(d, r=r):
                self.calls[r] += 1
                return ("nccl", id(self), self.calls[r]), r, self.world

            c = _Collective(self.node, match, _addr(sends[r]), _addr(recvs[r]), count * 4, dtype)
            streams[r].put(c)

    def close(self):
        pass


def _addr(x):
    return x.ptr if hasattr(x, "ptr") else int(x)


@pytest.fixture
def node(monkeypatch):
    import hipengine.comm.nccl as nccl_mod
    import hipengine.gpu.executor as E
    import hipengine.gpu.runtime as R

    holder = {}

    def make(n):
        nd = EmulatedNode(n)
        holder["node"] = nd
        monkeypatch.setattr(E, "get_runtime", nd.runtime)
        # this node runs a stream's work only when someone synchronises (so a missing synchronisation shows):
        # the per-op generation loop then checks the stream at once when a token is not there yet
        monkeypatch.setattr(E, "EMIT_CHECK_S", 0.0)
        monkeypatch.setattr(R, "get_runtime", nd.runtime)
        monkeypatch.setattr(R, "device_count", lambda: n)
        monkeypatch.setattr(nccl_mod, "NcclComm", lambda devices: EmulatedNccl(nd, devices))
        return nd

    return make


# ==== CPU tests through the emulated node ======================================================================
_MODELS: dict = {}


# llama3 gets an FFN of 320 so that tp=8 leaves 40 columns per rank (the executor needs multiples of 8)
_OVERRIDES = {"llama3": dict(intermediate_size=320)}


def _tiny(kind, tmp_path_factory):
    if kind not in _MODELS:
        from hipengine.loader import load_model
        from tiny_models import save_tiny_model

        path, _ = save_tiny_model(kind, tmp_path_factory.mktemp(f"tp_{kind}"), seed=7, max_position_embeddings=256,
                                  **_OVERRIDES.get(kind, {}))
        _MODELS[kind] = load_model(path, progress=False)
    return _MODELS[kind]


def _backend(node, model, tp, allreduce="custom"):
    from hipengine.gpu.executor import GpuBackend
    from hipengine.gpu.tp_executor import TpGpuBackend

    node(tp)
    if tp == 1:
        return GpuBackend(model, max_context=64, monokernel=False)
    return TpGpuBackend(model, max_context=64, tp=tp, allreduce=allreduce)


def _run_all(be, ids):
    """Teacher-forced logits over ids: prefill of the first 11 (8 + 3 rows), then decode one by one."""
    be.reset()
    out = [be.prefill(ids[:11], all_logits=True)] + [be.decode(int(t))[None] for t in ids[11:]]
    return np.concatenate(out)


def _rel(a, b):
    return float(np.max(np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)))


# llama: GQA (4 heads / 2 KV, head_dim 24): tp=2 splits KV heads, tp=4 replicates each KV head on 2 ranks.
# qwen2: q/k/v bias, tied embeddings (the head is a vocab slice of embed, the embedding stays full).
# llama3: 8 heads / 2 KV heads, llama3 RoPE scaling, untied head: tp=8 puts one query head on each rank.
@pytest.mark.parametrize("kind,tps", [("llama", (2, 4)), ("qwen2", (2, 4)), ("llama3", (4, 8))])
def test_tp_logits_and_greedy_equal_tp1(node, kind, tps, tmp_path_factory):
    model = _tiny(kind, tmp_path_factory)
    ids = np.random.default_rng(4).integers(3, model.config.vocab_size, 24)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ref = _backend(node, model, 1)
    want = _run_all(ref, ids)
    want_ids = list(ref.generate_ids(ids[:9], params, lambda: False))
    for tp in tps:
        be = _backend(node, model, tp)
        got = _run_all(be, ids)
        # The same bf16 weight bits on both sides (slices are not re-rounded); what differs is fp32 rounding
        # of the partial sums (~1.5e-7 relative measured) and, now and then, a bf16 K/V value rounded the
        # other way because of it (~1e-5 measured on tiny llama). Bound: 1e-4, far below bf16 weights' ~4e-3.
        assert got.shape == want.shape
        assert _rel(got, want) < 1e-4, f"tp={tp} logits rel err {_rel(got, want):.3g}"
        assert (np.argmax(got, -1) == np.argmax(want, -1)).all()
        assert list(be.generate_ids(ids[:9], params, lambda: False)) == want_ids, f"tp={tp} greedy ids"
        be.close()


@pytest.mark.parametrize("allreduce,tp", [("custom", 2), ("nccl", 2), ("custom", 4), ("nccl", 4)])
def test_tp_graph_replay_and_collective_count(node, allreduce, tp, tmp_path_factory, monkeypatch):
    """Decode through the captured per-rank graphs (custom: device epochs advance on every replay) and
    eagerly (HIPENGINE_NO_GRAPH=1): same logits; 2 all-reduces per layer per step."""
    model = _tiny("llama", tmp_path_factory)
    ids = np.random.default_rng(5).integers(3, model.config.vocab_size, 20)
    be = _backend(node, model, tp, allreduce)
    nd = be.ranks[0].rt.node
    graphed = _run_all(be, ids)
    assert be._graphs is not None
    before = nd.collectives
    be.decode(int(ids[0]))
    assert nd.collectives - before == 2 * model.config.num_layers
    # the all-reduce leaves every rank's residual stream bitwise identical (the next layer's inputs agree)
    d = model.config.hidden_size
    xs = [rk.rt.download(rk.x, (d,), np.float32).tobytes() for rk in be.ranks]
    assert all(x == xs[0] for x in xs)
    # tp=4 with 2 KV heads: ranks 2k and 2k+1 hold the same replicated KV head, written identically
    if be.plan.kv_replicated:
        n = be.ranks[0].kv_layer_bytes * model.config.num_layers
        kc = [rk.rt.download(rk.k_cache, (n,), np.uint8).tobytes() for rk in be.ranks]
        assert kc[0] == kc[1] and kc[2] == kc[3] and kc[0] != kc[2]
    be.close()
    monkeypatch.setenv("HIPENGINE_NO_GRAPH", "1")
    be = _backend(node, model, tp, allreduce)
    eager = _run_all(be, ids)
    assert be._graphs is None
    np.testing.assert_array_equal(graphed, eager)
    be.close()


def test_tp_sampling_matches_tp1_device_sampler(node, tmp_path_factory):
    """temperature > 0 (host sampler over gathered logits) picks what the tp=1 device sampler picks, seeded;
    a repetition penalty at temperature 0 takes the same host path."""
    model = _tiny("qwen2", tmp_path_factory)
    prompt = np.random.default_rng(6).integers(3, model.config.vocab_size, 9)
    cases = [SamplingParams(max_tokens=10, temperature=0.9, top_k=20, top_p=0.95, seed=3, ignore_eos=True),
             SamplingParams(max_tokens=10, temperature=0.7, min_p=0.05, repetition_penalty=1.3, seed=11,
                            ignore_eos=True),
             SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.5, ignore_eos=True)]
    ref = _backend(node, model, 1)
    want = [list(ref.generate_ids(prompt, p, lambda: False)) for p in cases]
    be = _backend(node, model, 2)
    got = [list(be.generate_ids(prompt, p, lambda: False)) for p in cases]
    assert got == want
    be.close()


def test_tp_stops_on_eos_and_cancel(node, tmp_path_factory):
    model = _tiny("llama", tmp_path_factory)
    prompt = np.random.default_rng(8).integers(3, model.config.vocab_size, 5)
    be = _backend(node, model, 2)
    free = list(be.generate_ids(prompt, SamplingParams(max_tokens=12, ignore_eos=True), lambda: False))
    eos = free[4]
    be.config = model.config.replace(eos_token_ids=(eos,))
    first = free.index(eos)
    assert list(be.generate_ids(prompt, SamplingParams(max_tokens=12), lambda: False)) == free[:first + 1]
    calls = []
    got = list(be.generate_ids(prompt, SamplingParams(max_tokens=12, ignore_eos=True),
                               lambda: calls.append(1) or len(calls) > 3))
    assert got == free[:len(got)] and len(got) < 12
    be.close()


def test_tp_context_limits_and_close(node, tmp_path_factory):
    from hipengine.errors import RequestError

    model = _tiny("llama", tmp_path_factory)
    be = _backend(node, model, 2)
    with pytest.raises(RequestError, match="exceeds the context"):
        be.prefill(np.arange(3, 70))
    with pytest.raises(RequestError, match="longer than the context"):
        list(be.generate_ids(np.arange(3, 70), SamplingParams(), lambda: False))
    be.reset()
    be.prefill(np.arange(3, 66))
    be.decode(5)
    with pytest.raises(RequestError, match="context of 64 tokens is full"):
        be.decode(5)
    be.close()
    be.close()  # idempotent


def test_unsplittable_shape_refused_before_gpu_work(monkeypatch, tmp_path_factory):
    import hipengine.gpu.executor as E
    import hipengine.gpu.runtime as R
    from hipengine.gpu.tp_executor import TpGpuBackend

    def no_gpu(index=0):
        raise AssertionError("touched a GPU before refusing the shape")

    monkeypatch.setattr(E, "get_runtime", no_gpu)
    monkeypatch.setattr(R, "get_runtime", no_gpu)
    smol = _tiny("smollm", tmp_path_factory)  # 6 heads / 2 KV heads: tp=4 does not divide
    with pytest.raises(UnsupportedError, match=r"tp=4 cannot split 6 attention heads") as e:
        TpGpuBackend(smol, tp=4)
    assert "\n" not in str(e.value)
    # the default model's shape (9 heads / 3 KV heads) at tp=2
    cfg = smol.config.replace(num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576, name="SmolLM2-135M")
    with pytest.raises(UnsupportedError, match=r"SmolLM2-135M: tp=2 cannot split 9 attention heads"):
        TpGpuBackend(type("M", (), {"config": cfg, "weights": {}})(), tp=2)


def test_engine_refuses_default_model_shape_at_tp2(monkeypatch):
    """Engine.load(shape="smollm2-135m", device="gpu", tp=2): ShardPlan's one-line refusal, no GPU touched."""
    import hipengine.gpu.executor as E
    import hipengine.gpu.runtime as R
    from hipengine.engine import Engine

    def no_gpu(index=0):
        raise AssertionError("touched a GPU before refusing the shape")

    monkeypatch.setattr(E, "get_runtime", no_gpu)
    monkeypatch.setattr(R, "get_runtime", no_gpu)
    with pytest.raises(UnsupportedError, match=r"tp=2 cannot split 9 attention heads.*tp in \[3\]"):
        Engine.load(shape="smollm2-135m", device="gpu", tp=2, progress=False)


def test_tp_collective_mismatch_is_an_error_not_a_hang(node):
    """The emulator is strict: an all-reduce only one rank joins cannot complete (the device kernel would
    time out and report through CustomAllReduce.check)."""
    from hipengine.comm.allreduce import CustomAllReduce

    nd = node(2)
    c = CustomAllReduce([0, 1], max_bytes=4096, device_epochs=True)
    x = [rt.malloc(64) for rt in c.rts]
    c.allreduce(x, x, 64, "float32")
    c.streams[0].synchronize()  # both ranks joined
    fn = c.rts[0].compile("comm/allreduce.hip").function("allreduce_ll_f32_graph")
    c.rts[0].launch(fn, 1, 256, [ctypes.c_void_p(x[0].ptr), ctypes.c_void_p(x[0].ptr), ctypes.c_uint64(64),
                                 ctypes.c_void_p(c.tables[0].ptr),
                                 ctypes.c_void_p(c.ctrs[0].ptr + 2 * c.layout.nblocks * 4)],  # the LL row
                    stream=c.streams[0])
    with pytest.raises(DeviceError, match="deadlock"):
        c.streams[0].synchronize()
    assert nd.collectives == 1


def test_emulated_custom_allreduce_mixed_sizes(node):
    """The emulator's matching of device epochs per virtual block: small and large messages interleaved
    (different grids), integer inputs so the sums are exact, identical on every rank."""
    from hipengine.comm.allreduce import CustomAllReduce

    node(2)
    c = CustomAllReduce([0, 1], max_bytes=64 << 10, device_epochs=True)
    ins = [rt.malloc(64 << 10) for rt in c.rts]
    rng = np.random.default_rng(0)
    for nbytes in (4096, 65536, 4096, 16, 65536):
        xs = [rng.integers(-1000, 1000, nbytes // 4).astype(np.float32) for _ in range(2)]
        for rt, b, x in zip(c.rts, ins, xs):
            rt.copy_htod(b, x)
        c.allreduce(ins, ins, nbytes, "float32")  # in place, as TP rank 0 does
        c.check()
        for rt, b in zip(c.rts, ins):
            np.testing.assert_array_equal(rt.download(b, (nbytes // 4,), np.float32), xs[0] + xs[1])


def test_engine_load_gpu_tp2_builds_tp_backend(node, tmp_path_factory):
    from hipengine.engine import Engine
    from hipengine.gpu.tp_executor import TpGpuBackend

    model = _tiny("llama", tmp_path_factory)
    node(2)
    eng = Engine.load(model.path, device="gpu", tp=2, max_context=64, progress=False)
    try:
        assert isinstance(eng.backend, TpGpuBackend) and eng.backend.tp == 2
        ids = [5, 17, 99, 42, 7]
        cpu = Engine.load(model.path, device="cpu", max_context=64, progress=False)
        assert eng.generate(ids, max_tokens=8, ignore_eos=True) == cpu.generate(ids, max_tokens=8, ignore_eos=True)
    finally:
        eng.backend.close()


def test_bench_decode_tp_on_the_emulator(node, monkeypatch, tmp_path, capsys):
    """`hipengine bench decode --shape tiny-llama --tp 2 --no-monokernel --json`: real-prompt context, then a
    synthetic-KV context after resize_context; greedy tokens stable across runs; JSON + table written."""
    import argparse
    import json

    import hipengine.bench.decode as D
    import hipengine.bench.probe as P

    node(2)
    monkeypatch.setattr(P, "measure_hbm_read_bandwidth", lambda rt: 4.0e12)
    monkeypatch.setattr(D, "RUNS", 2)
    monkeypatch.setattr(D, "GEN", 6)
    out = tmp_path / "tp.json"
    args = argparse.Namespace(shape="tiny-llama", model=None, context=[48, 16], tp=2, no_monokernel=True,
                              allreduce="custom", json=str(out), plot=None)
    assert D.run(args) == 0
    res = json.loads(out.read_text())
    assert [r["context"] for r in res["results"]] == [16, 48] and res["tp"] == 2
    assert res["results"][0]["prompt"] == "real" and res["results"][1]["prompt"] == "synthetic-kv"
    assert all(r["tok_s"] > 0 and r["roofline_tok_s"] > 0 for r in res["results"])
    assert "per-op-tp2-custom" in capsys.readouterr().out
    args.no_monokernel = False
    assert D.run(args) == 1  # the emulator has no cooperative launch, so no TP monokernel: one clear line
    assert "--no-monokernel" in capsys.readouterr().err


def _tp_equals_tp1(model, n_tokens, max_context, tp=2, allreduces=("custom", "nccl")):
    """Greedy n_tokens at TP=tp equal TP=1 (per-op); rates printed. Shared by the multigpu test and its CPU
    dry run on the emulator (so the device test's own code has run before it meets a GPU)."""
    from hipengine.gpu.executor import GpuBackend
    from hipengine.gpu.tp_executor import TpGpuBackend

    prompt = np.random.default_rng(1).integers(0, model.config.vocab_size, 16)
    params = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
    one = GpuBackend(model, max_context=max_context, monokernel=False)  # the per-op path TP is built from
    try:
        list(one.generate_ids(prompt, SamplingParams(max_tokens=8, ignore_eos=True), lambda: False))  # warm
        stamps, want = [], []
        for t in one.generate_ids(prompt, params, lambda: False):
            stamps.append(time.perf_counter())
            want.append(t)
        print(f"\nTP=1 (per-op) decode {(len(stamps) - 1) / (stamps[-1] - stamps[0]):.1f} tok/s")
        # TP=1 logits along its own greedy path (teacher forced): the top-1/top-2 gap at any divergence
        one.reset()
        ref = [one.prefill(prompt)] + [one.decode(t) for t in want[:-1]]
    finally:
        one.close()
    for allreduce in allreduces:
        be = TpGpuBackend(model, max_context=max_context, tp=tp, allreduce=allreduce)
        try:
            list(be.generate_ids(prompt, SamplingParams(max_tokens=8, ignore_eos=True), lambda: False))  # warm
            t0 = time.perf_counter()
            stamps, got = [], []
            for t in be.generate_ids(prompt, params, lambda: False):
                stamps.append(time.perf_counter())
                got.append(t)
            rate = (len(stamps) - 1) / (stamps[-1] - stamps[0])
            print(f"TP={tp} ({allreduce}) decode {rate:.1f} tok/s, TTFT {(stamps[0] - t0) * 1e3:.1f} ms")
            sp = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
            a = list(be.generate_ids(prompt, sp, lambda: False))
            assert a == list(be.generate_ids(prompt, sp, lambda: False)) and len(a) == 32  # seeded replay
        finally:
            be.close()
        assert len(got) == len(want) == n_tokens
        if got != want:
            # bf16 tie: K/V are stored in bf16, so an fp32 summation-order difference can round one K/V value
            # the other way; that moves logits by ~1e-5 relative and flips top-1 only where two logits tie
            # that closely. Accepted only then, and reported with the gap.
            i = next(k for k in range(n_tokens) if got[k] != want[k])
            top = np.sort(ref[i])[-2:]
            gap = float(top[1] - top[0])
            print(f"TP={tp} ({allreduce}) diverges at token {i}: TP=1 top-1/top-2 gap {gap:.3g} "
                  f"(max |logit| {float(np.abs(ref[i]).max()):.3g})")
            assert gap < 1e-3 * float(np.abs(ref[i]).max()), f"divergence at token {i} with a clear gap {gap:.3g}"


def test_tp_equals_tp1_dry_run_on_tiny_preset(node):
    from hipengine.presets import preset_model

    node(2)
    _tp_equals_tp1(preset_model("tiny-llama", 0), 24, 64)


# ==== on 2+ GPUs ==============================================================================================
@pytest.mark.multigpu
def test_tp2_greedy_equals_tp1_llama_1b_preset():
    """256 greedy tokens of a random llama-3.2-1b preset: TP=2 (captured graphs; custom all-reduce, then
    NCCL) equals TP=1. bf16 weights are sliced, not re-rounded, so both see the same bits; the difference is
    fp32 summation order at the two reductions per layer (~1e-7 relative) and what it does to bf16 K/V."""
    from hipengine.presets import preset_model

    _tp_equals_tp1(preset_model("llama-3.2-1b", 0), 256, 512)
