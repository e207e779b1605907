"""The GPU runtime facade: one API over two vendor backends.

* ``backend_hip``  — AMD through hip-python (hiprtc -> hipModuleLoadData -> hipModuleLaunchKernel).
* ``backend_cuda`` — NVIDIA through cuda-bindings (NVRTC -> cuModuleLoadData -> cuLaunchKernel).

The backend follows what the machine has; ``HIPENGINE_BACKEND=hip|cuda`` overrides. Everything above this
module (ops, executor, comm, benchmarks) talks only to ``Runtime``; no vendor call appears elsewhere.
Every vendor call goes through the backend's ``check()``, which raises ``DeviceError`` with the call's name
and the vendor's error string.

Conventions
-----------
* One ``Runtime`` per device (``get_runtime(i)``, cached). Every method makes its device/context current
  first, so one Python thread can drive several GPUs.
* Kernel arguments are a list of ``ctypes`` scalars (``c_void_p``, ``c_int32``, ``c_uint32``, ``c_float``,
  ``c_uint64``...) or ``DeviceBuffer`` objects (passed as their device pointer).
* Sizes (SM/CU count, shared memory/LDS, L2, warp width) are read from the device, never assumed.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import DeviceError

KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels_hip"


@dataclass
class DeviceBuffer:
    ptr: int
    nbytes: int
    runtime: "Runtime"
    fine_grained: bool = False

    def free(self) -> None:
        if self.ptr:
            self.runtime._free(self)
            self.ptr = 0


@dataclass
class HostBuffer:
    """Pinned host memory mapped into the device's address space (token ring, cancel flag)."""

    array: np.ndarray  # uint8 view of the whole allocation; use .view(dtype)
    dptr: int  # device-side address of the same memory
    runtime: "Runtime"
    hptr: int = 0

    def free(self) -> None:
        if self.hptr:
            self.runtime._free_host(self)
            self.hptr = 0


