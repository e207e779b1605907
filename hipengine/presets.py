"""Random-weight models with the exact shapes of published checkpoints (benchmarks and GPU tests need the
shape, not the weights: the device machine cannot download anything) plus tiny shapes for tests.

``preset_model(name, seed)`` returns a ``LoadedModel`` whose ``weights`` is a lazy mapping: each tensor is
generated from (seed, name) when it is accessed, so an 8B preset never sits in host memory whole and any
process regenerates the identical tensor on its own (GPU ranks, the reference oracle).

Init scale (chosen so next-token distributions are peaked, with top-1/top-2 gaps well above bf16 error):
- projections into attention/MLP (wq, wk, wv, w_gate, w_up): uniform, std 1/sqrt(fan_in), so projections of
  an RMS-normalised input are O(1) and attention scores have std ~1 (a real pattern, not uniform);
- residual branches (wo, w_down): std OUT_SCALE/sqrt(fan_in * 2 * layers), OUT_SCALE = 0.5: each layer is a
  perturbation and the sum stays O(1). Larger branches make the random network chaotic, so bf16 rounding
  is amplified layer after layer (measured: 2x the branch scale doubles the logit error);
- embed and lm_head: std LOGIT_STD/sqrt(hidden) (logits of std ~8), times a log-normal gain per vocabulary
  row (ROW_GAIN_STD = 0.5). Gaussian logits over a large vocabulary crowd at the top (median top-1/top-2
  gap ~0.25 std); heavy-tailed rows give gaps of ~1-2 std. HF's init (std 0.02) gives near-uniform logits;
- norm weights 1 +- 0.1 and biases +- 0.1, so a missing norm weight or bias shows in comparisons.
Measured on a 12-layer, hidden-256, 16K-vocab llama with the reference run on fp32 weights vs bf16-rounded
weights, 128 positions: top-1 probability median 1.00, median gap / max logit error ~30-60, top-1 agreement
99-100%, ~4-5% of positions with gap < 3x the error. Near-ties remain possible, so GPU comparisons should
still skip positions whose gap is below their error bound. Tied presets tend, under greedy decoding, to
settle into repeating one token (the head is the embedding); compare teacher-forced logits for those.
"""
from __future__ import annotations

import hashlib
import weakref
from collections.abc import Iterator, Mapping

import numpy as np

from .backend import weight_shapes
from .config import ModelConfig
from .errors import UnsupportedError

LOGIT_STD = 8.0
OUT_SCALE = 0.5
ROW_GAIN_STD = 0.5

_LLAMA3_ROPE_1B_3B = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}
_LLAMA3_ROPE_8B = {**_LLAMA3_ROPE_1B_3B, "factor": 8.0}
_LLAMA3_TOKENS = dict(bos_token_id=128000, eos_token_ids=(128001, 128008, 128009))

# Published config.json values of each checkpoint (Hugging Face meta-llama/*, Qwen/*, HuggingFaceTB/*).
PRESETS: dict[str, ModelConfig] = {
    "llama-3.2-1b": ModelConfig(
        family="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE_1B_3B, max_position_embeddings=131072, tie_word_embeddings=True,
        name="llama-3.2-1b", **_LLAMA3_TOKENS),
    "llama-3.2-3b": ModelConfig(
        family="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_layers=28,
        num_heads=24, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE_1B_3B, max_position_embeddings=131072, tie_word_embeddings=True,
        name="llama-3.2-3b", **_LLAMA3_TOKENS),
    "llama-3.1-8b": ModelConfig(
        family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE_8B, max_position_embeddings=131072, tie_word_embeddings=False,
        name="llama-3.1-8b", **_LLAMA3_TOKENS),
    "qwen2.5-1.5b": ModelConfig(
        family="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
        num_heads=12, num_kv_heads=2, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=True, attention_bias=True,
        bos_token_id=151643, eos_token_ids=(151643,), name="qwen2.5-1.5b"),
    "smollm2-135m": ModelConfig(  # the default model's shape (9 heads / 3 KV heads: not divisible by 2)
        family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
        name="smollm2-135m"),
    # Tiny shapes for tests: small enough for the numpy reference in milliseconds, yet not multiples of
    # typical GPU block sizes (hidden 96/160, ffn 200/352, vocab 500/1000) to catch tail handling.
    "tiny-llama": ModelConfig(
        family="llama", vocab_size=500, hidden_size=128, intermediate_size=352, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=32, rope_theta=10000.0, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,), name="tiny-llama"),
    "tiny-llama3": ModelConfig(
        family="llama", vocab_size=1000, hidden_size=256, intermediate_size=704, num_layers=3, num_heads=8,
        num_kv_heads=2, head_dim=32, rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE_1B_3B, "original_max_position_embeddings": 64},
        max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,),
        name="tiny-llama3"),
    "tiny-mistral": ModelConfig(
        family="mistral", vocab_size=500, hidden_size=96, intermediate_size=200, num_layers=2, num_heads=6,
        num_kv_heads=2, head_dim=16, rope_theta=1e6, max_position_embeddings=512, sliding_window=16,
        bos_token_id=1, eos_token_ids=(2,), name="tiny-mistral"),
    "tiny-qwen2": ModelConfig(
        family="qwen2", vocab_size=500, hidden_size=160, intermediate_size=352, num_layers=2, num_heads=5,
        num_kv_heads=1, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=512,
        tie_word_embeddings=True, attention_bias=True, bos_token_id=1, eos_token_ids=(2,), name="tiny-qwen2"),
    "tiny-qwen3": ModelConfig(
        family="qwen3", vocab_size=500, hidden_size=128, intermediate_size=352, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=512,
        qk_norm=True, bos_token_id=1, eos_token_ids=(2,), name="tiny-qwen3"),
}


