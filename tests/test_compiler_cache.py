"""Compile cache: the key follows the source and every local header it includes, and a hit skips the build."""
import pytest

from hipengine.errors import DeviceError
from hipengine.gpu import backend_cuda, compiler


def test_hash_follows_transitive_includes(tmp_path):
    (tmp_path / "a.h").write_text('#include "b.h"\n')
    (tmp_path / "b.h").write_text("#define X 1\n")
    src = '#include "a.h"\n__global__ void k() {}\n'
    h1 = compiler.source_hash(src, tmp_path)
    assert [p.name for p in compiler.local_includes(src, tmp_path)] == ["a.h", "b.h"]
    (tmp_path / "b.h").write_text("#define X 2\n")
    assert compiler.source_hash(src, tmp_path) != h1
    # A missing header does not break hashing (the compiler reports it).
    assert compiler.source_hash('#include "nope.h"\n', tmp_path)


def test_cached_build_hits_and_separates_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("HIPENGINE_CACHE", str(tmp_path / "cache"))
    calls = []

    def build():
        calls.append(1)
        return b"binary"

    args = ("__global__ void k() {}\n", None, "sm_90")
    assert compiler.cached_build(*args, ["-DA=1"], "c1", build) == b"binary"
    assert compiler.cached_build(*args, ["-DA=1"], "c1", build) == b"binary"
    assert len(calls) == 1
    compiler.cached_build(*args, ["-DA=2"], "c1", build)  # other options
    compiler.cached_build(*args, ["-DA=1"], "c2", build)  # other compiler
    assert len(calls) == 3
    assert list((tmp_path / "cache" / "sm_90").glob(".tmp-*")) == []


def test_define_options_sorted_and_validated():
    assert compiler.define_options({"Z": 1, "A": True, "F": None}) == ["-DA=1", "-DF", "-DZ=1"]
    with pytest.raises(DeviceError):
        compiler.define_options({"bad name": 1})


def test_resolve_source(tmp_path):
    assert compiler.resolve_source("__global__ void k() {}\n") == (None, "__global__ void k() {}\n")
    with pytest.raises(DeviceError, match="not found"):
        compiler.resolve_source("ops/does_not_exist.hip")


@pytest.mark.skipif(not backend_cuda.nvrtc_available(), reason="NVRTC not installed")
def test_nvrtc_cubin_and_error_log():
    opts = backend_cuda.nvrtc_options("sm_90", None, {"V": 2})
    cubin, _ = backend_cuda.nvrtc_compile("__global__ void k(float* x) { x[threadIdx.x] = V; }\n", "k.hip", opts)
    assert cubin[:4] == b"\x7fELF"  # real SASS, no PTX JIT at load time
    with pytest.raises(DeviceError, match="undefined_thing"):
        backend_cuda.nvrtc_compile("__global__ void k() { undefined_thing(); }\n", "bad.hip", opts)


def test_cuda_backend_absent_is_quiet():
    # On this CPU machine there is no libcuda: available() must say False, never raise.
    assert backend_cuda.available() in (True, False)
    assert backend_cuda.device_count() >= 0


def test_probe_without_gpu_is_a_clear_error(monkeypatch):
    from hipengine.bench import probe
    from hipengine.gpu import runtime

    monkeypatch.setattr(runtime, "device_count", lambda: 0)
    monkeypatch.setattr(runtime, "backend_name", lambda: None)
    with pytest.raises(DeviceError, match="no GPU"):
        probe.probe(log=lambda *_: None)


def test_bench_git_commit():
    from hipengine.bench import git_commit

    c = git_commit()
    assert c == "unknown" or len(c) == 40
