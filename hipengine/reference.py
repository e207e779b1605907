"""The numpy reference: the CPU backend and the oracle every GPU kernel is checked against.

Reads like the math (one function per block, a shape on every array), computes in float32, and keeps a KV
cache so prefill (all prompt tokens at once, as matrix products) and decode (one token, matrix-vector
products) share the same code. Notation: T tokens in this call, S = positions attended (cache + new),
d = hidden, H / Hkv = query / KV heads, D = head_dim, G = H // Hkv queries per KV head, F = intermediate.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .backend import Backend
from .config import ModelConfig
from .errors import RequestError

PREFILL_CHUNK = 512  # tokens per prefill step: bounds the attention score matrix for long prompts


# ---- the blocks of the math ---------------------------------------------------------------------------------

def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x (..., n), w (n,) -> (..., n): x / sqrt(mean(x^2) + eps) * w."""
    ms = np.mean(x * x, axis=-1, keepdims=True)  # (..., 1)
    return (x / np.sqrt(ms + eps)) * w


def rope_tables(cfg: ModelConfig, n_pos: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin (n_pos, D/2) float32 from the config's inv_freq (llama3 scaling included).

    Angles are formed in float64 so the tables are exact to float32 rounding at any position."""
    inv = cfg.rope_inv_freq()  # (D/2,) float64
    ang = np.arange(n_pos, dtype=np.float64)[:, None] * inv[None, :]  # (n_pos, D/2)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE (HF layout: dims i and i + D/2 form a pair).

    x (T, heads, D), cos/sin (T, D/2) -> (T, heads, D)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # (T, heads, D/2) each
    c, s = cos[:, None, :], sin[:, None, :]  # (T, 1, D/2)
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def softmax(x: np.ndarray) -> np.ndarray:
    """Along the last axis; -inf entries get probability 0."""
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos0: int, key_pos0: int,
              window: int | None) -> np.ndarray:
    """Causal grouped-query attention.

    q (T, H, D) for positions pos0..pos0+T-1; k, v (S, Hkv, D) for positions key_pos0..key_pos0+S-1.
    Query head h reads KV head h // G (HF's repeat_kv order). Returns (T, H * D)."""
    T, H, D = q.shape
    S, Hkv, _ = k.shape
    G = H // Hkv
    qg = q.reshape(T, Hkv, G, D).transpose(1, 2, 0, 3).reshape(Hkv, G * T, D)  # (Hkv, G*T, D)
    kt = k.transpose(1, 2, 0)  # (Hkv, D, S)
    vt = v.transpose(1, 0, 2)  # (Hkv, S, D)
    scores = (qg @ kt) * np.float32(1.0 / np.sqrt(D))  # (Hkv, G*T, S)
    if T == 1 and key_pos0 + S == pos0 + 1 and (window is None or S <= window):
        return (softmax(scores) @ vt).reshape(Hkv * G, D).reshape(1, H * D)  # decode: every key is visible
    qpos = np.tile(np.arange(pos0, pos0 + T), G)[:, None]  # (G*T, 1) position of each query row
    kpos = np.arange(key_pos0, key_pos0 + S)[None, :]  # (1, S)
    allowed = kpos <= qpos  # (G*T, S) causal
    if window is not None:
        allowed &= qpos - kpos < window  # Mistral: the last `window` positions, the query's own included
    scores = np.where(allowed, scores, np.float32(-np.inf))  # (Hkv, G*T, S)
    out = softmax(scores) @ vt  # (Hkv, G*T, D)
    return out.reshape(Hkv, G, T, D).transpose(2, 0, 1, 3).reshape(T, H * D)  # (T, H*D)


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) -> inf for x < -88 gives the right limit, -0
        return x / (np.float32(1.0) + np.exp(-x))