def tensor_seed(seed: int, name: str) -> list[int]:
    """A stable per-tensor seed (Python's hash() is salted per process, so it cannot be used)."""
    h = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return [int(seed), h]


def random_tensor(cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """The deterministic float32 tensor ``name`` of a preset (see the module docstring for the scales)."""
    rng = np.random.default_rng(tensor_seed(seed, name))
    kind = name.rsplit(".", 1)[-1]
    if kind in ("attn_norm", "ffn_norm", "final_norm", "q_norm", "k_norm"):
        center, std = 1.0, 0.1
    elif kind in ("bq", "bk", "bv"):
        center, std = 0.0, 0.1
    elif kind in ("embed", "lm_head"):
        center, std = 0.0, LOGIT_STD / np.sqrt(shape[1])
    elif kind in ("wo", "w_down"):  # residual branches: each layer a perturbation, the sum O(1)
        center, std = 0.0, OUT_SCALE / np.sqrt(shape[1] * 2 * cfg.num_layers)
    else:  # projection matrices (out, in)
        center, std = 0.0, 1.0 / np.sqrt(shape[1])
    # Uniform rather than normal: a quarter of the generation cost, which matters for 8B of parameters.
    half_width = np.float32(np.sqrt(3.0) * std)
    t = rng.random(shape, dtype=np.float32)  # (shape) in [0, 1)
    t *= 2 * half_width
    t += np.float32(center) - half_width
    if kind in ("embed", "lm_head") and ROW_GAIN_STD:
        # log-normal gain per vocabulary row: heavy-tailed logits, so the top-1 clears the runner-up by a
        # margin that is large relative to the logits' spread (Gaussian logits over 128K tokens are crowded
        # at the top: the median gap is only ~0.25 std).
        t *= np.exp(np.float32(ROW_GAIN_STD) * rng.standard_normal((shape[0], 1), dtype=np.float32))
    return t


class LazyWeights(Mapping):
    """name -> float32 array, generated on access. Tied ``lm_head`` returns the same object as ``embed``
    while anyone holds it (a weak cache), so identity-based dedup of the tied head keeps working."""

    def __init__(self, cfg: ModelConfig, seed: int):
        self.config, self.seed = cfg, seed
        self._shapes = weight_shapes(cfg)
        self._alive: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._shapes:
            raise KeyError(name)
        if name == "lm_head" and self.config.tie_word_embeddings:
            name = "embed"
        t = self._alive.get(name)
        if t is None:
            t = random_tensor(self.config, name, self._shapes[name], self.seed)
            self._alive[name] = t
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


def preset_model(name: str, seed: int = 0, max_context: int | None = None):
    """A LoadedModel with the preset's exact shape and deterministic random weights (token ids only: no
    tokenizer). ``max_context`` caps ``max_position_embeddings`` so backends size their KV cache to it."""
    from .loader import LoadedModel

    if name not in PRESETS:
        raise UnsupportedError(f"unknown preset {name!r} (choose from: {', '.join(PRESETS)})")
    cfg = PRESETS[name]
    if max_context:
        cfg = cfg.replace(max_position_embeddings=int(max_context))
    return LoadedModel(config=cfg, weights=LazyWeights(cfg, seed), path=None, source="preset")
