"""Portability rules for the kernels (CPU only): port.h is the only vendor switch.

* no vendor `#if` (HE_AMD, __AMDGCN__, __CUDA_ARCH__, __HIP_PLATFORM_*, ...) in any kernel file but port.h;
* op code uses kWarpSize and port.h's shuffles: no literal 32 (outside a named constexpr), no 0xffffffff
  mask, no warpSize / __shfl* / threadIdx-style builtins (the header-less gfx942 build has none of them).
"""
import re
from pathlib import Path

import pytest

KDIR = Path(__file__).resolve().parents[1] / "kernels_hip"
VENDOR = re.compile(r"^\s*#\s*(if|ifdef|ifndef|elif)\b.*\b(HE_AMD|HE_NVIDIA|__AMDGCN\w*|__CUDA\w*|__HIP\w*|"
                    r"__NVCC__|__gfx\w+|__HIPCC\w*)")
BANNED_IN_OPS = [
    (re.compile(r"(?<![\w.])32(?![\w.])"), "literal 32 (use kWarpSize or a named constexpr)"),
    (re.compile(r"0x[fF]{8}\b"), "full-warp mask literal (port.h owns it)"),
    (re.compile(r"\bwarpSize\b"), "warpSize (use kWarpSize)"),
    (re.compile(r"\b__shfl\w*"), "vendor shuffle (use he_shfl_*)"),
    (re.compile(r"\b(threadIdx|blockIdx|blockDim|gridDim)\b"), "vendor index builtin (use he_thread_idx() & co)"),
    (re.compile(r"\b__syncthreads\b"), "__syncthreads (use he_sync_block)"),
]


def _code(text: str) -> str:
    """Source without comments (so prose may say '32 lanes')."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _kernel_files():
    return sorted(p for p in KDIR.rglob("*") if p.suffix in (".hip", ".h", ".cuh") and p.name != "port.h")


def test_port_header_exists():
    assert (KDIR / "port.h").is_file()


@pytest.mark.parametrize("path", _kernel_files(), ids=lambda p: str(p.relative_to(KDIR)))
def test_no_vendor_conditionals(path):
    bad = [ln for ln in _code(path.read_text()).splitlines() if VENDOR.search(ln)]
    assert not bad, f"{path.name}: vendor #if outside port.h: {bad[:3]}"


OP_FILES = sorted((KDIR / "ops").glob("*.hip"))


@pytest.mark.parametrize("path", OP_FILES, ids=lambda p: p.name)
def test_ops_are_warp_width_agnostic(path):
    problems = []
    for i, line in enumerate(_code(path.read_text()).splitlines(), 1):
        if re.match(r"\s*constexpr\b", line):  # a named constant may carry its literal value
            continue
        for rx, why in BANNED_IN_OPS:
            if rx.search(line):
                problems.append(f"line {i}: {why}: {line.strip()}")
    assert not problems, f"{path.name}:\n" + "\n".join(problems[:5])


def _kernel_bodies(code: str):
    """(name, body) of every HE_KERNEL / HE_KERNEL_MIN in `code` (comments stripped; macro kernels included)."""
    for m in re.finditer(r"HE_KERNEL(?:_MIN)?\([^)]*\)[\s\\]*([\w#]+)\s*\(", code):
        i = code.index("{", m.end())
        depth, j = 1, i + 1
        while depth:
            depth += {"{": 1, "}": -1}.get(code[j], 0)
            j += 1
        yield m.group(1), code[i:j]


# The per-op and all-reduce kernels may be launched with programmatic dependent launch (Ops.pdl,
# CustomAllReduce.pdl; port.h he_pdl_wait): each must wait before it touches data of the kernels before it.
# probe.hip's kernels are never launched that way.
PDL_FILES = [p for p in OP_FILES if p.name != "probe.hip"] + sorted((KDIR / "comm").glob("*.hip"))


@pytest.mark.parametrize("path", PDL_FILES, ids=lambda p: p.name)
def test_op_kernels_wait_for_the_previous_kernel(path):
    code = _code(path.read_text())
    kernels = list(_kernel_bodies(code))
    assert kernels or "HE_KERNEL" not in code
    # device functions that wait themselves (he_matvec_run, he_matmul_mma_body), in this file or the op files it
    # may include: a kernel may call one instead
    lib = "\n".join(_code(q.read_text()) for q in OP_FILES)
    funcs = [(m.group(1), m.group(2)) for m in re.finditer(r"HE_INLINE [\w<>:, ]*?\b(he_\w+)\s*\((.*?)\n}", lib, re.S)]
    waiting = {f for f, b in funcs if "he_pdl_wait()" in b}
    while True:  # ... or that call one that does
        more = {f for f, b in funcs if f not in waiting and any(re.search(rf"\b{w}\s*[<(]", b) for w in waiting)}
        if not more:
            break
        waiting |= more
    for name, body in kernels:
        waits = "he_pdl_wait()" in body or any(re.search(rf"\b{f}\s*[<(]", body) for f in waiting)
        assert waits, f"{path.name}: kernel {name} never calls he_pdl_wait()"


# Pointers a PDL kernel may declare `const T* __restrict__`: weights and tables that no kernel of the step
# writes. Through such a pointer NVRTC loads with ld.global.nc, which assumes the memory unchanged for the
# kernel's whole life, so the compiler may issue the load BEFORE he_pdl_wait — it did for the position
# (attention split and combine, qk_norm_rope) and the sampler's history length and step (docs/perf-log.md
# v41): data a kernel before it may still be writing. Step data (activations, caches, positions, tokens,
# logits, candidates) takes plain pointers, whose loads stay behind the wait's memory clobber.
READ_ONLY_PARAMS = {"W", "W2", "Wg", "Wu", "WdT", "gamma", "bias", "cos_t", "sin_t", "table", "q_norm", "k_norm",
                    "Wq", "meta",  # (the screened LM head's int8 rows and their bound table: ops/head_screen.hip)
                    "Wp", "Wgp", "Wup", "esc"}  # (the packed MLP's 13-bit rows and escape bitmaps: ops/matvec_packed.hip)


def _kernel_params(code: str):
    for m in re.finditer(r"HE_KERNEL(?:_MIN)?\([^)]*\)[\s\\]*([\w#]+)\s*\(", code):
        i, depth = m.end(), 1
        j = i
        while depth:
            depth += {"(": 1, ")": -1}.get(code[j], 0)
            j += 1
        yield m.group(1), code[i:j - 1]


@pytest.mark.parametrize("path", PDL_FILES, ids=lambda p: p.name)
def test_step_data_is_not_read_through_restrict_pointers(path):
    bad = []
    for name, params in _kernel_params(_code(path.read_text())):
        for m in re.finditer(r"const\s+\w+\s*\*\s*__restrict__\s+(\w+)", params):
            if m.group(1) not in READ_ONLY_PARAMS:
                bad.append(f"{name}: {m.group(1)}")
    assert not bad, f"{path.name}: step data behind const __restrict__ (loads may pass he_pdl_wait): {bad}"
