"""NCCL / RCCL through ctypes: one declarative table of C prototypes, every call through ``check()``.

RCCL implements NCCL's C API under the same names, so the table serves both vendors; only the library
differs: on NVIDIA ``libnccl.so.2`` from the ``nvidia-nccl-cu13`` wheel (found through its package
directory), on AMD ``librccl.so`` from ROCm. ``HIPENGINE_NCCL_LIB`` names a library explicitly.

One process drives all GPUs: ``NcclComm(devices)`` calls ``ncclCommInitAll`` and every collective issues
one call per rank inside ``ncclGroupStart/End``. Streams are the runtime's streams (raw handles passed
through).
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

from ..errors import DeviceError

# NVLink SHARP (multicast objects) stays off: on the lent machines a program using it can take the host's
# GPUs out of service. Must be set before the library initialises.
os.environ["NCCL_NVLS_ENABLE"] = "0"

ncclResult_t = ctypes.c_int
ncclComm_t = ctypes.c_void_p
cudaStream_t = ctypes.c_void_p


class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]  # NCCL_UNIQUE_ID_BYTES


# ncclDataType_t / ncclRedOp_t values from nccl.h (RCCL uses the same numbering for these).
DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5, "float16": 6, "float32": 7,
          "float64": 8, "bfloat16": 9}
OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}

# name -> (restype, argtypes). The whole binding: nothing else calls into the library.
PROTOTYPES = {
    "ncclGetVersion": (ncclResult_t, [ctypes.POINTER(ctypes.c_int)]),
    "ncclGetUniqueId": (ncclResult_t, [ctypes.POINTER(ncclUniqueId)]),
    "ncclCommInitAll": (ncclResult_t, [ctypes.POINTER(ncclComm_t), ctypes.c_int, ctypes.POINTER(ctypes.c_int)]),
    "ncclCommInitRank": (ncclResult_t, [ctypes.POINTER(ncclComm_t), ctypes.c_int, ncclUniqueId, ctypes.c_int]),
    "ncclAllReduce": (ncclResult_t, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                     ncclComm_t, cudaStream_t]),
    "ncclGroupStart": (ncclResult_t, []),
    "ncclGroupEnd": (ncclResult_t, []),
    "ncclCommDestroy": (ncclResult_t, [ncclComm_t]),
    "ncclGetErrorString": (ctypes.c_char_p, [ncclResult_t]),
}


def library_path() -> str:
    """Where the NCCL/RCCL library is; DeviceError naming what to install if there is none."""
    env = os.environ.get("HIPENGINE_NCCL_LIB")
    if env:
        return env
    candidates: list[str] = []
    # The nvidia-nccl-cu* wheels put the library under the ``nvidia`` namespace package (nvidia/nccl/lib,
    # or nvidia/cu13/lib for the CUDA-13 family layout); look in every ``nvidia/*/lib``.
    spec = importlib.util.find_spec("nvidia")
    for d in (spec.submodule_search_locations or []) if spec else []:
        candidates += sorted(str(p) for p in Path(d).glob("*/lib/libnccl.so*"))
    rocm = os.environ.get("ROCM_PATH", "/opt/rocm")
    candidates += [f"{rocm}/lib/librccl.so", "librccl.so", "libnccl.so.2"]
    for c in candidates:
        if "/" not in c or Path(c).exists():
            try:
                ctypes.CDLL(c)
                return c
            except OSError:
                continue
    raise DeviceError("no NCCL/RCCL library found: pip install nvidia-nccl-cu13 (NVIDIA) or install ROCm's "
                      "RCCL (AMD), or set HIPENGINE_NCCL_LIB")


class _Lib:
    def __init__(self, path: str):
        self.path = path
        try:
            self.dll = ctypes.CDLL(path)
        except OSError as e:
            raise DeviceError(f"cannot load the NCCL/RCCL library {path}: {e}") from None
        for name, (res, args) in PROTOTYPES.items():
            fn = getattr(self.dll, name)
            fn.restype, fn.argtypes = res, args
            setattr(self, name, fn)

    def check(self, result: int, what: str) -> None:
        """The one checking function: every library call's result goes through here."""
        if result != 0:
            msg = self.ncclGetErrorString(result)
            raise DeviceError(f"{what} failed: {msg.decode() if msg else 'error'} (ncclResult {result}, {self.path})")

    def version(self) -> str:
        v = ctypes.c_int()
        self.check(self.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        code = v.value  # NCCL >= 2.9: major*10000 + minor*100 + patch
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


_LIB: _Lib | None = None


def lib() -> _Lib:
    global _LIB
    if _LIB is None:
        _LIB = _Lib(library_path())
    return _LIB


def raw_stream(stream) -> int:
    """Runtime stream object (``.handle``) / vendor handle / int -> the raw cudaStream_t/hipStream_t value."""
    if stream is None:
        return 0
    h = getattr(stream, "handle", stream)
    try:
        return int(h)
    except TypeError:
        return int(h.getPtr())


class NcclComm:
    """A single-process communicator over ``devices`` (GPU ordinals), one rank per GPU."""

    def __init__(self, devices: list[int]):
        self.lib = lib()
        self.devices = list(devices)
        self.world = len(self.devices)
        comms = (ncclComm_t * self.world)()
        devs = (ctypes.c_int * self.world)(*self.devices)
        self.lib.check(self.lib.ncclCommInitAll(comms, self.world, devs), f"ncclCommInitAll({self.devices})")
        self.comms = list(comms)

    def allreduce(self, sends: list, recvs: list, count: int, dtype: str = "float32", op: str = "sum",
                  streams: list | None = None) -> None:
        """One all-reduce across all ranks (enqueued on each rank's stream; returns without waiting)."""
        if dtype not in DTYPES:
            raise DeviceError(f"NCCL all-reduce dtype {dtype!r} not supported ({', '.join(DTYPES)})")
        streams = streams or [None] * self.world
        L = self.lib
        # One thread issuing for several GPUs must group the calls, or the first blocks waiting for the rest.
        L.check(L.ncclGroupStart(), "ncclGroupStart")
        try:
            for r in range(self.world):
                L.check(L.ncclAllReduce(_ptr(sends[r]), _ptr(recvs[r]), count, DTYPES[dtype], OPS[op],
                                        self.comms[r], raw_stream(streams[r])), f"ncclAllReduce(rank {r})")
        finally:
            L.check(L.ncclGroupEnd(), "ncclGroupEnd")

    def close(self) -> None:
        for c in self.comms:
            if c:
                self.lib.check(self.lib.ncclCommDestroy(c), "ncclCommDestroy")
        self.comms = []


def _ptr(x) -> int:
    return x.ptr if hasattr(x, "ptr") else int(x)
