"""AMD backend: hip-python (``hip.hip`` runtime/module API + ``hip.hiprtc``).

Sources compile with hiprtc for the device's ``gcnArchName`` stripped of its feature suffix
(``gfx942:sramecc+:xnack-`` -> ``--offload-arch=gfx942``), load with ``hipModuleLoadData`` and launch with
``hipModuleLaunchKernel`` / ``hipModuleLaunchCooperativeKernel``. Kernel arguments go through
``kernelParams`` (the address of a ``void*[]`` whose entries point at ctypes values), never ``extra``: one
argument convention for both vendors.

hip-python returns ``(err, *results)`` from every call; all go through ``check()``. No AMD GPU is available to
the project's CI, so every hip/hiprtc call made here is checked against hip-python's signatures by
tests/test_hip_contract.py (names and arity).
"""
from __future__ import annotations

import ctypes

import numpy as np

from ..errors import DeviceError
from . import compiler
from .backend_cuda import _dims, kernel_params
from .runtime import DeviceBuffer, HostBuffer, Runtime

try:  # hip-python may be absent; when present it still fails at call time without libamdhip64.
    from hip import hip, hiprtc
except Exception:  # pragma: no cover - depends on the machine
    hip = None
    hiprtc = None


def check(result, what: str):
    """Unpack ``(err, *values)``; raise DeviceError naming ``what`` and HIP's error string on failure."""
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
        if isinstance(err, hiprtc.hiprtcResult):
            s = hiprtc.hiprtcGetErrorString(err)
        else:
            s = hip.hipGetErrorString(err)
        s = s[-1] if isinstance(s, tuple) else s
        if s:
            return f"{name} ({s.decode(errors='replace') if isinstance(s, bytes) else s})"
    except Exception:
        pass
    return name


def _addr(p) -> int:
    """hip-python Pointer/DeviceArray or int -> integer address."""
    return 0 if p is None else int(p)


def _ptr(x) -> int:
    if isinstance(x, DeviceBuffer):
        return x.ptr
    if isinstance(x, HostBuffer):
        return x.dptr
    return int(x)


def _stream(stream):
    if stream is None:
        return None  # the null stream
    return stream.handle if isinstance(stream, Stream) else stream


# ---------------------------------------------------------------------------------------------------------
# availability
# ---------------------------------------------------------------------------------------------------------
_INIT: bool | None = None


def _init() -> bool:
    global _INIT
    if _INIT is None:
        try:
            # Without libamdhip64 hip-python raises RuntimeError from its lazy dlopen: that means "no AMD".
            _INIT = hip is not None and int(hip.hipInit(0)[0]) == 0
        except Exception:
            _INIT = False
    return _INIT


def available() -> bool:
    """True when libamdhip64 loads and reports at least one device. Never raises."""
    try:
        return device_count() > 0
    except Exception:
        return False


def device_count() -> int:
    if not _init():
        return 0
    try:
        err, n = hip.hipGetDeviceCount()
        return int(n) if int(err) == 0 else 0
    except Exception:
        return 0


# ---------------------------------------------------------------------------------------------------------
# hiprtc
# ---------------------------------------------------------------------------------------------------------
def hiprtc_id() -> str:
    major, minor = check(hiprtc.hiprtcVersion(), "hiprtcVersion")
    return f"hiprtc-{major}.{minor}"


def hiprtc_options(arch: str, directory, defines: dict | None = None, options: list[str] | None = None) -> list[str]:
    opts = [f"--offload-arch={arch}", "-std=c++17", "-O3"]
    for d in ([directory] if directory else []) + compiler.include_dirs():
        opts.append(f"-I{d}")
    opts += compiler.define_options(defines)
    opts += list(options or [])
    return opts