def swiglu_mlp(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """x (T, d); w_gate, w_up (F, d); w_down (d, F) -> (T, d): down(silu(gate x) * up x)."""
    h = silu(x @ w_gate.T) * (x @ w_up.T)  # (T, F)
    return h @ w_down.T  # (T, d)


# ---- the backend ------------------------------------------------------------------------------------------

class ReferenceBackend(Backend):
    """numpy float32 forward with a KV cache [layers, 2, max_context, kv_dim].

    ``ReferenceBackend(model, max_context)`` with a ``LoadedModel``, or ``ReferenceBackend(config,
    weights=...)``. max_context defaults to min(config.max_position_embeddings, 4096)."""

    def __init__(self, model, max_context: int | None = None, *, weights: Mapping[str, np.ndarray] | None = None):
        if isinstance(model, ModelConfig):
            cfg = model
            if weights is None:
                raise TypeError("ReferenceBackend(config, weights=...) needs the weights")
        else:
            cfg, weights = model.config, model.weights
        self.config = cfg
        self.max_context = int(max_context or min(cfg.max_position_embeddings, 4096))
        if self.max_context <= 0:
            raise RequestError(f"max_context must be positive, got {self.max_context}")

        def w(name: str) -> np.ndarray:  # contiguous float32 so every x @ W.T is one BLAS call, no copy
            return np.ascontiguousarray(weights[name], dtype=np.float32)

        self.embed = w("embed")  # (vocab, d)
        self.lm_head = self.embed if cfg.tie_word_embeddings else w("lm_head")  # (vocab, d)
        self.final_norm = w("final_norm")  # (d,)
        names = ["attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down"]
        if cfg.attention_bias:
            names += ["bq", "bk", "bv"]
        if cfg.qk_norm:
            names += ["q_norm", "k_norm"]
        # layers[i][name]: wq (H*D, d), wk/wv (Hkv*D, d), wo (d, H*D), w_gate/w_up (F, d), w_down (d, F),
        # norms (d,) or (D,), biases (H*D,) / (Hkv*D,)
        self.layers = [{n: w(f"layers.{i}.{n}") for n in names} for i in range(cfg.num_layers)]
        self.cos, self.sin = rope_tables(cfg, self.max_context)  # (max_context, D/2) each
        # Sliding window only matters when it is shorter than the context we can hold.
        sw = cfg.sliding_window
        self.window = sw if (sw is not None and sw < self.max_context) else None
        self.kv_cache = np.zeros((cfg.num_layers, 2, self.max_context, cfg.kv_dim), np.float32)  # (L, 2, C, Hkv*D)
        self.pos = 0

    def reset(self) -> None:
        self.pos = 0  # stale cache rows past pos are never read

    # one transformer layer on T new tokens at positions pos0..pos0+T-1
    def _attention_block(self, i: int, x: np.ndarray, pos0: int) -> np.ndarray:
        """x (T, d) -> attention output (T, d), appending this layer's K/V to the cache."""
        cfg, L = self.config, self.layers[i]
        T = x.shape[0]
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = rmsnorm(x, L["attn_norm"], cfg.rms_norm_eps)  # (T, d)
        q = h @ L["wq"].T  # (T, H*D)
        k = h @ L["wk"].T  # (T, Hkv*D)
        v = h @ L["wv"].T  # (T, Hkv*D)
        if cfg.attention_bias:
            q, k, v = q + L["bq"], k + L["bk"], v + L["bv"]
        q = q.reshape(T, H, D)  # (T, H, D)
        k = k.reshape(T, Hkv, D)  # (T, Hkv, D)
        if cfg.qk_norm:  # Qwen3: per-head RMSNorm over D, before RoPE
            q = rmsnorm(q, L["q_norm"], cfg.rms_norm_eps)
            k = rmsnorm(k, L["k_norm"], cfg.rms_norm_eps)
        cos, sin = self.cos[pos0:pos0 + T], self.sin[pos0:pos0 + T]  # (T, D/2)
        q = apply_rope(q, cos, sin)  # (T, H, D)
        k = apply_rope(k, cos, sin)  # (T, Hkv, D)
        self.kv_cache[i, 0, pos0:pos0 + T] = k.reshape(T, Hkv * D)
        self.kv_cache[i, 1, pos0:pos0 + T] = v
        end = pos0 + T
        # Keys older than the window can never be attended by these queries: skip them entirely.
        start = max(0, pos0 - self.window + 1) if self.window else 0
        keys = self.kv_cache[i, 0, start:end].reshape(end - start, Hkv, D)  # (S, Hkv, D)
        vals = self.kv_cache[i, 1, start:end].reshape(end - start, Hkv, D)  # (S, Hkv, D)
        o = attention(q, keys, vals, pos0, start, self.window)  # (T, H*D)
        return o @ L["wo"].T  # (T, d)

    def _mlp_block(self, i: int, x: np.ndarray) -> np.ndarray:
        """x (T, d) -> (T, d)."""
        L = self.layers[i]
        h = rmsnorm(x, L["ffn_norm"], self.config.rms_norm_eps)  # (T, d)
        return swiglu_mlp(h, L["w_gate"], L["w_up"], L["w_down"])  # (T, d)

    def forward(self, token_ids: np.ndarray, all_logits: bool) -> np.ndarray:
        """token_ids (T,) at positions pos..pos+T-1 -> logits (T, vocab) or (1, vocab) for the last one."""
        x = self.final_hidden(token_ids, all_logits)  # (T or 1, d)
        return (x @ self.lm_head.T).astype(np.float32, copy=False)  # (T or 1, vocab)

    def final_hidden(self, token_ids: np.ndarray, all_positions: bool = True) -> np.ndarray:
        """forward's LM-head input: the final norm's output (T, d), or (1, d) for the last position; advances pos."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)  # (T,)
        T = ids.shape[0]
        if T == 0:
            raise RequestError("no tokens to run (empty prompt)")
        if self.pos + T > self.max_context:
            raise RequestError(f"{self.pos + T} tokens exceed the context of {self.max_context}")
        vocab = self.config.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            raise RequestError(f"token id out of range [0, {vocab})")
        pos0 = self.pos
        x = self.embed[ids]  # (T, d)
        for i in range(self.config.num_layers):
            x = x + self._attention_block(i, x, pos0)  # (T, d)
            x = x + self._mlp_block(i, x)  # (T, d)
        self.pos = pos0 + T
        if not all_positions:
            x = x[-1:]  # (1, d): only the last position's logits are needed
        return rmsnorm(x, self.final_norm, self.config.rms_norm_eps)  # (T or 1, d)

    def prefill(self, token_ids: np.ndarray, all_logits: bool = False) -> np.ndarray:
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)  # (T,)
        if ids.size == 0:
            raise RequestError("no tokens to run (empty prompt)")
        if self.pos + ids.size > self.max_context:
            raise RequestError(f"{self.pos + ids.size} tokens exceed the context of {self.max_context}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:  # before any chunk moves the position
            raise RequestError(f"token id out of range [0, {self.config.vocab_size})")
        # Long prompts run in chunks (each attends to the cache plus itself: the same math) so the attention
        # scores stay [heads, PREFILL_CHUNK, S] instead of [heads, T, T].
        parts = [self.forward(ids[i:i + PREFILL_CHUNK], all_logits) for i in range(0, ids.size, PREFILL_CHUNK)]
        return np.concatenate(parts) if all_logits else parts[-1][0]  # (T, vocab) or (vocab,)

    def decode(self, token_id: int) -> np.ndarray:
        return self.forward(np.array([int(token_id)]), all_logits=False)[0]  # (vocab,)