class Runtime(ABC):
    vendor: str  # "nvidia" | "amd"
    device_index: int
    name: str
    arch: str  # "sm_90", "gfx942", ...
    warp_size: int
    num_sms: int  # SMs (NVIDIA) or CUs (AMD)
    max_shared_per_block: int  # largest opt-in dynamic shared memory / LDS per block, bytes
    l2_bytes: int
    total_mem: int

    # ---- cache policy -----------------------------------------------------
    def l2_persist(self, stream, base: int, nbytes: int) -> int:
        """Mark device memory [base, base + nbytes) as persisting in L2 for the kernels later launched into `stream`,
        with an L2 set-aside of up to the device's limit; the bytes set aside, 0 where the device has no such
        control (the default: AMD's runtime has none). A cache policy only: no value changes."""
        return 0

    def l2_persist_reset(self, stream=None) -> None:
        """Undo l2_persist for this process — persisting lines back to normal, no set-aside — or, given a stream, only
        if the last window was set on that stream (nothing by default)."""

    # ---- code -------------------------------------------------------------
    @abstractmethod
    def compile(self, source: str | Path, *, defines: dict | None = None, options: list[str] | None = None):
        """Compile a .hip file (path, relative paths are under kernels_hip/) into a loaded Module.
        Includes resolve against kernels_hip/. Cached on disk by (source+includes hash, arch, options)."""

    # ---- memory -----------------------------------------------------------
    @abstractmethod
    def malloc(self, nbytes: int) -> DeviceBuffer: ...

    @abstractmethod
    def malloc_fine_grained(self, nbytes: int) -> DeviceBuffer:
        """Memory other GPUs may poll while this one writes (cross-GPU flags). AMD: hipExtMallocWithFlags
        (hipDeviceMallocFinegrained); NVIDIA: ordinary device memory (coherent over NVLink at system scope)."""

    @abstractmethod
    def host_alloc_mapped(self, nbytes: int) -> HostBuffer: ...

    @abstractmethod
    def copy_htod(self, dst: DeviceBuffer | int, src: np.ndarray, stream=None) -> None: ...

    @abstractmethod
    def copy_dtoh(self, dst: np.ndarray, src: DeviceBuffer | int, stream=None) -> None: ...

    @abstractmethod
    def copy_dtod(self, dst: DeviceBuffer | int, src: DeviceBuffer | int, nbytes: int, stream=None) -> None: ...

    @abstractmethod
    def memset(self, dst: DeviceBuffer | int, byte: int, nbytes: int, stream=None) -> None: ...

    def upload(self, array: np.ndarray) -> DeviceBuffer:
        array = np.ascontiguousarray(array)
        buf = self.malloc(max(array.nbytes, 1))
        self.copy_htod(buf, array)
        return buf

    def download(self, src: DeviceBuffer | int, shape, dtype) -> np.ndarray:
        out = np.empty(shape, dtype)
        self.copy_dtoh(out, src)
        return out

    @abstractmethod
    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes."""

    # ---- execution --------------------------------------------------------
    # Programmatic dependent launch (NVIDIA sm_90+; kernels_hip/port.h he_pdl_wait): the backend sets it.
    pdl_launch: bool = False

    @abstractmethod
    def launch(self, fn, grid, block, args: list, shared: int = 0, stream=None, cooperative: bool = False,
               pdl: bool = False) -> None:
        """grid/block: int or (x, y, z). ``cooperative`` uses the cooperative launch (all blocks resident).
        ``pdl``: the kernel may start while the previous kernel of the stream is still running (it must call
        he_pdl_wait() before touching that kernel's data); ignored where ``pdl_launch`` is False."""

    @abstractmethod
    def max_active_blocks(self, fn, block: int, shared: int = 0) -> int:
        """Occupancy: blocks of this kernel resident per SM/CU (sizes a persistent grid)."""

    @abstractmethod
    def stream(self): ...

    @abstractmethod
    def event(self): ...

    @abstractmethod
    def synchronize(self) -> None: ...

    @abstractmethod
    def begin_capture(self, stream) -> None: ...

    @abstractmethod
    def end_capture(self, stream):
        """Returns a graph exec with ``.launch(stream)``."""

    # ---- peers ------------------------------------------------------------
    @abstractmethod
    def can_access_peer(self, other: "Runtime") -> bool: ...

    @abstractmethod
    def enable_peer_access(self, other: "Runtime") -> None: ...

    # ---- freeing (called by buffers) -------------------------------------
    @abstractmethod
    def _free(self, buf: DeviceBuffer) -> None: ...

    @abstractmethod
    def _free_host(self, buf: HostBuffer) -> None: ...


_RUNTIMES: dict[int, Runtime] = {}


def backend_name() -> str | None:
    """'hip' or 'cuda' (HIPENGINE_BACKEND overrides), or None when no GPU backend can be loaded."""
    forced = os.environ.get("HIPENGINE_BACKEND")
    if forced:
        if forced not in ("hip", "cuda"):
            raise DeviceError(f"HIPENGINE_BACKEND must be 'hip' or 'cuda', got {forced!r}")
        return forced
    from . import backend_cuda, backend_hip

    if backend_hip.available():
        return "hip"
    if backend_cuda.available():
        return "cuda"
    return None


def device_count() -> int:
    """Number of usable GPUs; 0 (never an exception) when there is no driver or no device."""
    try:
        name = backend_name()
        if name is None:
            return 0
        mod = _backend_module(name)
        return mod.device_count()
    except Exception:
        return 0


def _backend_module(name: str):
    if name == "hip":
        from . import backend_hip as mod
    else:
        from . import backend_cuda as mod
    return mod


def get_runtime(index: int = 0) -> Runtime:
    if index in _RUNTIMES:
        return _RUNTIMES[index]
    name = backend_name()
    if name is None:
        raise DeviceError("no GPU found: neither the HIP runtime (libamdhip64) nor the CUDA driver could be "
                          "loaded; use --device cpu")
    mod = _backend_module(name)
    n = mod.device_count()
    if index >= n:
        raise DeviceError(f"GPU {index} requested but only {n} found")
    rt = mod.create_runtime(index)
    _RUNTIMES[index] = rt
    return rt