def hiprtc_compile(text: str, name: str, opts: list[str]) -> tuple[bytes, str]:
    """Source text -> code object (ELF for the --offload-arch). DeviceError with the log on failure."""
    prog = check(hiprtc.hiprtcCreateProgram(text.encode(), name.encode(), 0, None, None), "hiprtcCreateProgram")
    try:
        bopts = [o.encode() for o in opts]
        res = hiprtc.hiprtcCompileProgram(prog, len(bopts), bopts)
        size = int(check(hiprtc.hiprtcGetProgramLogSize(prog), "hiprtcGetProgramLogSize"))
        log = ""
        if size > 1:
            buf = bytearray(size)
            check(hiprtc.hiprtcGetProgramLog(prog, buf), "hiprtcGetProgramLog")
            log = bytes(buf).rstrip(b"\x00").decode(errors="replace").strip()
        if int(res[0]) != 0:
            raise DeviceError(f"hiprtc failed to compile {name} ({res[0].name}):\n{compiler.first_lines(log)}")
        size = int(check(hiprtc.hiprtcGetCodeSize(prog), "hiprtcGetCodeSize"))
        code = bytearray(size)
        check(hiprtc.hiprtcGetCode(prog, code), "hiprtcGetCode")
        return bytes(code), log
    finally:
        hiprtc.hiprtcDestroyProgram(prog)


# ---------------------------------------------------------------------------------------------------------
# handles
# ---------------------------------------------------------------------------------------------------------
class Function:
    def __init__(self, rt: "HipRuntime", handle, name: str):
        self.rt, self.handle, self.name = rt, handle, name

    def attribute(self, attr: str) -> int:
        """``attr`` is the suffix of a hipFunction_attribute, e.g. "NUM_REGS", "MAX_THREADS_PER_BLOCK"."""
        self.rt._current()
        enum = getattr(hip.hipFunction_attribute, f"HIP_FUNC_ATTRIBUTE_{attr}")
        return int(check(hip.hipFuncGetAttribute(enum, self.handle), f"hipFuncGetAttribute({attr}, {self.name})"))

    @property
    def num_regs(self) -> int:
        return self.attribute("NUM_REGS")

    @property
    def max_threads_per_block(self) -> int:
        return self.attribute("MAX_THREADS_PER_BLOCK")

    @property
    def static_shared(self) -> int:
        return self.attribute("SHARED_SIZE_BYTES")

    def set_max_dynamic_shared(self, nbytes: int) -> None:
        # AMD has no opt-in step: any block may use up to the device's LDS size (64 KiB on CDNA3).
        if nbytes > self.rt.max_shared_per_block:
            raise DeviceError(f"{self.name}: {nbytes} bytes of dynamic LDS requested, the device has "
                              f"{self.rt.max_shared_per_block}")

    def prefer_carveout(self, percent: int) -> None:
        """Nothing to prefer: a CU's LDS is its own storage, not carved out of its L1 (CUDA's Function has the knob)."""

    def __repr__(self):
        return f"<hip Function {self.name}>"


class Module:
    def __init__(self, rt: "HipRuntime", handle, name: str, binary: bytes, log: str = ""):
        self.rt, self.handle, self.name, self.binary, self.log = rt, handle, name, binary, log
        self._functions: dict[str, Function] = {}

    def function(self, name: str) -> Function:
        fn = self._functions.get(name)
        if fn is None:
            self.rt._current()
            h = check(hip.hipModuleGetFunction(self.handle, name.encode()), f"hipModuleGetFunction({name!r} in {self.name})")
            fn = self._functions[name] = Function(self.rt, h, name)
        return fn

    __getitem__ = function


class Stream:
    def __init__(self, rt: "HipRuntime", handle):
        self.rt, self.handle = rt, handle

    def synchronize(self) -> None:
        self.rt._current()
        check(hip.hipStreamSynchronize(self.handle), "hipStreamSynchronize")

    def destroy(self) -> None:
        if self.handle is not None:
            self.rt._current()
            check(hip.hipStreamDestroy(self.handle), "hipStreamDestroy")
            self.handle = None


