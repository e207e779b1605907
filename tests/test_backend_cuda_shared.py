"""The CUDA backend's dynamic shared-memory opt-in, without a GPU (the driver calls are stubbed).

A launch gets 48 KiB of shared memory without the MAX_DYNAMIC_SHARED_SIZE_BYTES attribute, and that bound
covers the kernel's static shared memory plus the dynamic part (session 23: a monokernel build with 46,208 B
dynamic + its static arrays failed to launch while the opt-in looked at the dynamic part alone).
"""
import pytest

pytest.importorskip("cuda.bindings")
from hipengine.gpu.backend_cuda import Function  # noqa: E402


class _Fn(Function):
    def __init__(self, static: int):  # no runtime, no handle: only the opt-in logic runs
        self.name, self._dyn_shared, self._static = "k", 0, None
        self.static_bytes, self.static_reads, self.opted = static, 0, []

    @property
    def static_shared(self) -> int:
        self.static_reads += 1
        return self.static_bytes

    def set_max_dynamic_shared(self, nbytes: int) -> None:
        self.opted.append(nbytes)
        self._dyn_shared = nbytes


def test_static_plus_dynamic_decides():
    fn = _Fn(static=4096)
    fn.fit_shared(44160)            # 48,256 B in all: inside the default 48 KiB (49,152 B)
    assert fn.opted == []
    fn.fit_shared(46208)            # 50,304 B: over it, although the dynamic part alone is not
    assert fn.opted == [46208]
    assert fn.static_reads == 1     # the attribute is read once


def test_large_dynamic_and_no_repeat():
    fn = _Fn(static=0)
    fn.fit_shared(49152)            # exactly 48 KiB: no opt-in needed
    assert fn.opted == []
    fn.fit_shared(100 * 1024)
    fn.fit_shared(64 * 1024)        # already covered by the larger opt-in
    fn.fit_shared(0)
    assert fn.opted == [100 * 1024]
