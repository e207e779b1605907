"""One GGUF file (llama.cpp format): metadata -> ModelConfig, tensors dequantized to float32 at load.

The ``gguf`` package is imported only here (the GPU machine does not have it). GGUFReader memory-maps the
file; each tensor is read exactly once, by its dequantization.

Layout fix-up: llama.cpp's converter permutes the rows of attn_q / attn_k of llama-family models so that
RoPE pairs are adjacent (interleaved RoPE, (x[2j], x[2j+1])). Our canonical layout is HF's rotate-half
(x[j], x[j + D/2]), so those rows are permuted back here. Qwen2/Qwen3 GGUFs are stored unpermuted (llama.cpp
runs them with NEOX-style RoPE, which is rotate-half).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..errors import ModelError, UnsupportedError
from . import LoadedModel, check_weights, progress_bar

FAMILIES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
PERMUTED_QK = {"llama", "mistral"}  # architectures whose q/k rows llama.cpp's converter interleaves
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")

_GLOBAL = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}
_LAYER = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv",
    "attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv", "attn_output.weight": "wo",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm", "ffn_norm.weight": "ffn_norm",
    "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up", "ffn_down.weight": "w_down",
}
ROPE_FREQS = "rope_freqs.weight"  # llama3 frequency divisors; folded into ModelConfig.rope_scaling


def canonical_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"layers.{parts[1]}.{_LAYER[parts[2]]}"
    raise UnsupportedError(f"GGUF tensor {gguf_name!r} is not part of any architecture hipengine supports")


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: within each head, rows were reordered from rotate-half order
    (two halves of D/2) to interleaved pairs. w (n_head * D, ...) or bias (n_head * D,) -> same shape."""
    D = w.shape[0] // n_head
    return np.ascontiguousarray(
        w.reshape(n_head, D // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _llama3_scaling(reader, arch: str, cfg_kw: dict, freqs: np.ndarray, path: Path) -> dict:
    """Recover HF's llama3 rope_scaling dict from the rope_freqs tensor (inv_freq divisors) and verify it."""
    factor = float(np.max(freqs))
    old = int(_field(reader, f"{arch}.rope.scaling.original_context_length", 8192))
    rs = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": old}
    base = ModelConfig(**cfg_kw).rope_inv_freq()
    scaled = ModelConfig(**cfg_kw, rope_scaling=rs).rope_inv_freq()
    if freqs.shape != base.shape or not np.allclose(base / scaled, freqs, rtol=1e-3):
        raise UnsupportedError(f"{path.name}: rope_freqs does not match llama3 RoPE scaling "
                               f"(factor {factor}, low 1, high 4, original {old}); other scalings are unsupported")
    return rs


def read_config(reader, tensors: dict, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in FAMILIES:
        raise UnsupportedError(f"{path.name}: unsupported GGUF architecture {arch!r} "
                               f"(supported: {', '.join(sorted(FAMILIES))})")
    a = arch + "."
    try:
        hidden = int(_field(reader, a + "embedding_length"))
        n_head = int(_field(reader, a + "attention.head_count"))
        n_kv = int(_field(reader, a + "attention.head_count_kv", n_head))
        head_dim = int(_field(reader, a + "attention.key_length", hidden // n_head))
        if "token_embd.weight" in tensors:  # the embedding's rows are what the weights actually hold
            vocab = int(tensors["token_embd.weight"].shape[-1])
        else:
            vocab = int(_field(reader, a + "vocab_size", len(_field(reader, "tokenizer.ggml.tokens", []))))
        kw = dict(
            family=FAMILIES[arch], vocab_size=vocab, hidden_size=hidden,
            intermediate_size=int(_field(reader, a + "feed_forward_length")),
            num_layers=int(_field(reader, a + "block_count")),
            num_heads=n_head, num_kv_heads=n_kv, head_dim=head_dim,
            rms_norm_eps=float(_field(reader, a + "attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(_field(reader, a + "rope.freq_base", 10000.0)),
            max_position_embeddings=int(_field(reader, a + "context_length", 2048)),
        )
    except TypeError:  # a required key is absent: int(None)
        raise ModelError(f"{path.name}: GGUF metadata lacks a required {arch} hyperparameter") from None
    rope_dims = _field(reader, a + "rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise UnsupportedError(f"{path.name}: partial RoPE ({rope_dims} of {head_dim} dims) is not supported")
    scaling_type = _field(reader, a + "rope.scaling.type")
    rope_scaling = None
    if ROPE_FREQS in tensors:
        from gguf.quants import dequantize

        t = tensors[ROPE_FREQS]
        freqs = dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)
        rope_scaling = _llama3_scaling(reader, arch, kw, freqs, path)
    elif scaling_type not in (None, "none", "llama3"):
        raise UnsupportedError(f"{path.name}: unsupported RoPE scaling type {scaling_type!r} (supported: llama3)")
    elif scaling_type == "llama3":
        rope_scaling = {"rope_type": "llama3", "factor": float(_field(reader, a + "rope.scaling.factor", 8.0)),
                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings":
                            int(_field(reader, a + "rope.scaling.original_context_length", 8192))}
    eos = [_field(reader, k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    eos_ids = tuple(dict.fromkeys(int(e) for e in eos if e is not None))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    sw = _field(reader, a + "attention.sliding_window")
    return ModelConfig(
        **kw, rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm=arch == "qwen3",
        sliding_window=int(sw) if (sw and arch in ("llama", "mistral")) else None,
        bos_token_id=None if bos is None else int(bos), eos_token_ids=eos_ids,
        name=str(_field(reader, "general.name", path.stem)),
        extra={"gguf_architecture": arch, "tokenizer_model": _field(reader, "tokenizer.ggml.model")},
    )


def load_gguf(path: Path, progress: bool = True) -> LoadedModel:
    try:
        import gguf
        from gguf.quants import dequantize
    except ImportError:
        raise ModelError("loading .gguf files needs the 'gguf' package: pip install gguf") from None
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # the reader raises ValueError/struct/IndexError/... on malformed files
        detail = (str(e).splitlines() or [""])[0]
        raise ModelError(f"{path}: not a readable GGUF file, truncated or corrupt "
                         f"({type(e).__name__}: {detail})") from None
    tensors = {t.name: t for t in reader.tensors}
    cfg = read_config(reader, tensors, path)
    for t in tensors.values():  # fail before the (slow) dequantization if anything is unsupported
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise UnsupportedError(f"{path.name}: tensor {t.name!r} has quantization type {t.tensor_type.name} "
                                   f"(supported: {', '.join(SUPPORTED_TYPES)})")
    weights: dict[str, np.ndarray] = {}
    where: dict[str, str] = {}
    with progress_bar(len(tensors), f"dequantizing {path.name}", progress) as bar:
        for gname, t in tensors.items():
            bar.update(1)
            if gname == ROPE_FREQS:
                continue
            name = canonical_name(gname)
            shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims fastest-first
            try:
                w = dequantize(t.data, t.tensor_type).reshape(shape)
            except ValueError:
                raise ModelError(f"{path.name}: tensor {gname!r} data does not match its shape {shape}") from None
            weights[name] = np.asarray(w, dtype=np.float32)
            where[name] = path.name
    if cfg.tie_word_embeddings and "embed" in weights:
        weights["lm_head"] = weights["embed"]  # the same object
        where["lm_head"] = where["embed"]
    check_weights(cfg, weights, where)
    if cfg.extra["gguf_architecture"] in PERMUTED_QK:  # after the shape check, so the reshape cannot fail
        for name in list(weights):
            if name.endswith((".wq", ".bq")):
                weights[name] = unpermute_rows(weights[name], cfg.num_heads)
            elif name.endswith((".wk", ".bk")):
                weights[name] = unpermute_rows(weights[name], cfg.num_kv_heads)
    return LoadedModel(config=cfg, weights=weights, path=path, source="gguf", gguf_reader=reader)