class Event:
    def __init__(self, rt: "HipRuntime", handle):
        self.rt, self.handle = rt, handle

    def record(self, stream=None) -> "Event":
        self.rt._current()
        check(hip.hipEventRecord(self.handle, _stream(stream)), "hipEventRecord")
        return self

    def synchronize(self) -> None:
        self.rt._current()
        check(hip.hipEventSynchronize(self.handle), "hipEventSynchronize")

    def query(self) -> bool:
        self.rt._current()
        err = hip.hipEventQuery(self.handle)[0]
        if err == hip.hipError_t.hipErrorNotReady:
            return False
        check((err,), "hipEventQuery")
        return True

    def elapsed_ms(self, end: "Event") -> float:
        end.synchronize()
        return float(check(hip.hipEventElapsedTime(self.handle, end.handle), "hipEventElapsedTime"))

    def destroy(self) -> None:
        if self.handle is not None:
            self.rt._current()
            check(hip.hipEventDestroy(self.handle), "hipEventDestroy")
            self.handle = None


class GraphExec:
    def __init__(self, rt: "HipRuntime", graph, exec_):
        self.rt, self.graph, self.exec = rt, graph, exec_

    def launch(self, stream=None) -> None:
        self.rt._current()
        check(hip.hipGraphLaunch(self.exec, _stream(stream)), "hipGraphLaunch")

    def destroy(self) -> None:
        if self.exec is not None:
            self.rt._current()
            check(hip.hipGraphExecDestroy(self.exec), "hipGraphExecDestroy")
            check(hip.hipGraphDestroy(self.graph), "hipGraphDestroy")
            self.exec = self.graph = None


