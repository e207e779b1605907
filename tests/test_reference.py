"""numpy reference vs transformers on tiny random models of every supported architecture."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hipengine.loader import load_model  # noqa: E402
from hipengine.reference import ReferenceBackend, apply_rope, rope_tables  # noqa: E402
from tiny_models import TINY_KINDS, save_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """kind -> (LoadedModel, transformers model); llama is saved sharded so the index path runs."""
    out = {}
    for kind in TINY_KINDS:
        d = tmp_path_factory.mktemp(kind)
        path, model = save_tiny_model(kind, d, seed=hash(kind) % 1000,
                                      max_shard_size="200KB" if kind == "llama" else None)
        out[kind] = (load_model(path, progress=False), model)
    return out


def _ids(n, vocab, seed):
    return np.random.default_rng(seed).integers(3, vocab, size=n)


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_logits_match_transformers(tiny, kind):
    lm, model = tiny[kind]
    ids = _ids(24, lm.config.vocab_size, 1)
    with torch.no_grad():
        ref = model(torch.tensor(ids)[None]).logits[0].numpy()  # (24, vocab)
    be = ReferenceBackend(lm)
    pre = be.prefill(ids[:20], all_logits=True)  # (20, vocab)
    dec = [be.decode(int(t)) for t in ids[20:]]  # 4 x (vocab,)
    ours = np.vstack([pre] + dec)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    assert _rel(ours, ref) < 1e-4
    # last-position logits of a plain prefill equal the all-logits row
    be.reset()
    assert _rel(be.prefill(ids[:20]), pre[-1]) < 1e-5


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_greedy_32_tokens_match_generate(tiny, kind):
    lm, model = tiny[kind]
    prompt = _ids(7, lm.config.vocab_size, 2)
    with torch.no_grad():
        want = model.generate(torch.tensor(prompt)[None], max_new_tokens=32, min_new_tokens=32,
                              do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    be = ReferenceBackend(lm)
    logits, got = be.prefill(prompt), []
    for _ in range(32):
        got.append(int(np.argmax(logits)))
        logits = be.decode(got[-1])
    assert got == want


def test_tied_embedding_is_one_object(tiny):
    lm, _ = tiny["smollm"]
    assert lm.config.tie_word_embeddings and lm.weights["lm_head"] is lm.weights["embed"]
    lm, _ = tiny["qwen3"]
    assert lm.weights["lm_head"] is not lm.weights["embed"]


def test_context_limit_and_reset(tiny):
    from hipengine.errors import RequestError

    lm, _ = tiny["llama"]
    be = ReferenceBackend(lm, max_context=16)
    assert be.max_context == 16 and be.kv_cache.shape == (2, 2, 16, lm.config.kv_dim)
    with pytest.raises(RequestError):
        be.prefill(np.arange(3, 20))
    be.reset()
    be.prefill(np.arange(3, 18))
    be.decode(5)
    with pytest.raises(RequestError):
        be.decode(5)
    with pytest.raises(RequestError):
        ReferenceBackend(lm).prefill(np.array([], dtype=np.int64))
    assert ReferenceBackend(lm).max_context == min(lm.config.max_position_embeddings, 4096)


def test_rope_is_rotate_half_with_config_frequencies(tiny):
    lm, _ = tiny["llama3"]
    cfg = lm.config
    cos, sin = rope_tables(cfg, 40)
    x = np.random.default_rng(0).standard_normal((40, 1, cfg.head_dim)).astype(np.float32)
    y = apply_rope(x, cos, sin)
    half = cfg.head_dim // 2
    # pair j is (x[j], x[j + D/2]) rotated by angle pos * inv_freq[j]; rotations preserve pair norms
    ang = np.arange(40)[:, None] * cfg.rope_inv_freq()[None]
    want0 = x[:, 0, :half] * np.cos(ang) - x[:, 0, half:] * np.sin(ang)
    assert np.allclose(y[:, 0, :half], want0, atol=1e-5)


def test_chunked_prefill_and_sliding_window_decode_agree(monkeypatch):
    """Prefill in chunks, in one piece, or token by token gives the same logits (window 16 < 100 tokens)."""
    import hipengine.reference as ref
    from hipengine.presets import preset_model

    be = ReferenceBackend(preset_model("tiny-mistral"), max_context=128)
    ids = _ids(100, be.config.vocab_size, 4)
    whole = be.prefill(ids, all_logits=True)  # (100, vocab)
    monkeypatch.setattr(ref, "PREFILL_CHUNK", 7)
    be.reset()
    assert _rel(be.prefill(ids, all_logits=True), whole) < 1e-5
    be.reset()
    steps = np.vstack([be.prefill(ids[:40], all_logits=True)] + [be.decode(int(t)) for t in ids[40:]])
    assert _rel(steps, whole) < 1e-5
