"""Contract between our GPU backends and the vendor Python bindings, checked without any GPU.

No AMD GPU is available, so backend_hip.py cannot be exercised at run time. Instead this test reads the
backend's source (AST), finds every ``hip.X(...)`` / ``hiprtc.X(...)`` call and every ``hip.A.B`` constant, and
checks against the installed hip-python that
  * the function / constant exists (a misspelt name fails here, not on the first MI300X run),
  * the call passes exactly as many arguments as the Cython signature takes (arity drift fails),
  * where the result of ``check(...)`` is unpacked, the number of targets matches the size of the tuple the
    binding documents as returned ("A tuple of size N").
The same checks run for backend_cuda.py against cuda-bindings (whose Returns section lists each value).
"""
import ast
import inspect
import re
from pathlib import Path

import pytest

GPU_DIR = Path(__file__).resolve().parents[1] / "hipengine" / "gpu"

# Wrappers that pass a value through unchanged (so `n = int(check(hip.f()))` still unpacks one value).
_PASSTHROUGH = {"int", "float", "bool", "_addr"}


def _attr_chain(node):
    """hip.hipFoo.bar -> ["hip", "hipFoo", "bar"]; None if the chain does not start at a plain name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id] + parts[::-1]
    return None


def _vendor_calls(tree, modules):
    """[(lineno, module alias, function name, n positional args, Call node)] for calls into the bindings."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            chain = _attr_chain(node.func)
            if chain and len(chain) == 2 and chain[0] in modules:
                assert not node.keywords, f"line {node.lineno}: keyword args to {chain[1]} (pass positionally)"
                assert not any(isinstance(a, ast.Starred) for a in node.args), f"line {node.lineno}: *args"
                out.append((node.lineno, chain[0], chain[1], len(node.args), node))
    return out


def _vendor_constants(tree, modules):
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "_parent_call", None), ast.Call):
            chain = _attr_chain(node)
            if chain and chain[0] in modules and len(chain) >= 2:
                out.append((node.lineno, chain))
    return out


