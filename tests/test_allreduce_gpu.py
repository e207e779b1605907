"""Custom all-reduce (and the NCCL/RCCL binding) on 2+ GPUs of one process.

Integer-valued inputs make every sum exact, so results are compared for equality, and bitwise across ranks.
"""
import numpy as np
import pytest

pytestmark = pytest.mark.multigpu

SIZES = [16, 4096, 16 * 1024 + 48, 256 * 1024, (1 << 20) + 4096 + 16, 4 << 20]  # partial tiles included


@pytest.fixture(scope="module")
def comm():
    from hipengine.comm.allreduce import CustomAllReduce
    from hipengine.gpu.runtime import device_count

    c = CustomAllReduce(list(range(min(device_count(), 8))), max_bytes=4 << 20)
    yield c
    c.close()


@pytest.fixture(scope="module")
def bufs(comm):
    ins = [rt.malloc(4 << 20) for rt in comm.rts]
    outs = [rt.malloc(4 << 20) for rt in comm.rts]
    yield ins, outs
    for b in ins + outs:
        b.free()


def _sync(comm):
    for s in comm.streams:
        s.synchronize()


def _put(comm, bufs, xs, dtype):
    ins, outs = bufs
    _sync(comm)
    for r, rt in enumerate(comm.rts):
        rt.copy_htod(ins[r], xs[r])
        rt.memset(outs[r], 0xFF, xs[r].nbytes)  # NaN poison


def _get(comm, bufs, n, dtype):
    comm.check()  # syncs, raises on a timeout
    return [rt.download(bufs[1][r], (n,), dtype) for r, rt in enumerate(comm.rts)]


def _ints(world, n, rng, dtype=np.float32, bound=64):
    if dtype == "bfloat16":
        bound = 16  # sums of up to 8 ranks stay within bf16's exact integers (|s| <= 256)
    xs = [rng.integers(-bound, bound + 1, n).astype(np.float32) for _ in range(world)]
    if dtype == "bfloat16":  # store as the top half of float32 (exact: small integers)
        return xs, [(x.view(np.uint32) >> 16).astype(np.uint16) for x in xs]
    return xs, xs


def _as_f32(y, dtype):
    return (y.astype(np.uint32) << 16).view(np.float32) if dtype == "bfloat16" else y


