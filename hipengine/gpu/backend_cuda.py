"""NVIDIA backend: cuda-bindings driver API + NVRTC.

HIP's device dialect is CUDA's, so the kernels_hip/ sources compile unchanged with NVRTC (``port.h`` picks the
vendor). We emit CUBIN for the exact ``sm_XY`` of the device (``nvrtcGetCUBIN``), so loading never JITs PTX.

Every cuda-bindings call returns ``(err, *results)``; all of them go through ``check()``, which raises
``DeviceError`` naming the call and the driver's error string. The primary context of each device is retained
once and made current at the top of every method, so one Python thread can drive several GPUs.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from ..errors import DeviceError
from . import compiler
from .runtime import DeviceBuffer, HostBuffer, Runtime

try:  # cuda-bindings may be absent (AMD machines, CPU-only installs): available() then says False.
    from cuda.bindings import driver as cu
    from cuda.bindings import nvrtc
except Exception:  # pragma: no cover - depends on the machine
    cu = None
    nvrtc = None


def check(result, what: str):
    """Unpack a cuda-bindings result tuple ``(err, *values)``; raise DeviceError naming ``what`` on failure.
    Returns None, the single value, or the tuple of values."""
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if int(err) != 0:
        raise DeviceError(f"{what} failed: {_error_string(err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def _error_string(err) -> str:
    name = getattr(err, "name", str(err))
    try:
        if nvrtc is not None and isinstance(err, nvrtc.nvrtcResult):
            return name
        e, s = cu.cuGetErrorString(err)
        if int(e) == 0 and s:
            return f"{name} ({s.decode(errors='replace')})"
    except Exception:
        pass
    return name


# ---------------------------------------------------------------------------------------------------------
# availability
# ---------------------------------------------------------------------------------------------------------
_INIT: bool | None = None


def _init() -> bool:
    global _INIT
    if _INIT is None:
        try:
            # cuInit raises RuntimeError (not an error code) when libcuda.so.1 cannot be dlopen'ed.
            _INIT = cu is not None and int(cu.cuInit(0)[0]) == 0
        except Exception:
            _INIT = False
    return _INIT


def available() -> bool:
    """True when the CUDA driver loads and reports at least one device. Never raises."""
    try:
        return device_count() > 0
    except Exception:
        return False


def device_count() -> int:
    if not _init():
        return 0
    try:
        err, n = cu.cuDeviceGetCount()
        return int(n) if int(err) == 0 else 0
    except Exception:
        return 0


# ---------------------------------------------------------------------------------------------------------
# NVRTC (usable without a GPU: ``hipengine kernels check`` compiles sm_90 on a CPU-only machine)
# ---------------------------------------------------------------------------------------------------------
def nvrtc_available() -> bool:
    try:
        return nvrtc is not None and int(nvrtc.nvrtcVersion()[0]) == 0
    except Exception:
        return False


def nvrtc_id() -> str:
    major, minor = check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    return f"nvrtc-{major}.{minor}"


def _cuda_include_dir() -> Path | None:
    """Directory holding cuda_bf16.h & co. NVRTC ships no CUDA headers of its own; kernels that include them
    need the CUDA toolkit's (pip nvidia-cuda-runtime or a toolkit install). Optional: port.h may not need it."""
    try:
        import cuda.pathfinder as pf

        d = pf.find_nvidia_header_directory("cudart")
        if d:
            return Path(d)
    except Exception:
        pass
    import os

    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "include" / "cuda_runtime.h").is_file():
            return Path(root) / "include"
    return None


def nvrtc_options(arch: str, directory: Path | None, defines: dict | None = None,
                  options: list[str] | None = None) -> list[str]:
    opts = [f"--gpu-architecture={arch}", "-std=c++17"]
    # No -default-device: the sources must stay valid for clang's HIP mode too, where unannotated functions
    # are host-only; keeping NVRTC equally strict catches a missing __device__ here rather than on AMD.
    for d in ([directory] if directory else []) + compiler.include_dirs():
        opts.append(f"-I{d}")
    inc = _cuda_include_dir()
    if inc is not None:
        opts.append(f"-I{inc}")
    opts += compiler.define_options(defines)
    opts += list(options or [])
    return opts


