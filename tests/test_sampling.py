"""Host sampling: distributions, seeds, penalties, validation, and the host generation loop."""
from __future__ import annotations

import numpy as np
import pytest

from hipengine.backend import SamplingParams
from hipengine.config import ModelConfig
from hipengine.errors import RequestError
from hipengine.sampling import Sampler, apply_repetition_penalty, host_generate, make_params, probabilities


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_greedy_is_argmax():
    logits = np.array([0.1, 3.0, 2.9, -1.0], np.float32)
    assert Sampler(make_params())(logits) == 1


def test_temperature_distribution_matches_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=8).astype(np.float32)
    p = make_params(temperature=0.7, seed=123)
    s = Sampler(p)
    n = 20000
    counts = np.bincount([s(logits) for _ in range(n)], minlength=8) / n
    want = _softmax(logits.astype(np.float64) / 0.7)
    assert np.abs(counts - want).max() < 0.015
    np.testing.assert_allclose(probabilities(logits, p), want, rtol=1e-12)


def test_top_k_top_p_min_p_masks():
    logits = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    pk = probabilities(logits, make_params(temperature=1.0, top_k=2))
    np.testing.assert_allclose(pk, [0.5 / 0.7, 0.2 / 0.7, 0, 0, 0], atol=1e-12)
    # top_p 0.8: 0.5 + 0.2 = 0.7 < 0.8, so the 0.15 token is still needed; the rest go.
    pp = probabilities(logits, make_params(temperature=1.0, top_p=0.8))
    np.testing.assert_allclose(pp, np.array([0.5, 0.2, 0.15, 0, 0]) / 0.85, atol=1e-12)
    # top_p exactly at a boundary keeps no extra token.
    pp = probabilities(logits, make_params(temperature=1.0, top_p=0.7))
    assert (pp > 0).sum() == 2
    pm = probabilities(logits, make_params(temperature=1.0, min_p=0.3))  # keep p >= 0.15
    np.testing.assert_allclose(pm, np.array([0.5, 0.2, 0.15, 0, 0]) / 0.85, atol=1e-12)
    # Samples never land on a masked token.
    s = Sampler(make_params(temperature=1.0, top_k=2, seed=1))
    assert {s(logits) for _ in range(500)} <= {0, 1}


def test_tiny_top_p_is_greedy():
    logits = np.array([1.0, 2.0, 0.5])
    s = Sampler(make_params(temperature=5.0, top_p=1e-6, seed=0))
    assert {s(logits) for _ in range(100)} == {1}


def test_seed_reproducible_and_different_seeds_differ():
    logits = np.zeros(1000, np.float32)
    a = [Sampler(make_params(temperature=1.0, seed=7))(logits) for _ in range(3)]
    s1, s2, s3 = (Sampler(make_params(temperature=1.0, seed=k)) for k in (7, 7, 8))
    seq1, seq2, seq3 = ([s(logits) for _ in range(50)] for s in (s1, s2, s3))
    assert seq1 == seq2 and seq1 != seq3 and len(set(a)) == 1


def test_repetition_penalty():
    logits = np.array([2.0, -1.0, 1.5, 0.0], np.float32)
    out = apply_repetition_penalty(logits, np.array([0, 1]), 2.0)
    np.testing.assert_allclose(out, [1.0, -2.0, 1.5, 0.0])
    # Greedy with a penalty avoids a token already in the prompt (HF semantics).
    s = Sampler(make_params(repetition_penalty=2.0), prompt_ids=[0])
    assert s(logits) == 2
    # ...and the sampled token joins the history: 2 is now penalised too (1.5 -> 0.75 < 1.6 / 2).
    assert 2 in s.seen
    assert s(np.array([1.6, 0.0, 1.5, 0.0], np.float32)) == 0


@pytest.mark.parametrize("kw,msg", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=1.5), "top_k"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.1), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(seed=-1), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(bogus=1), "bogus"),
])
def test_validation(kw, msg):
    with pytest.raises(RequestError, match=msg):
        make_params(**kw)


def test_make_params_defaults_and_stop_string():
    p = make_params(temperature=None, stop="\n")
    assert p.temperature == SamplingParams().temperature and p.stop == ("\n",)


class _CountingBackend:
    """Logits that always favour (last token + 1) % vocab; records calls."""

    def __init__(self, vocab=16, max_context=64, eos=(15,)):
        self.config = ModelConfig(family="llama", vocab_size=vocab, hidden_size=8, intermediate_size=8,
                                  num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, eos_token_ids=eos)
        self.max_context = max_context
        self.calls = []

    def _logits(self, last):
        x = np.zeros(self.config.vocab_size, np.float32)
        x[(int(last) + 1) % self.config.vocab_size] = 10.0
        return x

    def reset(self):
        self.calls.append("reset")

    def prefill(self, ids, all_logits=False):
        self.calls.append(("prefill", len(ids)))
        return self._logits(ids[-1])

    def decode(self, tok):
        self.calls.append(("decode", tok))
        return self._logits(tok)


def test_host_generate_max_tokens_eos_context():
    b = _CountingBackend()
    assert list(host_generate(b, [3], make_params(max_tokens=4))) == [4, 5, 6, 7]
    assert b.calls.count(("decode", 7)) == 0  # no decode after the last token
    assert list(host_generate(b, [12], make_params(max_tokens=10))) == [13, 14, 15]  # EOS yielded, then stop
    assert list(host_generate(b, [12], make_params(max_tokens=5, ignore_eos=True))) == [13, 14, 15, 0, 1]
    b = _CountingBackend(max_context=6)
    assert len(list(host_generate(b, [0, 1, 2, 3], make_params(max_tokens=50)))) == 3  # 4 + 2 decoded = 6
    with pytest.raises(RequestError, match="longer than the context"):
        list(host_generate(b, list(range(7)), make_params()))


def test_host_generate_should_stop():
    b = _CountingBackend()
    n = {"k": 0}

    def stop():
        n["k"] += 1
        return n["k"] > 3

    out = list(host_generate(b, [0], make_params(max_tokens=50), stop))
    assert 1 <= len(out) <= 3