def _unpacked_results(tree, modules):
    """[(lineno, function name, number of values the code expects)] for ``x = check(mod.f(...), ...)`` and
    ``a, b = check(...)`` assignments (``check`` strips the error code; one name = one value)."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        value = node.value
        while isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in _PASSTHROUGH:
            value = value.args[0]
        if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "check"):
            continue
        inner = value.args[0]
        if not isinstance(inner, ast.Call):
            continue
        chain = _attr_chain(inner.func)
        if not (chain and len(chain) == 2 and chain[0] in modules):
            continue
        target = node.targets[0]
        n = len(target.elts) if isinstance(target, ast.Tuple) else 1
        out.append((node.lineno, chain[1], n))
    return out


def _hip_returned_values(fn) -> int | None:
    m = re.search(r"tuple` of size (\d+)", fn.__doc__ or "")
    return int(m.group(1)) - 1 if m else None  # minus the error code


def _cuda_returned_values(fn) -> int | None:
    doc = fn.__doc__ or ""
    m = re.search(r"\nReturns\n-------\n(.*?)(?:\n\nSee Also|\n\nNotes|\Z)", doc, re.S)
    if not m:
        return None
    names = [ln for ln in m.group(1).splitlines() if ln.strip() and not ln[0].isspace()]
    return len(names) - 1 if names else None


def _check_backend(path: Path, modules: dict, returned_values) -> list[str]:
    tree = ast.parse(path.read_text())
    problems = []
    calls = _vendor_calls(tree, modules)
    assert calls, f"no vendor calls found in {path.name}: the AST walk is broken"
    for line, alias, name, nargs, _ in calls:
        fn = getattr(modules[alias], name, None)
        if fn is None:
            problems.append(f"{path.name}:{line}: {alias}.{name} does not exist")
            continue
        if isinstance(fn, type):
            continue  # a handle/enum constructor (cu.CUstream(0)), not a binding call
        params = list(inspect.signature(fn).parameters.values())
        required = sum(1 for p in params if p.default is inspect.Parameter.empty)
        if not required <= nargs <= len(params):
            problems.append(f"{path.name}:{line}: {alias}.{name} takes {required}..{len(params)} args "
                            f"({', '.join(p.name for p in params)}), called with {nargs}")
    called = {(alias, name) for _, alias, name, _, _ in calls}
    for line, chain in _vendor_constants(tree, modules):
        if tuple(chain[:2]) in called and len(chain) == 2:
            continue
        obj = modules[chain[0]]
        for part in chain[1:]:
            obj = getattr(obj, part, None)
            if obj is None:
                problems.append(f"{path.name}:{line}: {'.'.join(chain)} does not exist")
                break
    for line, name, n in _unpacked_results(tree, modules):
        fn = next((getattr(m, name) for m in modules.values() if hasattr(m, name)), None)
        expect = returned_values(fn) if fn else None
        if expect is not None and expect != n:
            problems.append(f"{path.name}:{line}: {name} returns {expect} value(s) after the error code, "
                            f"code unpacks {n}")
    return problems


def test_hip_backend_matches_hip_python():
    hip_mod = pytest.importorskip("hip")
    from hip import hip, hiprtc  # noqa: F401

    problems = _check_backend(GPU_DIR / "backend_hip.py", {"hip": hip, "hiprtc": hiprtc}, _hip_returned_values)
    assert not problems, "\n".join(problems)
    # Names built at run time with an f-string.
    for attr in ("NUM_REGS", "MAX_THREADS_PER_BLOCK", "SHARED_SIZE_BYTES"):
        assert hasattr(hip.hipFunction_attribute, f"HIP_FUNC_ATTRIBUTE_{attr}")
    for field in ("gcnArchName", "name", "multiProcessorCount", "warpSize", "sharedMemPerBlockOptin",
                  "sharedMemPerBlock", "l2CacheSize", "totalGlobalMem", "cooperativeLaunch"):
        assert hasattr(hip.hipDeviceProp_t, field), field
    del hip_mod


def test_cuda_backend_matches_cuda_bindings():
    pytest.importorskip("cuda.bindings")
    from cuda.bindings import driver, nvrtc

    problems = _check_backend(GPU_DIR / "backend_cuda.py", {"cu": driver, "nvrtc": nvrtc}, _cuda_returned_values)
    assert not problems, "\n".join(problems)
    for attr in ("NUM_REGS", "MAX_THREADS_PER_BLOCK", "SHARED_SIZE_BYTES", "MAX_DYNAMIC_SHARED_SIZE_BYTES"):
        assert hasattr(driver.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{attr}")
    for attr in ("COMPUTE_CAPABILITY_MAJOR", "COMPUTE_CAPABILITY_MINOR", "MULTIPROCESSOR_COUNT",
                 "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", "L2_CACHE_SIZE", "WARP_SIZE", "COOPERATIVE_LAUNCH"):
        assert hasattr(driver.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{attr}")


def test_contract_checker_catches_drift(tmp_path):
    """The checker itself must fail on a misspelt name, a wrong arity and a wrong unpack."""
    pytest.importorskip("hip")
    from hip import hip, hiprtc

    bad = tmp_path / "backend_bad.py"
    bad.write_text(
        "def f():\n"
        "    hip.hipMallocc(4)\n"                      # misspelt
        "    hip.hipMemcpyHtoD(1, 2)\n"                # arity: needs 3
        "    a, b = check(hip.hipMalloc(4), 'x')\n"    # returns one value
        "    x = hip.hipStreamCaptureMode.nope\n"      # missing enum member
    )
    problems = _check_backend(bad, {"hip": hip, "hiprtc": hiprtc}, _hip_returned_values)
    text = "\n".join(problems)
    assert "hipMallocc does not exist" in text
    assert "hipMemcpyHtoD takes 3..3 args" in text
    assert "hipMalloc returns 1 value(s)" in text
    assert "hipStreamCaptureMode.nope does not exist" in text


# ---------------------------------------------------------------------------------------------------------
# Fake HIP: runs backend_hip's control flow on the CPU. Memory is real host memory (so copies, memsets and
# mapped buffers really move bytes) and the one "kernel" decodes kernelParams exactly as the HIP runtime
# would, which pins down the argument-passing convention that no AMD GPU in CI could otherwise exercise.
# ---------------------------------------------------------------------------------------------------------
class _FakeHip:
    def __init__(self, real):
        self._real = real
        self._mem = {}
        self.launches = []
        self.ok = real.hipError_t.hipSuccess

    def __getattr__(self, name):  # enums and constants come from the real bindings
        return getattr(self._real, name)

    def _alloc(self, n):
        import ctypes

        buf = (ctypes.c_uint8 * n)()
        addr = ctypes.addressof(buf)
        self._mem[addr] = buf
        return addr

    def hipInit(self, flags): return (self.ok,)
    def hipGetDeviceCount(self): return (self.ok, 1)
    def hipSetDevice(self, deviceId): return (self.ok,)

    def hipGetDeviceProperties(self, deviceId):
        from types import SimpleNamespace

        return (self.ok, SimpleNamespace(gcnArchName=b"gfx942:sramecc+:xnack-", name=b"AMD Instinct MI300X",
                                         multiProcessorCount=304, warpSize=64, sharedMemPerBlockOptin=0,
                                         sharedMemPerBlock=65536, l2CacheSize=0, totalGlobalMem=192 << 30,
                                         cooperativeLaunch=1))

    def hipDeviceGetAttribute(self, attr, deviceId): return (self.ok, 4 << 20)
    def hipMalloc(self, size): return (self.ok, self._alloc(size))
    def hipExtMallocWithFlags(self, sizeBytes, flags): return (self.ok, self._alloc(sizeBytes))
    def hipHostMalloc(self, size, flags): return (self.ok, self._alloc(size))
    def hipHostGetDevicePointer(self, hstPtr, flags): return (self.ok, hstPtr)
    def hipFree(self, ptr): self._mem.pop(ptr); return (self.ok,)
    def hipHostFree(self, ptr): self._mem.pop(ptr); return (self.ok,)

    def _copy(self, dst, src, n):
        import ctypes

        ctypes.memmove(dst, src, n)
        return (self.ok,)

    def hipMemcpyHtoD(self, dst, src, sizeBytes): return self._copy(dst, src, sizeBytes)
    def hipMemcpyDtoH(self, dst, src, sizeBytes): return self._copy(dst, src, sizeBytes)
    def hipMemcpyHtoDAsync(self, dst, src, sizeBytes, stream): return self._copy(dst, src, sizeBytes)
    def hipMemcpyDtoHAsync(self, dst, src, sizeBytes, stream): return self._copy(dst, src, sizeBytes)
    def hipMemcpyDtoDAsync(self, dst, src, sizeBytes, stream): return self._copy(dst, src, sizeBytes)

    def hipMemsetD8Async(self, dest, value, count, stream):
        import ctypes

        ctypes.memset(dest, value, count)
        return (self.ok,)

    def hipMemGetInfo(self): return (self.ok, 100 << 30, 192 << 30)
    def hipStreamSynchronize(self, stream): return (self.ok,)
    def hipDeviceSynchronize(self): return (self.ok,)
    def hipModuleLoadData(self, image): return (self.ok, "module")
    def hipModuleGetFunction(self, module, kname): return (self.ok, kname.decode())
    def hipFuncGetAttribute(self, attrib, hfunc): return (self.ok, 42)
    def hipModuleOccupancyMaxActiveBlocksPerMultiprocessor(self, f, blockSize, dynSharedMemPerBlk): return (self.ok, 8)

    def hipModuleLaunchKernel(self, f, gx, gy, gz, bx, by, bz, shared, stream, kernelParams, extra):
        import ctypes

        assert extra is None
        if f == "fill" and kernelParams:  # fill(float* x, float v, int n): x[0:n] = v
            params = (ctypes.c_void_p * 3).from_address(kernelParams)
            x = ctypes.c_void_p.from_address(params[0]).value
            v = ctypes.c_float.from_address(params[1]).value
            n = ctypes.c_int32.from_address(params[2]).value
            (ctypes.c_float * n).from_address(x)[:] = [v] * n
        self.launches.append((f, (gx, gy, gz), (bx, by, bz), shared, stream))
        return (self.ok,)

    def hipModuleLaunchCooperativeKernel(self, f, gx, gy, gz, bx, by, bz, shared, stream, kernelParams):
        return self.hipModuleLaunchKernel(f, gx, gy, gz, bx, by, bz, shared, stream, kernelParams, None)

    def hipStreamCreateWithFlags(self, flags): return (self.ok, "stream")
    def hipStreamDestroy(self, stream): return (self.ok,)
    def hipEventCreate(self): return (self.ok, "event")
    def hipEventRecord(self, event, stream): return (self.ok,)
    def hipEventSynchronize(self, event): return (self.ok,)
    def hipEventQuery(self, event): return (self._real.hipError_t.hipErrorNotReady,)
    def hipEventElapsedTime(self, start, stop): return (self.ok, 1.5)
    def hipEventDestroy(self, event): return (self.ok,)
    def hipStreamBeginCapture(self, stream, mode): return (self.ok,)
    def hipStreamEndCapture(self, stream): return (self.ok, "graph")
    def hipGraphInstantiateWithFlags(self, graph, flags): return (self.ok, "exec")
    def hipGraphLaunch(self, graphExec, stream): return (self.ok,)
    def hipGraphExecDestroy(self, graphExec): return (self.ok,)
    def hipGraphDestroy(self, graph): return (self.ok,)
    def hipDeviceCanAccessPeer(self, deviceId, peerDeviceId): return (self.ok, 1)
    def hipDeviceEnablePeerAccess(self, peerDeviceId, flags): return (self._real.hipError_t.hipErrorPeerAccessAlreadyEnabled,)
    def hipGetErrorString(self, hipError): return (self.ok, b"fake error")


class _FakeHiprtc:
    def __init__(self, real):
        self._real = real
        self.options = None
        self.ok = real.hiprtcResult.HIPRTC_SUCCESS

    def __getattr__(self, name):
        return getattr(self._real, name)

    def hiprtcVersion(self): return (self.ok, 6, 4)
    def hiprtcCreateProgram(self, src, name, numHeaders, headers, includeNames): return (self.ok, "prog")

    def hiprtcCompileProgram(self, prog, numOptions, options):
        assert numOptions == len(options)
        self.options = [o.decode() for o in options]
        return (self.ok,)

    def hiprtcGetProgramLogSize(self, prog): return (self.ok, 1)
    def hiprtcGetProgramLog(self, prog, log): return (self.ok,)
    def hiprtcGetCodeSize(self, prog): return (self.ok, 8)

    def hiprtcGetCode(self, prog, code):
        code[:] = b"\x7fELFcode"
        return (self.ok,)

    def hiprtcDestroyProgram(self, prog): return (self.ok,)


def test_hip_backend_runs_on_fake_hip(monkeypatch, tmp_path):
    import ctypes

    import numpy as np

    pytest.importorskip("hip")
    from hip import hip as real_hip
    from hip import hiprtc as real_hiprtc

    from hipengine.gpu import backend_hip

    fake, fake_rtc = _FakeHip(real_hip), _FakeHiprtc(real_hiprtc)
    # The fake's methods must themselves match the real signatures, or this test would prove nothing.
    for name in dir(fake):
        if name.startswith("hip") and callable(getattr(type(fake), name, None)):
            ours = list(inspect.signature(getattr(fake, name)).parameters)
            assert len(ours) == len(inspect.signature(getattr(real_hip, name)).parameters), name
    monkeypatch.setattr(backend_hip, "hip", fake)
    monkeypatch.setattr(backend_hip, "hiprtc", fake_rtc)
    monkeypatch.setattr(backend_hip, "_INIT", None)
    monkeypatch.setenv("HIPENGINE_CACHE", str(tmp_path))

    assert backend_hip.available() and backend_hip.device_count() == 1
    rt = backend_hip.create_runtime(0)
    assert (rt.arch, rt.warp_size, rt.num_sms, rt.l2_bytes) == ("gfx942", 64, 304, 4 << 20)
    assert rt.max_shared_per_block == 65536 and rt.vendor == "amd"

    mod = rt.compile("__global__ void fill(float* x, float v, int n) {}\n", defines={"N": 4})
    assert "--offload-arch=gfx942" in fake_rtc.options and "-DN=4" in fake_rtc.options
    assert mod.binary == b"\x7fELFcode"
    fn = mod.function("fill")
    assert fn.num_regs == 42 and rt.max_active_blocks(fn, 256) == 8

    x = rt.upload(np.zeros(16, np.float32))
    rt.launch(fn, 1, 64, [x, ctypes.c_float(2.5), ctypes.c_int32(16)])
    np.testing.assert_array_equal(rt.download(x, (16,), np.float32), 2.5)
    rt.launch(fn, (2, 3), (64, 1, 1), [x, ctypes.c_float(-1.0), ctypes.c_int32(8)], cooperative=True)
    np.testing.assert_array_equal(rt.download(x, (16,), np.float32), [-1.0] * 8 + [2.5] * 8)
    assert fake.launches[-1][1:3] == ((2, 3, 1), (64, 1, 1))
    with pytest.raises(backend_hip.DeviceError, match="ctypes scalar"):
        rt.launch(fn, 1, 64, [x, 2.5, 16])

    y = rt.malloc_fine_grained(64)
    assert y.fine_grained
    rt.copy_dtod(y, x, 64)
    rt.memset(x, 0, 64)
    assert rt.download(y, (16,), np.float32)[0] == -1.0 and not rt.download(x, (16,), np.float32).any()
    hb = rt.host_alloc_mapped(32)
    assert hb.array.shape == (32,) and hb.dptr
    hb.free()
    x.free()

    s, e0, e1 = rt.stream(), rt.event(), rt.event()
    e0.record(s)
    e1.record(s)
    assert e0.elapsed_ms(e1) == 1.5 and not e1.query()
    rt.begin_capture(s)
    rt.launch(fn, 1, 64, [], stream=s)
    g = rt.end_capture(s)
    g.launch(s)
    g.destroy()
    assert rt.mem_info() == (100 << 30, 192 << 30)
    rt.enable_peer_access(backend_hip.create_runtime(0))  # "already enabled" is not an error


class _FakeCuda:
    """The CUDA driver on the CPU, same idea as _FakeHip (NVRTC stays real: it needs no GPU)."""

    def __init__(self, real):
        self._real = real
        self._mem = {}
        self.launches = []
        self.ok = real.CUresult.CUDA_SUCCESS
        self.func_attrs = {}

    def __getattr__(self, name):
        return getattr(self._real, name)

    _alloc = _FakeHip._alloc

    def cuInit(self, Flags): return (self.ok,)
    def cuDeviceGetCount(self): return (self.ok, 2)
    def cuDeviceGet(self, ordinal): return (self.ok, ordinal)
    def cuDevicePrimaryCtxRetain(self, dev): return (self.ok, f"ctx{dev}")
    def cuCtxSetCurrent(self, ctx): return (self.ok,)

    def cuDeviceGetAttribute(self, attrib, dev):
        A = self._real.CUdevice_attribute
        table = {A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 9, A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 0,
                 A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: 132, A.CU_DEVICE_ATTRIBUTE_WARP_SIZE: 32,
                 A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: 232448,
                 A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: 60 << 20, A.CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH: 1}
        return (self.ok, table[attrib])

    def cuDeviceTotalMem(self, dev): return (self.ok, 141 << 30)
    def cuDeviceGetName(self, length, dev): return (self.ok, b"NVIDIA H200" + b"\0" * (length - 11))
    def cuMemAlloc(self, bytesize): return (self.ok, self._alloc(bytesize))
    def cuMemFree(self, dptr): self._mem.pop(dptr); return (self.ok,)
    def cuMemHostAlloc(self, bytesize, Flags): return (self.ok, self._alloc(bytesize))
    def cuMemHostGetDevicePointer(self, p, Flags): return (self.ok, p)
    def cuMemFreeHost(self, p): self._mem.pop(p); return (self.ok,)
    _copy = _FakeHip._copy

    def cuMemcpyHtoD(self, dstDevice, srcHost, ByteCount): return self._copy(dstDevice, srcHost, ByteCount)
    def cuMemcpyDtoH(self, dstHost, srcDevice, ByteCount): return self._copy(dstHost, srcDevice, ByteCount)
    def cuMemcpyHtoDAsync(self, dstDevice, srcHost, ByteCount, hStream): return self._copy(dstDevice, srcHost, ByteCount)
    def cuMemcpyDtoHAsync(self, dstHost, srcDevice, ByteCount, hStream): return self._copy(dstHost, srcDevice, ByteCount)
    def cuMemcpyDtoDAsync(self, dstDevice, srcDevice, ByteCount, hStream): return self._copy(dstDevice, srcDevice, ByteCount)

    def cuMemsetD8Async(self, dstDevice, uc, N, hStream):
        import ctypes

        ctypes.memset(dstDevice, uc, N)
        return (self.ok,)

    def cuMemGetInfo(self): return (self.ok, 100 << 30, 141 << 30)
    def cuStreamSynchronize(self, hStream): return (self.ok,)
    def cuCtxSynchronize(self): return (self.ok,)

    def cuModuleLoadData(self, image):
        assert bytes(image[:4]) == b"\x7fELF"  # a real CUBIN from NVRTC
        return (self.ok, "module")

    def cuModuleGetFunction(self, hmod, name): return (self.ok, name.decode())
    def cuFuncGetAttribute(self, attrib, hfunc): return (self.ok, 40)

    def cuFuncSetAttribute(self, hfunc, attrib, value):
        self.func_attrs[(hfunc, attrib)] = value
        return (self.ok,)

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, func, blockSize, dynamicSMemSize): return (self.ok, 6)

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, shared, hStream, kernelParams, extra):
        return _FakeHip.hipModuleLaunchKernel(self, f, gx, gy, gz, bx, by, bz, shared, hStream, kernelParams,
                                              None if extra == 0 else extra)

    def cuLaunchCooperativeKernel(self, f, gx, gy, gz, bx, by, bz, shared, hStream, kernelParams):
        return self.cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shared, hStream, kernelParams, 0)

    def cuLaunchKernelEx(self, config, f, kernelParams, extra):
        self.ex_attrs = [(int(a.id), a.value.programmaticStreamSerializationAllowed)
                         for a in config.attrs[:config.numAttrs]]
        c = config
        return self.cuLaunchKernel(f, c.gridDimX, c.gridDimY, c.gridDimZ, c.blockDimX, c.blockDimY, c.blockDimZ,
                                   c.sharedMemBytes, c.hStream, kernelParams, extra)

    def cuStreamCreate(self, Flags): return (self.ok, self._real.CUstream(0x5EED))
    def cuStreamDestroy(self, hStream): return (self.ok,)
    def cuEventCreate(self, Flags): return (self.ok, "event")
    def cuEventRecord(self, hEvent, hStream): return (self.ok,)
    def cuEventSynchronize(self, hEvent): return (self.ok,)
    def cuEventQuery(self, hEvent): return (self.ok,)
    def cuEventElapsedTime(self, hStart, hEnd): return (self.ok, 0.25)
    def cuEventDestroy(self, hEvent): return (self.ok,)
    def cuStreamBeginCapture(self, hStream, mode): return (self.ok,)
    def cuStreamEndCapture(self, hStream): return (self.ok, "graph")
    def cuGraphInstantiate(self, hGraph, flags): return (self.ok, "exec")
    def cuGraphLaunch(self, hGraphExec, hStream): return (self.ok,)
    def cuGraphExecDestroy(self, hGraphExec): return (self.ok,)
    def cuGraphDestroy(self, hGraph): return (self.ok,)
    def cuDeviceCanAccessPeer(self, dev, peerDev): return (self.ok, 1)
    def cuCtxEnablePeerAccess(self, peerContext, Flags): return (self.ok,)
    def cuGetErrorString(self, error): return (self.ok, b"fake")


def test_cuda_backend_runs_on_fake_driver(monkeypatch, tmp_path):
    import ctypes

    import numpy as np

    pytest.importorskip("cuda.bindings")
    from cuda.bindings import driver as real_cu

    from hipengine.gpu import backend_cuda

    if not backend_cuda.nvrtc_available():
        pytest.skip("NVRTC not installed")
    fake = _FakeCuda(real_cu)
    for name in dir(fake):
        if name.startswith("cu") and callable(getattr(type(fake), name, None)):
            ours = list(inspect.signature(getattr(fake, name)).parameters)
            assert len(ours) == len(inspect.signature(getattr(real_cu, name)).parameters), name
    monkeypatch.setattr(backend_cuda, "cu", fake)
    monkeypatch.setattr(backend_cuda, "_INIT", None)
    monkeypatch.setenv("HIPENGINE_CACHE", str(tmp_path))

    assert backend_cuda.available() and backend_cuda.device_count() == 2
    rt, rt1 = backend_cuda.create_runtime(0), backend_cuda.create_runtime(1)
    assert (rt.arch, rt.name, rt.num_sms, rt.warp_size) == ("sm_90", "NVIDIA H200", 132, 32)
    src = '#include "port.h"\nHE_KERNEL(256) fill(float* x, float v, int n) { if (he_thread_idx() < n) x[he_thread_idx()] = v; }\n'
    mod = rt.compile(src)
    assert rt.compile(src) is mod
    fn = mod.function("fill")
    x = rt.upload(np.zeros(16, np.float32))
    rt.launch(fn, 1, 64, [x, ctypes.c_float(3.0), ctypes.c_int32(16)], shared=100_000)
    np.testing.assert_array_equal(rt.download(x, (16,), np.float32), 3.0)
    attr = real_cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    assert fake.func_attrs[("fill", attr)] == 100_000  # > 48 KiB opted in automatically
    rt.launch(fn, 1, 64, [x, ctypes.c_float(1.0), ctypes.c_int32(4)], cooperative=True, stream=rt.stream())
    assert rt.download(x, (16,), np.float32)[:5].tolist() == [1, 1, 1, 1, 3]
    assert rt.pdl_launch  # sm_90: programmatic dependent launch through cuLaunchKernelEx
    rt.launch(fn, 1, 64, [x, ctypes.c_float(2.0), ctypes.c_int32(2)], stream=rt.stream(), pdl=True)
    assert rt.download(x, (16,), np.float32)[:3].tolist() == [2, 2, 1]
    pss = int(real_cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    assert fake.ex_attrs == [(pss, 1)]
    hb = rt.host_alloc_mapped(8)
    hb.array[:] = 5
    rt.copy_dtoh(out := np.zeros(8, np.uint8), hb.dptr)
    assert (out == 5).all()
    s = rt.stream()
    e0, e1 = rt.event().record(s), rt.event().record(s)
    assert e0.elapsed_ms(e1) == 0.25 and e1.query()
    rt.begin_capture(s)
    g = rt.end_capture(s)
    g.launch(s)
    g.destroy()
    assert rt.max_active_blocks(fn, 256) == 6 and fn.num_regs == 40
    assert rt.can_access_peer(rt1)
    rt.enable_peer_access(rt1)
    with pytest.raises(backend_cuda.DeviceError, match="graph capture needs"):
        rt.begin_capture(None)
