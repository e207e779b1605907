"""The GPU runtime facade on a real device (either vendor): memory, compile+launch, events, graphs,
host-mapped memory, occupancy. Skipped without a GPU (conftest)."""
import ctypes

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

KERNELS = r"""
#include "port.h"
HE_KERNEL(256) add_scalar(float* x, float v, int n) {
  int i = he_block_idx() * he_block_dim() + he_thread_idx();
  if (i < n) x[i] += v;
}
// Writes through a host-mapped pointer; the host reads it after synchronising.
HE_KERNEL(256) write_host(he_u32* flag, he_u32 value) {
  if (he_block_idx() == 0 && he_thread_idx() == 0) he_store_release_system(flag, value);
}
HE_KERNEL(1024) block_sum(const float* x, float* out, int n) {
  __shared__ float scratch[kMaxWarpsPerBlock];
  float s = 0.f;
  for (int i = he_thread_idx(); i < n; i += he_block_dim()) s += x[i];
  s = he_block_sum(s, scratch);
  if (he_thread_idx() == 0) out[0] = s;
}
"""


@pytest.fixture(scope="module")
def rt():
    from hipengine.gpu.runtime import get_runtime

    return get_runtime(0)


@pytest.fixture(scope="module")
def mod(rt):
    return rt.compile(KERNELS)


def test_device_properties(rt):
    assert rt.vendor in ("nvidia", "amd")
    assert rt.warp_size in (32, 64)
    assert rt.num_sms > 0 and rt.l2_bytes > 0 and rt.max_shared_per_block >= 48 * 1024
    assert rt.total_mem > 2**30 and rt.name
    free, total = rt.mem_info()
    assert 0 < free <= total


def test_malloc_copy_roundtrip(rt):
    a = np.arange(1000, dtype=np.float32)
    buf = rt.upload(a)
    b = rt.malloc(a.nbytes)
    rt.copy_dtod(b, buf, a.nbytes)
    np.testing.assert_array_equal(rt.download(b, a.shape, a.dtype), a)
    rt.memset(b, 0, a.nbytes)
    assert not rt.download(b, a.shape, a.dtype).any()
    buf.free()
    b.free()
    assert buf.ptr == 0