def nvrtc_compile(text: str, name: str, opts: list[str]) -> tuple[bytes, str]:
    """Compile CUDA/HIP source text to CUBIN. Returns (cubin, log). DeviceError with the log's first lines on
    failure. ``opts`` must name a real ``sm_XY`` architecture (a ``compute_XY`` target has no CUBIN)."""
    if not nvrtc_available():
        raise DeviceError("NVRTC not found: install the nvidia-cuda-nvrtc wheel (pip install nvidia-cuda-nvrtc)")
    prog = check(nvrtc.nvrtcCreateProgram(text.encode(), name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        bopts = [o.encode() for o in opts]
        res = nvrtc.nvrtcCompileProgram(prog, len(bopts), bopts)
        size = check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = b" " * size
        check(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = buf.rstrip(b"\x00").decode(errors="replace").strip()
        if int(res[0]) != 0:
            raise DeviceError(f"NVRTC failed to compile {name} ({res[0].name}):\n{compiler.first_lines(log)}")
        size = check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        if size == 0:
            raise DeviceError(f"NVRTC produced no CUBIN for {name}: the target must be sm_XY, not compute_XY")
        cubin = b" " * size
        check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


# ---------------------------------------------------------------------------------------------------------
# handles
# ---------------------------------------------------------------------------------------------------------
class Function:
    """A kernel in a loaded module, with the attribute helpers the executor needs."""

    def __init__(self, rt: "CudaRuntime", handle, name: str):
        self.rt, self.handle, self.name = rt, handle, name
        self._dyn_shared = 0  # largest dynamic shared size this function has been opted into
        self._static = None  # its static shared memory, read once (fit_shared)
        self._carveout = -1  # its preferred carve-out as last set (prefer_carveout; -1: none, the driver's choice)

    def attribute(self, attr: str) -> int:
        """``attr`` is the suffix of a CUfunction_attribute, e.g. "NUM_REGS", "MAX_THREADS_PER_BLOCK"."""
        self.rt._current()
        enum = getattr(cu.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{attr}")
        return int(check(cu.cuFuncGetAttribute(enum, self.handle), f"cuFuncGetAttribute({attr}, {self.name})"))

    def set_attribute(self, attr: str, value: int) -> None:
        """Set the CUfunction_attribute named by its suffix, e.g. "MAX_DYNAMIC_SHARED_SIZE_BYTES"."""
        self.rt._current()
        enum = getattr(cu.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{attr}")
        check(cu.cuFuncSetAttribute(self.handle, enum, int(value)), f"cuFuncSetAttribute({attr}={value}, {self.name})")

    @property
    def num_regs(self) -> int:
        return self.attribute("NUM_REGS")

    @property
    def max_threads_per_block(self) -> int:
        return self.attribute("MAX_THREADS_PER_BLOCK")

    @property
    def static_shared(self) -> int:
        return self.attribute("SHARED_SIZE_BYTES")

    def fit_shared(self, nbytes: int) -> None:
        """Opt in to ``nbytes`` of dynamic shared memory where the default limit does not cover it: the 48 KiB
        a launch gets without the attribute bound the kernel's static shared memory plus the dynamic."""
        if nbytes <= self._dyn_shared:
            return
        if self._static is None:
            self._static = self.static_shared
        if nbytes + self._static > 48 * 1024:
            self.set_max_dynamic_shared(nbytes)

    def set_max_dynamic_shared(self, nbytes: int) -> None:
        """Opt in to more than the default dynamic shared memory (up to ``rt.max_shared_per_block``)."""
        if nbytes <= self._dyn_shared:
            return
        self.set_attribute("MAX_DYNAMIC_SHARED_SIZE_BYTES", nbytes)
        self._dyn_shared = nbytes

    def prefer_carveout(self, percent: int) -> None:
        """The preferred shared-memory share of the SM's unified L1 / shared storage for this function's launches, in
        percent (0: the most L1 the launch's shared memory allows); -1 gives the choice back to the driver — a call
        made only to undo an earlier preference, so a function never given one never sees the attribute."""
        if int(percent) == self._carveout:
            return
        self.set_attribute("PREFERRED_SHARED_MEMORY_CARVEOUT", percent)
        self._carveout = int(percent)

    def __repr__(self):
        return f"<cuda Function {self.name}>"


class Module:
    def __init__(self, rt: "CudaRuntime", handle, name: str, binary: bytes, log: str = ""):
        self.rt, self.handle, self.name, self.binary, self.log = rt, handle, name, binary, log
        self._functions: dict[str, Function] = {}

    def function(self, name: str) -> Function:
        fn = self._functions.get(name)
        if fn is None:
            self.rt._current()
            h = check(cu.cuModuleGetFunction(self.handle, name.encode()), f"cuModuleGetFunction({name!r} in {self.name})")
            fn = self._functions[name] = Function(self.rt, h, name)
        return fn

    __getitem__ = function


class Stream:
    def __init__(self, rt: "CudaRuntime", handle):
        self.rt, self.handle = rt, handle

    def synchronize(self) -> None:
        self.rt._current()
        check(cu.cuStreamSynchronize(self.handle), "cuStreamSynchronize")

    def destroy(self) -> None:
        if self.handle is not None:
            self.rt._current()
            check(cu.cuStreamDestroy(self.handle), "cuStreamDestroy")
            self.handle = None


class Event:
    def __init__(self, rt: "CudaRuntime", handle):
        self.rt, self.handle = rt, handle

    def record(self, stream=None) -> "Event":
        self.rt._current()
        check(cu.cuEventRecord(self.handle, _stream(stream)), "cuEventRecord")
        return self

    def synchronize(self) -> None:
        self.rt._current()
        check(cu.cuEventSynchronize(self.handle), "cuEventSynchronize")

    def query(self) -> bool:
        """True when all work before the record has completed."""
        self.rt._current()
        err = cu.cuEventQuery(self.handle)[0]
        if err == cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        check((err,), "cuEventQuery")
        return True

    def elapsed_ms(self, end: "Event") -> float:
        """Milliseconds from this event to ``end`` (both recorded; waits for ``end``)."""
        end.synchronize()
        return float(check(cu.cuEventElapsedTime(self.handle, end.handle), "cuEventElapsedTime"))

    def destroy(self) -> None:
        if self.handle is not None:
            self.rt._current()
            check(cu.cuEventDestroy(self.handle), "cuEventDestroy")
            self.handle = None


class GraphExec:
    def __init__(self, rt: "CudaRuntime", graph, exec_):
        self.rt, self.graph, self.exec = rt, graph, exec_

    def launch(self, stream=None) -> None:
        self.rt._current()
        check(cu.cuGraphLaunch(self.exec, _stream(stream)), "cuGraphLaunch")

    def destroy(self) -> None:
        if self.exec is not None:
            self.rt._current()
            check(cu.cuGraphExecDestroy(self.exec), "cuGraphExecDestroy")
            check(cu.cuGraphDestroy(self.graph), "cuGraphDestroy")
            self.exec = self.graph = None


def _stream(stream):
    """Stream object / raw handle / None (legacy default stream) -> CUstream."""
    if stream is None:
        return cu.CUstream(0)
    return stream.handle if isinstance(stream, Stream) else stream


def _ptr(x) -> int:
    if isinstance(x, DeviceBuffer):
        return x.ptr
    if isinstance(x, HostBuffer):
        return x.dptr
    return int(x)


def _dims(d) -> tuple[int, int, int]:
    if isinstance(d, int):
        return (d, 1, 1)
    d = tuple(int(v) for v in d)
    return (d + (1, 1, 1))[:3]


def kernel_params(args: list):
    """Build the ``void**`` kernelParams array: one pointer per argument, each pointing at a ctypes value.
    Returns (address or 0, keepalive); the caller holds ``keepalive`` until the launch call returns (the
    driver copies argument values during the call, so nothing needs to outlive it)."""
    values = []
    for i, a in enumerate(args):
        if isinstance(a, (DeviceBuffer, HostBuffer)):
            values.append(ctypes.c_void_p(_ptr(a)))
        elif isinstance(a, (ctypes._SimpleCData, ctypes.Structure, ctypes.Array)):
            values.append(a)  # a struct or array argument is passed by value, as the kernel declares it
        else:
            raise DeviceError(f"kernel argument {i} is {type(a).__name__}; pass a ctypes scalar "
                              "(c_void_p, c_int32, c_float...), a ctypes struct or array, or a DeviceBuffer")
    if not values:
        return 0, ()
    arr = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    return ctypes.addressof(arr), (arr, values)


# ---------------------------------------------------------------------------------------------------------
# runtime
# ---------------------------------------------------------------------------------------------------------
class CudaRuntime(Runtime):
    vendor = "nvidia"
    l2_aside, l2_stream = 0, None  # the L2 set-aside l2_persist made, and the stream its window is on

    def __init__(self, index: int):
        if not _init():
            raise DeviceError("the CUDA driver (libcuda.so.1) could not be initialised")
        self.device_index = index
        self.dev = check(cu.cuDeviceGet(index), f"cuDeviceGet({index})")
        self.ctx = check(cu.cuDevicePrimaryCtxRetain(self.dev), f"cuDevicePrimaryCtxRetain({index})")
        self._current()
        A = cu.CUdevice_attribute

        def attr(name):
            return int(check(cu.cuDeviceGetAttribute(getattr(A, f"CU_DEVICE_ATTRIBUTE_{name}"), self.dev),
                             f"cuDeviceGetAttribute({name})"))

        major, minor = attr("COMPUTE_CAPABILITY_MAJOR"), attr("COMPUTE_CAPABILITY_MINOR")
        self.arch = f"sm_{major}{minor}"
        self.num_sms = attr("MULTIPROCESSOR_COUNT")
        self.max_shared_per_block = attr("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN")
        self.l2_bytes = attr("L2_CACHE_SIZE")
        self.warp_size = attr("WARP_SIZE")
        self.cooperative_launch = bool(attr("COOPERATIVE_LAUNCH"))
        self.pdl_launch = major >= 9  # griddepcontrol (programmatic dependent launch) is sm_90+
        self.total_mem = int(check(cu.cuDeviceTotalMem(self.dev), "cuDeviceTotalMem"))
        raw = check(cu.cuDeviceGetName(256, self.dev), "cuDeviceGetName")
        raw = raw.decode(errors="replace") if isinstance(raw, (bytes, bytearray)) else str(raw)
        self.name = raw.split("\x00", 1)[0].strip()
        self._modules: dict[str, Module] = {}

    def __repr__(self):
        return f"<CudaRuntime {self.device_index}: {self.name} {self.arch}, {self.num_sms} SMs>"

    def _current(self) -> None:
        check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    # ---- cache policy -----------------------------------------------------
    def l2_persist(self, stream, base: int, nbytes: int) -> int:
        """An access-policy window on `stream` (hit lines persisting, the rest streaming) over [base, base + nbytes),
        cut to the device's largest window, and an L2 set-aside of min(nbytes, the device's limit) for this
        context (a per-context limit, gone with the context: no device setting changes). hitRatio = set-aside /
        window, so the lines marked persisting fit the set-aside."""
        self._current()
        A = cu.CUdevice_attribute
        most = int(check(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE, self.dev),
                         "cuDeviceGetAttribute(MAX_PERSISTING_L2_CACHE_SIZE)"))
        widest = int(check(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE, self.dev),
                           "cuDeviceGetAttribute(MAX_ACCESS_POLICY_WINDOW_SIZE)"))
        nbytes = min(int(nbytes), widest)
        if most <= 0 or nbytes <= 0:
            return 0
        aside = min(most, nbytes)
        check(cu.cuCtxSetLimit(cu.CUlimit.CU_LIMIT_PERSISTING_L2_CACHE_SIZE, aside),
              f"cuCtxSetLimit(PERSISTING_L2_CACHE_SIZE, {aside})")
        w = cu.CUaccessPolicyWindow()
        w.base_ptr = int(base)
        w.num_bytes = nbytes
        w.hitRatio = min(1.0, aside / nbytes)
        w.hitProp = cu.CUaccessProperty.CU_ACCESS_PROPERTY_PERSISTING
        w.missProp = cu.CUaccessProperty.CU_ACCESS_PROPERTY_STREAMING
        v = cu.CUstreamAttrValue()
        v.accessPolicyWindow = w
        check(cu.cuStreamSetAttribute(_stream(stream), cu.CUstreamAttrID.CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW, v),
              "cuStreamSetAttribute(ACCESS_POLICY_WINDOW)")
        self.l2_aside, self.l2_stream = aside, stream
        return aside

    def l2_persist_reset(self, stream=None) -> None:
        if not self.l2_aside or (stream is not None and stream is not self.l2_stream):
            return
        self._current()
        check(cu.cuCtxResetPersistingL2Cache(), "cuCtxResetPersistingL2Cache")
        check(cu.cuCtxSetLimit(cu.CUlimit.CU_LIMIT_PERSISTING_L2_CACHE_SIZE, 0), "cuCtxSetLimit(PERSISTING_L2_CACHE_SIZE, 0)")
        self.l2_aside, self.l2_stream = 0, None

    # ---- code -------------------------------------------------------------
    def compile(self, source, *, defines=None, options=None) -> Module:
        path, text = compiler.resolve_source(source)
        directory = path.parent if path else None
        name = path.name if path else "inline.hip"
        opts = nvrtc_options(self.arch, directory, defines, options)
        # Include paths are machine-specific; keep them out of the key (the header *contents* are in it).
        key_opts = [o for o in opts if not o.startswith("-I")]
        memo = compiler.cache_key(text, directory, self.arch, key_opts, nvrtc_id())
        if memo in self._modules:
            return self._modules[memo]
        log_box = [""]

        def build() -> bytes:
            cubin, log_box[0] = nvrtc_compile(text, name, opts)
            return cubin

        cubin = compiler.cached_build(text, directory, self.arch, key_opts, nvrtc_id(), build, ".cubin")
        self._current()
        handle = check(cu.cuModuleLoadData(cubin), f"cuModuleLoadData({name})")
        mod = self._modules[memo] = Module(self, handle, name, cubin, log_box[0])
        compiler.show_warnings(name, log_box[0], "NVRTC")
        return mod

    # ---- memory -----------------------------------------------------------
    def malloc(self, nbytes: int) -> DeviceBuffer:
        self._current()
        try:
            ptr = check(cu.cuMemAlloc(max(int(nbytes), 1)), f"cuMemAlloc({nbytes})")
        except DeviceError as e:
            free, total = self.mem_info()
            raise DeviceError(f"{e}; GPU {self.device_index} has {free / 2**30:.2f} of {total / 2**30:.2f} GiB free") from None
        return DeviceBuffer(int(ptr), int(nbytes), self)

    def malloc_fine_grained(self, nbytes: int) -> DeviceBuffer:
        # NVIDIA device memory is coherent for system-scope atomics/fences over NVLink peers: no special kind.
        buf = self.malloc(nbytes)
        buf.fine_grained = True
        return buf

    def host_alloc_mapped(self, nbytes: int) -> HostBuffer:
        self._current()
        flags = cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE
        hptr = int(check(cu.cuMemHostAlloc(max(int(nbytes), 1), flags), f"cuMemHostAlloc({nbytes})"))
        dptr = int(check(cu.cuMemHostGetDevicePointer(hptr, 0), "cuMemHostGetDevicePointer"))
        array = np.ctypeslib.as_array((ctypes.c_uint8 * max(int(nbytes), 1)).from_address(hptr))[:nbytes]
        return HostBuffer(array, dptr, self, hptr)

    def copy_htod(self, dst, src: np.ndarray, stream=None) -> None:
        src = np.ascontiguousarray(src)
        self._current()
        if stream is None:
            check(cu.cuMemcpyHtoD(_ptr(dst), src.ctypes.data, src.nbytes), "cuMemcpyHtoD")
        else:
            check(cu.cuMemcpyHtoDAsync(_ptr(dst), src.ctypes.data, src.nbytes, _stream(stream)), "cuMemcpyHtoDAsync")

    def copy_dtoh(self, dst: np.ndarray, src, stream=None) -> None:
        if not dst.flags.c_contiguous:
            raise DeviceError("copy_dtoh needs a C-contiguous destination array")
        self._current()
        if stream is None:
            # Our streams are non-blocking, so a legacy-stream copy would not wait for them: synchronise the
            # device first so a plain download always returns what every earlier launch wrote.
            check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
            check(cu.cuMemcpyDtoH(dst.ctypes.data, _ptr(src), dst.nbytes), "cuMemcpyDtoH")
        else:
            check(cu.cuMemcpyDtoHAsync(dst.ctypes.data, _ptr(src), dst.nbytes, _stream(stream)), "cuMemcpyDtoHAsync")

    def copy_dtod(self, dst, src, nbytes: int, stream=None) -> None:
        self._current()
        # cuMemcpyDtoD works across devices (and peers) under unified addressing.
        check(cu.cuMemcpyDtoDAsync(_ptr(dst), _ptr(src), int(nbytes), _stream(stream)), "cuMemcpyDtoDAsync")
        if stream is None:
            check(cu.cuStreamSynchronize(cu.CUstream(0)), "cuStreamSynchronize")

    def memset(self, dst, byte: int, nbytes: int, stream=None) -> None:
        self._current()
        check(cu.cuMemsetD8Async(_ptr(dst), int(byte) & 0xFF, int(nbytes), _stream(stream)), "cuMemsetD8Async")
        if stream is None:
            check(cu.cuStreamSynchronize(cu.CUstream(0)), "cuStreamSynchronize")

    def mem_info(self) -> tuple[int, int]:
        self._current()
        free, total = check(cu.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def _free(self, buf: DeviceBuffer) -> None:
        self._current()
        check(cu.cuMemFree(buf.ptr), "cuMemFree")

    def _free_host(self, buf: HostBuffer) -> None:
        self._current()
        check(cu.cuMemFreeHost(buf.hptr), "cuMemFreeHost")

    # ---- execution --------------------------------------------------------
    def launch(self, fn: Function, grid, block, args: list, shared: int = 0, stream=None,
               cooperative: bool = False, pdl: bool = False) -> None:
        self._current()
        gx, gy, gz = _dims(grid)
        bx, by, bz = _dims(block)
        fn.fit_shared(shared)
        params, keep = kernel_params(args)
        if pdl and self.pdl_launch and not cooperative:
            res = cu.cuLaunchKernelEx(self._pdl_config(gx, gy, gz, bx, by, bz, shared, stream), fn.handle, params, 0)
            what = "cuLaunchKernelEx(programmatic stream serialization)"
        elif cooperative:
            res = cu.cuLaunchCooperativeKernel(fn.handle, gx, gy, gz, bx, by, bz, int(shared), _stream(stream), params)
            what = "cuLaunchCooperativeKernel"
        else:
            res = cu.cuLaunchKernel(fn.handle, gx, gy, gz, bx, by, bz, int(shared), _stream(stream), params, 0)
            what = "cuLaunchKernel"
        del keep  # the driver has copied the argument values by the time the call returns
        check(res, f"{what}({fn.name}, grid={(gx, gy, gz)}, block={(bx, by, bz)}, shared={shared})")

    @staticmethod
    def _pdl_config(gx, gy, gz, bx, by, bz, shared, stream):
        """Launch configuration with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION: the kernel may
        launch once every block of the previous kernel in the stream called griddepcontrol.launch_dependents
        (port.h he_pdl_trigger) or exited; its griddepcontrol.wait (he_pdl_wait) then waits for that kernel's
        completion. Captured into a graph it becomes a programmatic edge."""
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        cfg = cu.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = gx, gy, gz
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = bx, by, bz
        cfg.sharedMemBytes = int(shared)
        cfg.hStream = _stream(stream)
        cfg.attrs = [attr]
        cfg.numAttrs = 1
        return cfg

    def max_active_blocks(self, fn: Function, block: int, shared: int = 0) -> int:
        self._current()
        fn.fit_shared(shared)
        return int(check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn.handle, int(block), int(shared)),
                         f"cuOccupancyMaxActiveBlocksPerMultiprocessor({fn.name})"))

    def stream(self) -> Stream:
        self._current()
        # Non-blocking: our streams must not serialise against the legacy default stream (used by sync copies).
        return Stream(self, check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate"))

    def event(self) -> Event:
        self._current()
        return Event(self, check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DEFAULT), "cuEventCreate"))

    def synchronize(self) -> None:
        self._current()
        check(cu.cuCtxSynchronize(), "cuCtxSynchronize")

    def begin_capture(self, stream) -> None:
        if stream is None:
            raise DeviceError("graph capture needs a created stream (rt.stream()), not the default stream")
        self._current()
        # Thread-local mode: other threads' unrelated driver calls (another GPU's runtime) stay legal.
        check(cu.cuStreamBeginCapture(_stream(stream), cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
              "cuStreamBeginCapture")

    def end_capture(self, stream) -> GraphExec:
        self._current()
        graph = check(cu.cuStreamEndCapture(_stream(stream)), "cuStreamEndCapture")
        exec_ = check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        return GraphExec(self, graph, exec_)

    # ---- peers ------------------------------------------------------------
    def can_access_peer(self, other: Runtime) -> bool:
        if other is self:
            return True
        return bool(check(cu.cuDeviceCanAccessPeer(self.dev, other.dev), "cuDeviceCanAccessPeer"))

    def enable_peer_access(self, other: Runtime) -> None:
        """Let kernels on this device dereference ``other``'s memory (one direction; call both ways)."""
        if other is self:
            return
        self._current()
        err = cu.cuCtxEnablePeerAccess(other.ctx, 0)[0]
        if err == cu.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
            return
        check((err,), f"cuCtxEnablePeerAccess(GPU {self.device_index} -> GPU {other.device_index})")


def create_runtime(index: int) -> CudaRuntime:
    return CudaRuntime(index)
