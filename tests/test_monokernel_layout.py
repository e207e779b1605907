"""The monokernel's parameter block cannot drift between C and Python (no GPU needed).

* decode.hip contains exactly the C text generated from the Python tables (hipengine/gpu/monokernel.py);
* a host compiler (clang++-19 / g++) compiles that text with its static_asserts: sizeof and every offset
  computed by ctypes hold in C too (NVRTC lacks __builtin_offsetof; on the GPU the backend also asks the
  compiled kernel for its offsets, see MonokernelBackend._check_layout);
* sync.h's status codes are the ones the host decodes.
"""
import re
import shutil
import subprocess

import pytest

from hipengine.gpu import monokernel as mk
from hipengine.gpu.runtime import KERNELS_DIR


def test_decode_hip_contains_generated_layout():
    text = (KERNELS_DIR / mk.SOURCE).read_text()
    assert mk.source_layout_block(text) == mk.c_layout_text(), \
        "decode.hip's layout block is stale: run python -c 'from hipengine.gpu.monokernel import write_layout; write_layout()'"


def test_ctypes_layout_is_natural():
    import ctypes

    assert ctypes.sizeof(mk.MkParams) % 8 == 0 and mk.MkParams.layers.offset == 0
    assert len(mk.layout_expected()) == 3 + len(mk.LAYER_FIELDS) + len(mk.STATE_FIELDS) + len(mk.PARAM_FIELDS)


@pytest.mark.parametrize("cxx", ["clang++-19", "clang++", "g++"])
def test_layout_static_asserts_hold_in_c(cxx, tmp_path):
    exe = shutil.which(cxx)
    if exe is None:
        pytest.skip(f"{cxx} not installed")
    gen = mk.c_layout_text()
    kernel = gen.index('extern "C" __global__')  # the device-only layout kernel is not host C++
    body = gen[:kernel] + gen[gen.index("// END GENERATED"):]
    if "clang" not in cxx:
        body = body.replace("#if defined(__clang__)", "#if 1")  # g++ has __builtin_offsetof too
    probe = tmp_path / "probe.cc"
    probe.write_text("typedef unsigned char he_u8; typedef unsigned short he_u16; typedef he_u16 he_bf16; typedef he_u16 he_kv; typedef int he_i32;\n"
                     "typedef unsigned int he_u32; typedef unsigned long long he_u64; typedef long long he_i64;\n" + body +
                     "int main() { return 0; }\n")
    r = subprocess.run([exe, "-std=c++17", "-fsyntax-only", str(probe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_status_codes_match_sync_h():
    text = (KERNELS_DIR / "sync.h").read_text()
    codes = {int(v): k for k, v in re.findall(r"constexpr he_u32 kStatus(\w+) = (\d+);", text)}
    assert sorted(codes) == sorted(mk.MK_STATUS)
    assert codes[0] == "Running" and codes[1] == "Done"
