"""The interface between ``Engine`` and a compute backend (numpy reference, per-op GPU, monokernel).

Canonical weight names (one spelling everywhere; HF layout, RoPE in rotate-half form; float32 unless a
loader says otherwise):

    embed                     (vocab, hidden)
    layers.{i}.attn_norm      (hidden,)
    layers.{i}.wq             (num_heads * head_dim, hidden)
    layers.{i}.wk, .wv        (num_kv_heads * head_dim, hidden)
    layers.{i}.bq             (num_heads * head_dim,)        only if config.attention_bias
    layers.{i}.bk, .bv        (num_kv_heads * head_dim,)     only if config.attention_bias
    layers.{i}.q_norm, .k_norm (head_dim,)                   only if config.qk_norm
    layers.{i}.wo             (hidden, num_heads * head_dim)
    layers.{i}.ffn_norm       (hidden,)
    layers.{i}.w_gate, .w_up  (intermediate, hidden)
    layers.{i}.w_down         (hidden, intermediate)
    final_norm                (hidden,)
    lm_head                   (vocab, hidden)  the same array object as ``embed`` when tied
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from .config import ModelConfig


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every canonical weight; loaders check against it."""
    h, f, q, kv, hd = cfg.hidden_size, cfg.intermediate_size, cfg.q_dim, cfg.kv_dim, cfg.head_dim
    s: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab_size, h), "final_norm": (h,), "lm_head": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        s.update({p + "attn_norm": (h,), p + "wq": (q, h), p + "wk": (kv, h), p + "wv": (kv, h),
                  p + "wo": (h, q), p + "ffn_norm": (h,), p + "w_gate": (f, h), p + "w_up": (f, h),
                  p + "w_down": (h, f)})
        if cfg.attention_bias:
            s.update({p + "bq": (q,), p + "bk": (kv,), p + "bv": (kv,)})
        if cfg.qk_norm:
            s.update({p + "q_norm": (hd,), p + "k_norm": (hd,)})
    return s


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 -> greedy
    top_k: int = 0  # 0 -> off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def resolved_seed(self) -> int:
        """The seed as a 64-bit integer; a fresh random one when none was given."""
        import os

        return (self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "little")) & (2**64 - 1)


class Backend:
    """One model instance on one device (or one TP group). Holds its own KV cache.

    Positions are implicit: ``prefill`` starts at position 0 after ``reset``; each ``decode`` advances one.
    """

    config: ModelConfig
    max_context: int

    def reset(self) -> None:
        raise NotImplementedError

    def prefill(self, token_ids: np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Run tokens [T] from the current position; returns logits [vocab] of the last position
        (or [T, vocab] with ``all_logits``) as float32."""
        raise NotImplementedError

    def decode(self, token_id: int) -> np.ndarray:
        """One step: logits [vocab] float32 for the next position."""
        raise NotImplementedError

    def check_prompt(self, prompt_ids) -> np.ndarray:
        """The prompt as int64 [T]; RequestError when it is empty or longer than the context."""
        from .errors import RequestError

        prompt = np.asarray(prompt_ids, np.int64).reshape(-1)
        if prompt.size == 0:
            raise RequestError("empty prompt")
        if prompt.size > self.max_context:
            raise RequestError(f"prompt is {prompt.size} tokens, longer than the context of {self.max_context} tokens")
        return prompt

    def generate_ids(self, prompt_ids: np.ndarray, params: SamplingParams,
                     should_stop: Callable[[], bool]) -> Iterator[int]:
        """Yield sampled token ids one by one (EOS included, then stops). The default implementation
        samples on the host (``hipengine.sampling``); GPU backends override it to sample on the device."""
        from .sampling import host_generate  # local import: sampling depends on this module

        yield from host_generate(self, prompt_ids, params, should_stop)

    def close(self) -> None:
        pass
