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
