"""Model configuration: one dataclass for every supported architecture.

Filled from a Hugging Face ``config.json`` (``ModelConfig.from_hf``) or from GGUF metadata
(``hipengine.loader.gguf``). Both the numpy reference and the GPU executor read only this object.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from .errors import ModelError, UnsupportedError

# HF ``architectures`` / ``model_type`` -> our family name. SmolLM is a Llama.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF dict; only rope_type "llama3" (or None / "default") is supported
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2); o_proj never has one here
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # Mistral; honoured when smaller than the context used
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if self.family not in MODEL_TYPES.values():
            raise UnsupportedError(f"unsupported architecture family {self.family!r}")
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim"):
            v = getattr(self, k)
            if not isinstance(v, int) or v <= 0:
                raise ModelError(f"config field {k} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ModelError(f"head_dim {self.head_dim} must be even for RoPE")
        rt = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type"))
        if rt not in (None, "default", "llama3"):
            raise UnsupportedError(f"unsupported rope_scaling type {rt!r} (supported: llama3)")

    # ---- derived quantities -------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def rope_inv_freq(self) -> np.ndarray:
        """inv_freq [head_dim/2] float64, with llama3 frequency scaling applied. The one source of RoPE
        frequencies: the reference and the GPU tables are both made from it."""
        hd = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
        rs = self.rope_scaling or {}
        if rs.get("rope_type", rs.get("type")) == "llama3":
            factor = float(rs["factor"])
            lo = float(rs.get("low_freq_factor", 1.0))
            hi = float(rs.get("high_freq_factor", 4.0))
            old = float(rs.get("original_max_position_embeddings", 8192))
            low_wavelen, high_wavelen = old / lo, old / hi
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (old / wavelen - lo) / (hi - lo)
            mid = (1 - smooth) * scaled / factor + smooth * scaled
            is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = np.where(is_mid, mid, scaled)
        return inv

    def num_parameters(self) -> int:
        h, f, L = self.hidden_size, self.intermediate_size, self.num_layers
        per_layer = (h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h + 3 * h * f + 2 * h)
        if self.attention_bias:
            per_layer += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        emb = self.vocab_size * h
        return L * per_layer + emb + (0 if self.tie_word_embeddings else emb) + h

    def decode_bytes_per_token(self, bytes_per_weight: float = 2.0, context: int = 0,
                               kv_bytes: float = 2.0) -> float:
        """Bytes one decode step must read from HBM at batch 1: every layer weight, the LM head (the tied
        embedding counts once, as the head; the embedding row read is negligible), and the KV cache."""
        h = self.hidden_size
        emb = self.vocab_size * h
        weights = self.num_parameters() - (0 if self.tie_word_embeddings else emb)
        kv = 2 * self.num_layers * self.kv_dim * context * kv_bytes
        return weights * bytes_per_weight + kv

    # ---- construction -------------------------------------------------------
    @classmethod
    def from_hf(cls, d: dict, name: str = "") -> "ModelConfig":
        arch = (d.get("architectures") or [None])[0]
        family = ARCHITECTURES.get(arch) or MODEL_TYPES.get(d.get("model_type", ""))
        if family is None:
            what = arch or d.get("model_type") or "<none>"
            raise UnsupportedError(
                f"unsupported architecture {what!r} (supported: {', '.join(sorted(ARCHITECTURES))})")
        # transformers >= 5 writes RoPE settings as ``rope_parameters`` (rope_theta inside) instead of
        # ``rope_theta`` + ``rope_scaling``; read either spelling.
        rp = d.get("rope_parameters")
        if d.get("rope_scaling") is None and isinstance(rp, dict) and rp.get("rope_type", "default") != "default":
            d = {**d, "rope_scaling": {k: v for k, v in rp.items() if k != "rope_theta"}}
        try:
            nh = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            eos = d.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
            return cls(
                family=family,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=nh,
                num_kv_heads=int(d.get("num_key_value_heads") or nh),
                head_dim=int(d.get("head_dim") or hidden // nh),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6 if family.startswith("qwen") else 1e-5)),
                rope_theta=float(d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
                rope_scaling=d.get("rope_scaling"),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", family == "qwen2")),
                qk_norm=family == "qwen3",
                sliding_window=(d.get("sliding_window") if (family == "mistral" or d.get("use_sliding_window")) else None),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
                name=name,
                extra={k: d[k] for k in ("torch_dtype", "dtype", "mlp_bias") if k in d},
            )
        except KeyError as e:
            raise ModelError(f"config.json is missing required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ModelError(f"config.json has an invalid value: {e}") from None