@pytest.mark.parametrize("algo", ["ll", "oneshot", "twoshot"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("nbytes", SIZES)
def test_exact_sum_identical_on_every_rank(comm, bufs, algo, dtype, nbytes):
    rng = np.random.default_rng(nbytes)
    esize = 4 if dtype == "float32" else 2
    n = nbytes // esize
    xs, raw = _ints(comm.world, n, rng, dtype)
    _put(comm, bufs, raw, dtype)
    comm.allreduce(bufs[0], bufs[1], nbytes, dtype, algo)
    got = _get(comm, bufs, n, np.float32 if esize == 4 else np.uint16)
    want = np.sum(xs, axis=0, dtype=np.float64)
    for r, g in enumerate(got):
        np.testing.assert_array_equal(_as_f32(g, dtype), want, err_msg=f"rank {r}")
        assert g.tobytes() == got[0].tobytes()


@pytest.mark.parametrize("algo", ["ll", "oneshot", "twoshot"])
def test_repeated_in_one_kernel(comm, bufs, algo):
    rng = np.random.default_rng(1)
    n = 8192
    xs, _ = _ints(comm.world, n, rng)
    _put(comm, bufs, xs, "float32")
    comm.allreduce(bufs[0], bufs[1], n * 4, "float32", algo, repeats=500)
    want = np.sum(xs, axis=0, dtype=np.float64)
    for g in _get(comm, bufs, n, np.float32):
        np.testing.assert_array_equal(g, want)


@pytest.mark.parametrize("algo", ["ll", "oneshot", "twoshot"])
def test_inputs_mutated_right_after_launch(comm, bufs, algo):
    """Overwrite every rank's input on its stream right after the launch and run the next all-reduce on
    the new data: the first result must not see the mutation, the second must see all of it."""
    ins, outs = bufs
    rng = np.random.default_rng(2)
    n = 64 * 1024 // 4 + 4
    xs, _ = _ints(comm.world, n, rng)
    ys, _ = _ints(comm.world, n, rng)
    _put(comm, bufs, xs, "float32")
    out2 = [rt.malloc(n * 4) for rt in comm.rts]
    keep = [np.ascontiguousarray(y) for y in ys]
    comm.allreduce(ins, outs, n * 4, "float32", algo)
    for r, rt in enumerate(comm.rts):
        rt.copy_htod(ins[r], keep[r], stream=comm.streams[r])  # async, same stream, right after the launch
    comm.allreduce(ins, out2, n * 4, "float32", algo)
    comm.check()
    for r, rt in enumerate(comm.rts):
        np.testing.assert_array_equal(rt.download(outs[r], (n,), np.float32), np.sum(xs, axis=0))
        np.testing.assert_array_equal(rt.download(out2[r], (n,), np.float32), np.sum(ys, axis=0))
        out2[r].free()


def test_10000_back_to_back_with_random_delays(comm):
    """10,000 all-reduces alternating algorithms, sizes and four (input, output) sets, with random device-side
    delays skewing the ranks' arrival; then every output holds its exact sum and no kernel timed out."""
    rng = np.random.default_rng(3)
    sets = []
    for k, nbytes in enumerate([4096, 16 * 1024, 128 * 1024 + 16, 512 * 1024]):
        n = nbytes // 4
        xs, _ = _ints(comm.world, n, rng)
        ins = [rt.upload(x) for rt, x in zip(comm.rts, xs)]
        outs = [rt.malloc(nbytes) for rt in comm.rts]
        sets.append((nbytes, xs, ins, outs))
    _sync(comm)
    delays = rng.random((10_000, comm.world)) < 0.2
    amounts = rng.integers(1_000, 30_000, (10_000, comm.world))  # 1-30 µs
    for i in range(10_000):
        nbytes, xs, ins, outs = sets[i % 4]
        for r in range(comm.world):
            if delays[i, r]:
                comm.delay(r, int(amounts[i, r]))
        comm.allreduce(ins, outs, nbytes, "float32", ("ll", "oneshot", "twoshot")[(i // 4) % 3])
        if i % 1000 == 999:
            comm.check()
    comm.check()
    for nbytes, xs, ins, outs in sets:
        want = np.sum(xs, axis=0, dtype=np.float64)
        for r, rt in enumerate(comm.rts):
            np.testing.assert_array_equal(rt.download(outs[r], (nbytes // 4,), np.float32), want)
        for b in ins + outs:
            b.free()


def test_timeout_reports_instead_of_hanging():
    """Only rank 0 launches: its kernel must give up after the timeout and name rank 1."""
    from hipengine.comm.allreduce import CustomAllReduce
    from hipengine.errors import DeviceError

    c = CustomAllReduce([0, 1], max_bytes=1 << 16, timeout_s=0.2)
    try:
        x = c.rts[0].upload(np.ones(1024, np.float32))
        y = c.rts[0].malloc(4096)
        c.rts[0].launch(c.function(0, "oneshot", "float32"), 1, c.threads,
                        _args(x.ptr, y.ptr, 4096, c.tables[0].ptr, 1), stream=c.streams[0])
        with pytest.raises(DeviceError, match="timed out waiting for rank 1"):
            c.check()
        with pytest.raises(DeviceError, match="unusable"):
            c.allreduce([x, x], [y, y], 4096)
        x.free()
        y.free()
    finally:
        c.close()


@pytest.mark.parametrize("algo", ["ll", "oneshot", "twoshot"])
def test_graph_replay_with_device_epochs(comm, algo):
    """Three calls captured in one graph per rank, replayed with fresh inputs each time: the device-side
    epoch counters must advance on every replay (a stale epoch would let a rank read before its peer wrote)."""
    from hipengine.comm.allreduce import CustomAllReduce, capture_graphs

    c = CustomAllReduce(list(range(comm.world)), max_bytes=1 << 20, device_epochs=True)
    rng = np.random.default_rng(6)
    n = (256 * 1024 + 64) // 4
    ins = [rt.malloc(n * 4) for rt in c.rts]
    outs = [rt.malloc(n * 4) for rt in c.rts]
    try:
        graphs = capture_graphs(c.rts, c.streams,
                                lambda: [c.allreduce(ins, outs, n * 4, "float32", algo) for _ in range(3)])
        for _ in range(20):
            xs, _ = _ints(c.world, n, rng)
            _sync(c)
            for r, rt in enumerate(c.rts):
                rt.copy_htod(ins[r], xs[r])
            for g, s in zip(graphs, c.streams):
                g.launch(s)
            c.check()
            for r, rt in enumerate(c.rts):
                np.testing.assert_array_equal(rt.download(outs[r], (n,), np.float32), np.sum(xs, axis=0))
        for g in graphs:
            g.destroy()
    finally:
        for b in ins + outs:
            b.free()
        c.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_residual_rmsnorm(dtype):
    """residual += sum of partials (exact: integers), normed = RMSNorm(residual) * gamma, same bits on every
    rank; a communicator with nblocks != 1 refuses the fused call."""
    from hipengine.comm.allreduce import CustomAllReduce
    from hipengine.errors import DeviceError

    c = CustomAllReduce([0, 1], max_bytes=64 * 1024, nblocks=1)
    try:
        rng = np.random.default_rng(5)
        n, eps = 2048 + 8, 1e-5  # not a multiple of the 1024-element tile
        xs, raw = _ints(2, n, rng, dtype)
        res0 = rng.integers(-100, 101, n).astype(np.float32)
        gamma = rng.standard_normal(n).astype(np.float32)
        bufs = [(rt.upload(raw[r]), rt.upload(res0), rt.upload(gamma), rt.malloc(n * 4)) for r, rt in enumerate(c.rts)]
        c.allreduce_residual_rmsnorm([b[0] for b in bufs], [b[1] for b in bufs], [b[2] for b in bufs],
                                     [b[3] for b in bufs], n, eps, dtype)
        c.check()
        want_res = res0.astype(np.float64) + np.sum(xs, axis=0, dtype=np.float64)
        want = want_res / np.sqrt(np.mean(want_res ** 2) + eps) * gamma
        outs = []
        for r, rt in enumerate(c.rts):
            np.testing.assert_array_equal(rt.download(bufs[r][1], (n,), np.float32), want_res)
            outs.append(rt.download(bufs[r][3], (n,), np.float32))
            np.testing.assert_allclose(outs[-1], want, rtol=2e-5, atol=1e-6)
        assert outs[0].tobytes() == outs[1].tobytes()
        for b in bufs:
            for x in b:
                x.free()
    finally:
        c.close()
    c = CustomAllReduce([0, 1], max_bytes=64 * 1024, nblocks=4)
    try:
        with pytest.raises(DeviceError, match="nblocks=1"):
            c.allreduce_residual_rmsnorm([0, 0], [0, 0], [0, 0], [0, 0], 1024, 1e-5)
    finally:
        c.close()


def _args(i, o, nbytes, table, epoch):
    import ctypes

    return [ctypes.c_void_p(i), ctypes.c_void_p(o), ctypes.c_uint64(nbytes), ctypes.c_void_p(table),
            ctypes.c_uint32(epoch)]


def test_nccl_allreduce_exact(comm, bufs):
    from hipengine.comm.nccl import NcclComm

    nc = NcclComm(list(range(comm.world)))
    try:
        rng = np.random.default_rng(4)
        n = 4096
        xs, _ = _ints(comm.world, n, rng)
        _put(comm, bufs, xs, "float32")
        nc.allreduce(bufs[0], bufs[1], n, "float32", streams=comm.streams)
        for g in _get(comm, bufs, n, np.float32):
            np.testing.assert_array_equal(g, np.sum(xs, axis=0))
        assert nc.lib.version().count(".") == 2
    finally:
        _sync(comm)
        nc.close()