def test_compile_launch_and_stream(rt, mod):
    n = 1000
    x = rt.upload(np.ones(n, np.float32))
    fn = mod.function("add_scalar")
    rt.launch(fn, (n + 255) // 256, 256, [x, ctypes.c_float(2.5), ctypes.c_int32(n)])
    rt.synchronize()
    np.testing.assert_array_equal(rt.download(x, (n,), np.float32), 3.5)
    s = rt.stream()
    rt.launch(fn, (n + 255) // 256, 256, [x, ctypes.c_float(1.0), ctypes.c_int32(n)], stream=s)
    s.synchronize()
    np.testing.assert_array_equal(rt.download(x, (n,), np.float32), 4.5)
    # Same source again: served from the in-process module cache.
    assert rt.compile(KERNELS) is mod


def test_block_sum_uses_device_warp_width(rt, mod):
    x = rt.upload(np.arange(4096, dtype=np.float32) % 7)
    out = rt.malloc(4)
    rt.launch(mod.function("block_sum"), 1, 1024, [x, out, ctypes.c_int32(4096)])
    rt.synchronize()
    assert rt.download(out, (1,), np.float32)[0] == float((np.arange(4096) % 7).sum())


def test_events_time_work(rt, mod):
    n = 1 << 20
    x = rt.malloc(n * 4)
    rt.memset(x, 0, n * 4)
    s = rt.stream()
    start, end = rt.event(), rt.event()
    start.record(s)
    for _ in range(10):
        rt.launch(mod.function("add_scalar"), n // 256, 256, [x, ctypes.c_float(1.0), ctypes.c_int32(n)], stream=s)
    end.record(s)
    ms = start.elapsed_ms(end)
    assert 0 < ms < 1000
    assert rt.download(x, (n,), np.float32)[-1] == 10.0


def test_graph_capture_and_replay(rt, mod):
    n = 256
    x = rt.upload(np.zeros(n, np.float32))
    s = rt.stream()
    rt.begin_capture(s)
    for _ in range(3):
        rt.launch(mod.function("add_scalar"), 1, 256, [x, ctypes.c_float(1.0), ctypes.c_int32(n)], stream=s)
    graph = rt.end_capture(s)
    s.synchronize()
    assert not rt.download(x, (n,), np.float32).any()  # capture records, it does not run
    graph.launch(s)
    graph.launch(s)
    s.synchronize()
    np.testing.assert_array_equal(rt.download(x, (n,), np.float32), 6.0)


def test_host_mapped_memory_visible_to_kernel(rt, mod):
    hb = rt.host_alloc_mapped(64)
    flags = hb.array.view(np.uint32)
    flags[:] = 0
    rt.launch(mod.function("write_host"), 1, 64, [ctypes.c_void_p(hb.dptr), ctypes.c_uint32(0xC0FFEE)])
    rt.synchronize()
    assert flags[0] == 0xC0FFEE
    hb.free()


def test_occupancy_and_function_attributes(rt, mod):
    fn = mod.function("add_scalar")
    assert rt.max_active_blocks(fn, 256) > 0
    if hasattr(fn, "num_regs"):
        assert fn.num_regs > 0


def test_compile_error_is_device_error(rt):
    from hipengine.errors import DeviceError

    with pytest.raises(DeviceError, match="undefined_symbol"):
        rt.compile('extern "C" __global__ void k() { undefined_symbol(); }\n')


@pytest.mark.multigpu
def test_peer_copy():
    from hipengine.gpu.runtime import get_runtime

    r0, r1 = get_runtime(0), get_runtime(1)
    if not r0.can_access_peer(r1):
        pytest.skip("GPU 0 cannot access GPU 1")
    r0.enable_peer_access(r1)
    r1.enable_peer_access(r0)
    a = np.arange(4096, dtype=np.uint8)
    src = r0.upload(a)
    dst = r1.malloc(a.nbytes)
    r0.copy_dtod(dst, src, a.nbytes)
    np.testing.assert_array_equal(r1.download(dst, a.shape, a.dtype), a)


def test_probe_ceilings(rt):
    from hipengine.bench import probe

    read = probe.hbm_read(rt, nbytes=1 << 30, reps=3)  # checks its own checksum
    assert read["bytes_per_s"] > 100e9
    copy = probe.copy_bandwidth(rt, nbytes=256 << 20, grid=read["grid"], reps=3)
    assert copy["bytes_per_s"] > 50e9
    launch = probe.launch_overhead(rt, launches=50, reps=3)
    assert 0 < launch["graph_us"] < 100 and launch["eager_us"] > 0


def test_probe_poll_latency(rt):
    from hipengine.bench import probe
    from hipengine.gpu.ops import bulk_copy_supported

    r = probe.poll_latency(rt, rounds=20, reps=1)  # checks thread 0's checksum itself
    by_mode = {v["mode"]: v for k, v in r.items() if isinstance(v, dict) and v["kib_per_warp"] <= 8}
    expect = [m for m in probe.POLL_MODES if m not in probe.POLL_BULK or bulk_copy_supported(rt.arch)]
    assert sorted(by_mode) == expect
    assert all(0 < v["us"] < 20 for v in by_mode.values())
    # an acquire poll behind its own warp's 8 KiB from HBM: not before they came back
    assert by_mode[2]["us"] > by_mode[0]["us"] and by_mode[2]["batch_us"] > 0


@pytest.mark.multigpu
def test_probe_peer_pair():
    from hipengine.bench import probe
    from hipengine.gpu.runtime import get_runtime

    p = probe.peer_pair(get_runtime(0), get_runtime(1), nbytes=64 << 20, rounds=200, reps=2)
    if "error" in p:
        pytest.skip(p["error"])
    assert p["copy_kernel_bytes_per_s"] > 1e9 and 0 < p["one_way_latency_us"] < 100
