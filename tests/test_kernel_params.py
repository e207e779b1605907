"""Kernel arguments as the backends hand them to cuLaunchKernel / hipModuleLaunchKernel (no GPU): one pointer
per argument, each pointing at that argument's bytes — scalars, device pointers, and structs passed by value
(the monokernel takes its parameter block by value: docs/perf-log.md v62)."""
import ctypes

import pytest

pytest.importorskip("cuda.bindings")
from hipengine.errors import DeviceError  # noqa: E402
from hipengine.gpu import monokernel as mk  # noqa: E402
from hipengine.gpu.backend_cuda import kernel_params  # noqa: E402


def _arg_bytes(addr: int, i: int, size: int) -> bytes:
    ptr = ctypes.cast(addr, ctypes.POINTER(ctypes.c_void_p))[i]
    return ctypes.string_at(ptr, size)


def test_scalars_structs_and_arrays_point_at_their_bytes():
    block = mk.MkParams(vocab=128256, d=2048, eps=1e-5, seed_lo=7)
    table = (mk.MkLayer * 2)(mk.MkLayer(wqkv=0x1000), mk.MkLayer(wqkv=0x2000))
    n = ctypes.c_int32(-3)
    addr, keep = kernel_params([block, ctypes.c_void_p(0xABC0), table, n])
    assert addr and keep
    assert _arg_bytes(addr, 0, ctypes.sizeof(block)) == bytes(block)  # the struct's own bytes, by value
    assert _arg_bytes(addr, 1, 8) == (0xABC0).to_bytes(8, "little")
    assert _arg_bytes(addr, 2, ctypes.sizeof(table)) == bytes(table)
    assert _arg_bytes(addr, 3, 4) == (-3).to_bytes(4, "little", signed=True)


def test_no_arguments_and_a_wrong_one():
    assert kernel_params([]) == (0, ())
    with pytest.raises(DeviceError, match="kernel argument 1 is int"):
        kernel_params([ctypes.c_int32(1), 5])


def test_monokernel_launch_passes_the_block_by_value():
    """decode.hip declares `monokernel_decode(const MkParams p)`; the host launches with the ctypes block
    itself (392 bytes, the C layout), not a device pointer to a copy."""
    from hipengine.gpu.runtime import KERNELS_DIR

    assert "monokernel_decode(const MkParams p)" in (KERNELS_DIR / mk.SOURCE).read_text()
    calls = []
    be = object.__new__(mk.MonokernelBackend)
    be.rt = type("R", (), {"launch": lambda self, *a, **k: calls.append((a, k))})()
    be.fn, be.grid, be.smem, be.stream = "fn", 132, 44160, "stream"
    be._block = mk.MkParams(d=2048, n_layers=16)
    be._start()
    (args, kw), = calls
    assert args[3] == [be._block] and ctypes.sizeof(args[3][0]) == 392
    assert kw["cooperative"] is True and kw["shared"] == 44160
