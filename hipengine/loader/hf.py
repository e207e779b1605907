"""Hugging Face directory: config.json + one or many safetensors files (memory-mapped, each opened once).

The safetensors header is parsed here rather than through ``safe_open`` so that a truncated or corrupt file
is reported with its name and the offending tensor, and so that float32 tensors stay zero-copy views of the
memory map (a 1B float32 checkpoint then costs no extra host memory).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..errors import ModelError, UnsupportedError
from . import LoadedModel, check_weights, progress_bar

# HF parameter name (layer part removed) -> canonical name (hipengine.backend).
_GLOBAL = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}
_LAYER = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
    "self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk", "self_attn.v_proj.bias": "bv",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "self_attn.o_proj.weight": "wo",
    "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up", "mlp.down_proj.weight": "w_down",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")  # old checkpoints store RoPE tables; we compute our own

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


def canonical_name(hf_name: str) -> str | None:
    """HF tensor name -> canonical name; None for tensors we deliberately ignore."""
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    if _IGNORED.match(hf_name):
        return None
    m = _LAYER_RE.fullmatch(hf_name)
    if m and m.group(2) in _LAYER:
        return f"layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    raise UnsupportedError(f"tensor {hf_name!r} is not part of any architecture hipengine supports")


def read_hf_config(d: Path) -> ModelConfig:
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ModelError(f"{str(d)!r} has no config.json (expected a Hugging Face model directory)")
    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read {cfg_path}: {e}") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{cfg_path} is not a JSON object")
    if raw.get("mlp_bias"):
        raise UnsupportedError(f"{cfg_path}: mlp_bias=true is not supported")
    cfg = ModelConfig.from_hf(raw, name=d.name)
    # Chat checkpoints often list their end-of-turn ids only in generation_config.json (Llama 3: <|eot_id|>);
    # generation must stop on those too.
    gen = d / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
            extra = [int(e) for e in (eos if isinstance(eos, list) else ([] if eos is None else [eos]))]
        except (OSError, ValueError, TypeError, AttributeError):
            raise ModelError(f"{gen}: cannot read its eos_token_id") from None
        ids = tuple(dict.fromkeys([*cfg.eos_token_ids, *extra]))
        if ids != cfg.eos_token_ids:
            cfg = cfg.replace(eos_token_ids=ids)
    return cfg


def _open_safetensors(f: Path) -> tuple[np.memmap, int, dict]:
    """Memory-map one file (its only open); return (map, data start offset, header) after checking that
    every tensor the header lists lies inside the file."""
    size = f.stat().st_size
    if size < 8:
        raise ModelError(f"{f}: truncated safetensors file ({size} bytes)")
    mm = np.memmap(f, dtype=np.uint8, mode="r")
    n = int(mm[:8].view("<u8")[0])  # little-endian u64 header length
    if 8 + n > size:
        raise ModelError(f"{f}: truncated safetensors file (header says {n} bytes, file has {size})")
    try:
        header = json.loads(mm[8:8 + n].tobytes())
    except ValueError:
        raise ModelError(f"{f}: corrupt safetensors header") from None
    if not isinstance(header, dict):
        raise ModelError(f"{f}: corrupt safetensors header")
    header.pop("__metadata__", None)
    data_len = size - 8 - n
    for name, info in header.items():
        try:
            b, e = info["data_offsets"]
            dt = np.dtype(_ST_DTYPES[info["dtype"]]) if info["dtype"] in _ST_DTYPES else None
            numel = int(np.prod(info["shape"], dtype=np.int64))
        except (KeyError, TypeError, ValueError):
            raise ModelError(f"{f}: corrupt safetensors header entry for {name!r}") from None
        if e > data_len:
            raise ModelError(f"{f}: truncated safetensors file (tensor {name!r} ends at byte {e} of the data, "
                             f"only {data_len} present)")
        if dt is not None and e - b != numel * dt.itemsize:
            raise ModelError(f"{f}: corrupt safetensors entry {name!r} (size does not match its shape)")
    return mm, 8 + n, header


def _to_float32(mm: np.memmap, start: int, info: dict, name: str, f: Path) -> np.ndarray:
    dtype, shape = info["dtype"], tuple(info["shape"])
    if dtype not in _ST_DTYPES:
        raise UnsupportedError(f"{f}: tensor {name!r} has dtype {dtype} (supported: F32, F16, BF16, F64)")
    b, e = info["data_offsets"]
    raw = np.asarray(mm[start + b:start + e]).view(_ST_DTYPES[dtype]).reshape(shape)
    if dtype == "F32":
        return raw  # zero-copy view of the memory map
    if dtype == "BF16":
        # bf16 is the top half of a float32: widen by shifting the bits up.
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


def _shard_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            raise ModelError(f"{index}: cannot read its weight_map") from None
        files = sorted({d / v for v in wm.values()})
        for f in files:
            if not f.is_file():
                raise ModelError(f"{index} names {f.name}, which is missing")
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{str(d)!r} has no *.safetensors files (other weight formats are not supported)")
    return files


def load_hf(d: Path, progress: bool = True) -> LoadedModel:
    cfg = read_hf_config(d)
    files = _shard_files(d)
    opened = [(f, *_open_safetensors(f)) for f in files]  # validate every header before converting anything
    weights: dict[str, np.ndarray] = {}
    where: dict[str, str] = {}
    with progress_bar(sum(len(h) for _, _, _, h in opened), f"loading {d.name}", progress) as bar:
        for f, mm, start, header in opened:
            for hf_name, info in header.items():
                name = canonical_name(hf_name)
                bar.update(1)
                if name is None:
                    continue
                weights[name] = _to_float32(mm, start, info, hf_name, f)
                where[name] = f.name
    if cfg.tie_word_embeddings or "lm_head" not in weights:
        if "embed" in weights:
            weights["lm_head"] = weights["embed"]  # the same object: backends rely on it to store one copy
            where["lm_head"] = where["embed"]
        if not cfg.tie_word_embeddings:
            cfg = cfg.replace(tie_word_embeddings=True)
    check_weights(cfg, weights, where)
    return LoadedModel(config=cfg, weights=weights, path=d, source="hf")