# ---------------------------------------------------------------------------------------------------------
# runtime
# ---------------------------------------------------------------------------------------------------------
class HipRuntime(Runtime):
    vendor = "amd"

    def __init__(self, index: int):
        if not _init():
            raise DeviceError("the HIP runtime (libamdhip64) could not be initialised")
        self.device_index = index
        self._current()
        props = check(hip.hipGetDeviceProperties(index), f"hipGetDeviceProperties({index})")
        arch = props.gcnArchName
        arch = arch.decode() if isinstance(arch, bytes) else str(arch)
        # "gfx942:sramecc+:xnack-" -> "gfx942": features are the loader's business, not the compile target's.
        self.arch = arch.split("\x00", 1)[0].split(":", 1)[0].strip()
        name = props.name
        self.name = (name.decode(errors="replace") if isinstance(name, bytes) else str(name)).split("\x00", 1)[0].strip()
        self.num_sms = int(props.multiProcessorCount)
        self.warp_size = int(props.warpSize)
        self.max_shared_per_block = int(props.sharedMemPerBlockOptin or props.sharedMemPerBlock)
        self.l2_bytes = int(props.l2CacheSize)
        if self.l2_bytes == 0:  # some ROCm versions leave the struct field 0; the attribute query is reliable
            self.l2_bytes = int(check(hip.hipDeviceGetAttribute(hip.hipDeviceAttribute_t.hipDeviceAttributeL2CacheSize,
                                                                index), "hipDeviceGetAttribute(L2CacheSize)"))
        self.total_mem = int(props.totalGlobalMem)
        self.cooperative_launch = bool(props.cooperativeLaunch)
        self._modules: dict[str, Module] = {}

    def __repr__(self):
        return f"<HipRuntime {self.device_index}: {self.name} {self.arch}, {self.num_sms} CUs>"

    def _current(self) -> None:
        check(hip.hipSetDevice(self.device_index), f"hipSetDevice({self.device_index})")

    # ---- code -------------------------------------------------------------
    def compile(self, source, *, defines=None, options=None) -> Module:
        path, text = compiler.resolve_source(source)
        directory = path.parent if path else None
        name = path.name if path else "inline.hip"
        opts = hiprtc_options(self.arch, directory, defines, options)
        key_opts = [o for o in opts if not o.startswith("-I")]
        rtc = hiprtc_id()
        memo = compiler.cache_key(text, directory, self.arch, key_opts, rtc)
        if memo in self._modules:
            return self._modules[memo]
        log_box = [""]

        def build() -> bytes:
            code, log_box[0] = hiprtc_compile(text, name, opts)
            return code

        code = compiler.cached_build(text, directory, self.arch, key_opts, rtc, build, ".co")
        self._current()
        handle = check(hip.hipModuleLoadData(code), f"hipModuleLoadData({name})")
        mod = self._modules[memo] = Module(self, handle, name, code, log_box[0])
        compiler.show_warnings(name, log_box[0], "hiprtc")
        return mod

    # ---- memory -----------------------------------------------------------
    def malloc(self, nbytes: int) -> DeviceBuffer:
        self._current()
        try:
            ptr = check(hip.hipMalloc(max(int(nbytes), 1)), f"hipMalloc({nbytes})")
        except DeviceError as e:
            free, total = self.mem_info()
            raise DeviceError(f"{e}; GPU {self.device_index} has {free / 2**30:.2f} of {total / 2**30:.2f} GiB free") from None
        return DeviceBuffer(_addr(ptr), int(nbytes), self)

    def malloc_fine_grained(self, nbytes: int) -> DeviceBuffer:
        # Coarse-grained VRAM (hipMalloc) is only coherent at kernel boundaries; flags polled by peer GPUs
        # while this one writes must be fine-grained so system-scope atomics reach them without a cache flush.
        self._current()
        ptr = check(hip.hipExtMallocWithFlags(max(int(nbytes), 1), hip.hipDeviceMallocFinegrained),
                    f"hipExtMallocWithFlags({nbytes}, hipDeviceMallocFinegrained)")
        return DeviceBuffer(_addr(ptr), int(nbytes), self, fine_grained=True)

    def host_alloc_mapped(self, nbytes: int) -> HostBuffer:
        self._current()
        flags = hip.hipHostMallocMapped | hip.hipHostMallocPortable
        hptr = _addr(check(hip.hipHostMalloc(max(int(nbytes), 1), flags), f"hipHostMalloc({nbytes})"))
        dptr = _addr(check(hip.hipHostGetDevicePointer(hptr, 0), "hipHostGetDevicePointer"))
        array = np.ctypeslib.as_array((ctypes.c_uint8 * max(int(nbytes), 1)).from_address(hptr))[:nbytes]
        return HostBuffer(array, dptr, self, hptr)

    def copy_htod(self, dst, src: np.ndarray, stream=None) -> None:
        src = np.ascontiguousarray(src)
        self._current()
        if stream is None:
            check(hip.hipMemcpyHtoD(_ptr(dst), src.ctypes.data, src.nbytes), "hipMemcpyHtoD")
        else:
            check(hip.hipMemcpyHtoDAsync(_ptr(dst), src.ctypes.data, src.nbytes, _stream(stream)), "hipMemcpyHtoDAsync")

    def copy_dtoh(self, dst: np.ndarray, src, stream=None) -> None:
        if not dst.flags.c_contiguous:
            raise DeviceError("copy_dtoh needs a C-contiguous destination array")
        self._current()
        if stream is None:
            # Our streams are non-blocking: synchronise first so a plain download sees every earlier launch.
            check(hip.hipDeviceSynchronize(), "hipDeviceSynchronize")
            check(hip.hipMemcpyDtoH(dst.ctypes.data, _ptr(src), dst.nbytes), "hipMemcpyDtoH")
        else:
            check(hip.hipMemcpyDtoHAsync(dst.ctypes.data, _ptr(src), dst.nbytes, _stream(stream)), "hipMemcpyDtoHAsync")

    def copy_dtod(self, dst, src, nbytes: int, stream=None) -> None:
        self._current()
        check(hip.hipMemcpyDtoDAsync(_ptr(dst), _ptr(src), int(nbytes), _stream(stream)), "hipMemcpyDtoDAsync")
        if stream is None:
            check(hip.hipStreamSynchronize(None), "hipStreamSynchronize")

    def memset(self, dst, byte: int, nbytes: int, stream=None) -> None:
        self._current()
        check(hip.hipMemsetD8Async(_ptr(dst), int(byte) & 0xFF, int(nbytes), _stream(stream)), "hipMemsetD8Async")
        if stream is None:
            check(hip.hipStreamSynchronize(None), "hipStreamSynchronize")

    def mem_info(self) -> tuple[int, int]:
        self._current()
        free, total = check(hip.hipMemGetInfo(), "hipMemGetInfo")
        return int(free), int(total)

    def _free(self, buf: DeviceBuffer) -> None:
        self._current()
        check(hip.hipFree(buf.ptr), "hipFree")

    def _free_host(self, buf: HostBuffer) -> None:
        self._current()
        check(hip.hipHostFree(buf.hptr), "hipHostFree")

    # ---- execution --------------------------------------------------------
    def launch(self, fn: Function, grid, block, args: list, shared: int = 0, stream=None,
               cooperative: bool = False, pdl: bool = False) -> None:
        # pdl: HIP has no programmatic dependent launch (pdl_launch stays False): stream order, as always.
        self._current()
        gx, gy, gz = _dims(grid)
        bx, by, bz = _dims(block)
        if shared:
            fn.set_max_dynamic_shared(shared)
        params, keep = kernel_params(args)
        params = params or None
        if cooperative:
            res = hip.hipModuleLaunchCooperativeKernel(fn.handle, gx, gy, gz, bx, by, bz, int(shared),
                                                       _stream(stream), params)
            what = "hipModuleLaunchCooperativeKernel"
        else:
            res = hip.hipModuleLaunchKernel(fn.handle, gx, gy, gz, bx, by, bz, int(shared), _stream(stream),
                                            params, None)
            what = "hipModuleLaunchKernel"
        del keep  # argument values are copied into the dispatch packet during the call
        check(res, f"{what}({fn.name}, grid={(gx, gy, gz)}, block={(bx, by, bz)}, shared={shared})")

    def max_active_blocks(self, fn: Function, block: int, shared: int = 0) -> int:
        self._current()
        return int(check(hip.hipModuleOccupancyMaxActiveBlocksPerMultiprocessor(fn.handle, int(block), int(shared)),
                         f"hipModuleOccupancyMaxActiveBlocksPerMultiprocessor({fn.name})"))

    def stream(self) -> Stream:
        self._current()
        return Stream(self, check(hip.hipStreamCreateWithFlags(hip.hipStreamNonBlocking), "hipStreamCreateWithFlags"))

    def event(self) -> Event:
        self._current()
        return Event(self, check(hip.hipEventCreate(), "hipEventCreate"))

    def synchronize(self) -> None:
        self._current()
        check(hip.hipDeviceSynchronize(), "hipDeviceSynchronize")

    def begin_capture(self, stream) -> None:
        if stream is None:
            raise DeviceError("graph capture needs a created stream (rt.stream()), not the null stream")
        self._current()
        check(hip.hipStreamBeginCapture(_stream(stream), hip.hipStreamCaptureMode.hipStreamCaptureModeThreadLocal),
              "hipStreamBeginCapture")

    def end_capture(self, stream) -> GraphExec:
        self._current()
        graph = check(hip.hipStreamEndCapture(_stream(stream)), "hipStreamEndCapture")
        exec_ = check(hip.hipGraphInstantiateWithFlags(graph, 0), "hipGraphInstantiateWithFlags")
        return GraphExec(self, graph, exec_)

    # ---- peers ------------------------------------------------------------
    def can_access_peer(self, other: Runtime) -> bool:
        if other is self:
            return True
        return bool(check(hip.hipDeviceCanAccessPeer(self.device_index, other.device_index), "hipDeviceCanAccessPeer"))

    def enable_peer_access(self, other: Runtime) -> None:
        """Let kernels on this device dereference ``other``'s memory (one direction; call both ways)."""
        if other is self:
            return
        self._current()
        err = hip.hipDeviceEnablePeerAccess(other.device_index, 0)[0]
        if err == hip.hipError_t.hipErrorPeerAccessAlreadyEnabled:
            return
        check((err,), f"hipDeviceEnablePeerAccess(GPU {self.device_index} -> GPU {other.device_index})")


def create_runtime(index: int) -> HipRuntime:
    return HipRuntime(index)
