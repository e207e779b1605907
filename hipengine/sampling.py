"""Host sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty; seeded and reproducible.

The order of operations follows Hugging Face's logits processors (penalty, temperature, top-k, top-p,
min-p) so the same parameters mean the same thing here, in transformers and over the OpenAI API.
"""
from __future__ import annotations

import math
from dataclasses import fields
from typing import Callable, Iterator

import numpy as np

from .backend import SamplingParams
from .errors import RequestError

SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


def make_params(**kw) -> SamplingParams:
    """SamplingParams from keyword arguments (None means "default"), validated."""
    unknown = sorted(set(kw) - set(SAMPLING_FIELDS))
    if unknown:
        raise RequestError(f"unknown sampling parameter(s): {', '.join(unknown)} "
                           f"(known: {', '.join(SAMPLING_FIELDS)})")
    kw = {k: v for k, v in kw.items() if v is not None}
    stop = kw.get("stop", ())
    if isinstance(stop, str):
        stop = (stop,)
    try:
        kw["stop"] = tuple(stop)
    except TypeError:
        raise RequestError("stop must be a string or a list of strings") from None
    p = SamplingParams(**kw)
    validate(p)
    return p


def _number(name, v, kind=float):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise RequestError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {v!r}")
    if isinstance(v, float) and not math.isfinite(v):
        raise RequestError(f"{name} must be finite, got {v!r}")
    return kind(v)


def validate(p: SamplingParams) -> None:
    """Every field in range, else a RequestError naming the field, its value and the allowed range."""
    if _number("temperature", p.temperature) < 0:
        raise RequestError(f"temperature must be >= 0 (0 = greedy), got {p.temperature}")
    top_p = _number("top_p", p.top_p)
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {p.top_p}")
    if _number("top_k", p.top_k, int) < 0:
        raise RequestError(f"top_k must be >= 0 (0 = off), got {p.top_k}")
    if not 0 <= _number("min_p", p.min_p) <= 1:
        raise RequestError(f"min_p must be in [0, 1], got {p.min_p}")
    if _number("repetition_penalty", p.repetition_penalty) <= 0:
        raise RequestError(f"repetition_penalty must be > 0 (1 = off), got {p.repetition_penalty}")
    if _number("max_tokens", p.max_tokens, int) < 1:
        raise RequestError(f"max_tokens must be >= 1, got {p.max_tokens}")
    if p.seed is not None:
        _number("seed", p.seed, int)
        if int(p.seed) < 0:
            raise RequestError(f"seed must be >= 0, got {p.seed}")
    if not all(isinstance(s, str) and s for s in p.stop):
        raise RequestError("stop must be non-empty strings")


def apply_repetition_penalty(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """CTRL-style penalty on every token already in the context: positive logits divided, negative multiplied."""
    if penalty == 1.0 or seen.size == 0:
        return logits
    out = logits.copy()
    v = out[seen]
    out[seen] = np.where(v > 0, v / penalty, v * penalty)
    return out


def probabilities(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The distribution temperature/top-k/top-p/min-p leave: float64 [vocab], sums to 1 (temperature > 0)."""
    x = logits.astype(np.float64) / p.temperature
    if p.top_k and p.top_k < x.size:
        kth = np.partition(x, -p.top_k)[-p.top_k]
        x = np.where(x < kth, -np.inf, x)
    x = x - x.max()
    probs = np.exp(x)
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        # Keep the smallest prefix whose mass reaches top_p: a token survives if the mass before it is < top_p.
        drop = order[(cum - probs[order]) >= p.top_p]
        probs[drop] = 0.0
    if p.min_p > 0.0:
        probs[probs < p.min_p * probs.max()] = 0.0
    return probs / probs.sum()


class Sampler:
    """Picks the next token from logits; owns the seeded random stream and the penalty history."""

    def __init__(self, params: SamplingParams, prompt_ids=()):
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.seen = set(int(i) for i in prompt_ids) if params.repetition_penalty != 1.0 else set()

    def __call__(self, logits: np.ndarray) -> int:
        p = self.params
        if self.seen:
            logits = apply_repetition_penalty(logits, np.fromiter(self.seen, dtype=np.int64), p.repetition_penalty)
        if p.temperature == 0:
            tok = int(np.argmax(logits))
        else:
            probs = probabilities(logits, p)
            # Inverse-CDF draw: one uniform per token keeps the random stream (and so seeded output) simple.
            tok = int(np.searchsorted(np.cumsum(probs), self.rng.random() * probs.sum(), side="right"))
            tok = min(tok, probs.size - 1)
            while probs[tok] == 0.0:  # float round-off at the top end can land on a dropped tail token
                tok -= 1
        if p.repetition_penalty != 1.0:
            self.seen.add(tok)
        return tok


def host_generate(backend, prompt_ids, params: SamplingParams,
                  should_stop: Callable[[], bool] = lambda: False) -> Iterator[int]:
    """Prefill the prompt, then sample and decode one token at a time.

    Yields up to ``params.max_tokens`` ids; stops after an id in ``backend.config.eos_token_ids`` (yielded,
    unless ``ignore_eos``), when the KV cache is full, or as soon as ``should_stop()`` is true (checked
    before every step, so a cancel lands within one token).
    """
    prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
    max_ctx = int(backend.max_context)
    if prompt.size == 0:
        raise RequestError("empty prompt")
    if prompt.size > max_ctx:
        raise RequestError(f"prompt is {prompt.size} tokens, longer than the context of {max_ctx} tokens")
    eos = set() if params.ignore_eos else set(int(e) for e in backend.config.eos_token_ids)
    sample = Sampler(params, prompt.tolist())
    if should_stop():
        return
    backend.reset()
    logits = backend.prefill(prompt)
    pos = int(prompt.size)  # tokens in the KV cache
    for n in range(params.max_tokens):
        tok = sample(logits)
        yield tok
        if tok in eos or n + 1 >= params.max_tokens or pos >= max_ctx or should_stop():
            return
        logits = backend.decode(tok)
        pos += 1
