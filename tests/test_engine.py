"""Engine: stop rules (EOS, stop strings, max_tokens, context, cancel), stats, the lock, loading, tiny-model parity."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from hipengine.backend import Backend
from hipengine.config import ModelConfig
from hipengine.engine import Engine, GenerationStats
from hipengine.errors import HipEngineError, RequestError
from hipengine.tokenizer import Tokenizer

from tiny_models import save_tiny_model, write_byte_tokenizer

VOCAB = 320


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(d, VOCAB)
    return Tokenizer.from_hf_dir(d)


class ScriptedBackend(Backend):
    """Emits a fixed token script (greedy picks it), whatever the prompt; counts decode steps."""

    def __init__(self, script, max_context=256, eos=(2,)):
        self.config = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=8, intermediate_size=8,
                                  num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, eos_token_ids=eos)
        self.max_context = max_context
        self.script = list(script)
        self.i = 0
        self.decodes = 0

    def _next(self):
        x = np.zeros(VOCAB, np.float32)
        x[self.script[min(self.i, len(self.script) - 1)]] = 5.0
        self.i += 1
        return x

    def reset(self):
        self.i = 0

    def prefill(self, ids, all_logits=False):
        if all_logits:
            return np.zeros((len(ids), VOCAB), np.float32)
        return self._next()

    def decode(self, tok):
        self.decodes += 1
        return self._next()


def scripted(byte_tok, text, eos_after=False, **kw):
    script = byte_tok.encode(text, add_special_tokens=False) + ([2] if eos_after else [])
    b = ScriptedBackend(script, **kw)
    return Engine(b.config, byte_tok, b, "scripted", "cpu"), b


def test_stop_string_trimmed(byte_tok):
    eng, _ = scripted(byte_tok, "Hello world. STOP and more text")
    st = GenerationStats()
    pieces = list(eng.stream([5], stop=["STOP"], max_tokens=100, stats=st))
    assert "".join(pieces) == "Hello world. "
    assert st.finish_reason == "stop"
    # Never emitted a partial stop string while streaming: no piece ends with "S", "ST" or "STO".
    assert not any(p.endswith(("S", "ST", "STO")) for p in pieces)


def test_earliest_of_several_stop_strings(byte_tok):
    eng, _ = scripted(byte_tok, "abc\n\nxyz END")
    assert eng.generate([5], stop=["END", "\n\n"], max_tokens=50) == "abc"


def test_held_back_prefix_released_when_it_does_not_match(byte_tok):
    eng, _ = scripted(byte_tok, "abc STx", eos_after=True)
    assert eng.generate([5], stop=["STOP"], max_tokens=50) == "abc STx"
    eng, _ = scripted(byte_tok, "abc ST")
    st = GenerationStats()
    assert eng.generate([5], stop=["STOP"], max_tokens=6, stats=st) == "abc ST"
    assert st.finish_reason == "length"


def test_max_tokens_and_eos(byte_tok):
    eng, b = scripted(byte_tok, "abcdefgh")
    st = GenerationStats()
    assert eng.generate([5], max_tokens=3, stats=st) == "abc"
    assert (st.output_tokens, st.finish_reason, st.prompt_tokens) == (3, "length", 1)
    eng, _ = scripted(byte_tok, "ab", eos_after=True)
    st = GenerationStats()
    assert eng.generate([5], max_tokens=10, stats=st) == "ab"
    assert (st.output_tokens, st.finish_reason) == (2, "stop")
    eng, _ = scripted(byte_tok, "ab", eos_after=True)
    assert eng.generate([5], max_tokens=4, ignore_eos=True) == "ab"  # EOS is special: not shown, not stopped on
    assert eng.generate_ids([5], max_tokens=4, ignore_eos=True)[2] == 2


def test_context_full_finishes_with_length(byte_tok):
    eng, _ = scripted(byte_tok, "abcdefghij", max_context=6)
    st = GenerationStats()
    out = eng.generate([5, 6, 7, 8], max_tokens=100, stats=st)
    assert out == "abc" and st.finish_reason == "length"  # 4 prompt + 2 decoded fill 6; the 3rd is sampled last


def test_prompt_longer_than_context(byte_tok):
    eng, _ = scripted(byte_tok, "a", max_context=8)
    with pytest.raises(RequestError, match="longer than the context"):
        eng.generate(list(range(3, 12)))
    with pytest.raises(RequestError, match="longer than the context"):
        eng.stream("x" * 20)  # raised at the call, before iteration


def test_bad_prompts(byte_tok):
    eng, _ = scripted(byte_tok, "a")
    for bad in ([], "", [VOCAB], [-1], ["x"], 3.5):
        with pytest.raises(RequestError):
            eng.generate(bad)
    with pytest.raises(RequestError, match="top_p"):
        eng.stream([5], top_p=0)


def test_cancel_within_one_token(byte_tok):
    eng, b = scripted(byte_tok, "x" * 200)
    cancel = threading.Event()
    st = GenerationStats()
    n = 0
    for _ in eng.stream([5], cancel=cancel, stats=st, max_tokens=200):
        n += 1
        if n == 3:
            cancel.set()
    assert n == 3 and st.finish_reason == "cancelled"
    assert b.decodes <= 3


def test_abandoned_stream_counts_as_cancelled_and_releases_lock(byte_tok):
    eng, _ = scripted(byte_tok, "y" * 50)
    st = GenerationStats()
    it = eng.stream([5], stats=st, max_tokens=50)
    next(it)
    it.close()
    assert st.finish_reason == "cancelled"
    assert eng.generate([5], max_tokens=2) == "yy"  # the lock was released


def test_one_request_decodes_at_a_time(byte_tok):
    eng, _ = scripted(byte_tok, "z" * 64)
    first = eng.stream([5], max_tokens=20)
    got = [next(first)]
    other = []
    t = threading.Thread(target=lambda: other.append(eng.generate([5], max_tokens=5)))
    t.start()
    t.join(timeout=0.3)
    assert t.is_alive()  # waits for the engine while the first stream is mid-way
    got += list(first)
    t.join(timeout=5)
    assert "".join(got) == "z" * 20 and other == ["z" * 5]


def test_stats_timing(byte_tok):
    eng, _ = scripted(byte_tok, "abcdefgh")
    st = GenerationStats()
    eng.generate([5], max_tokens=8, stats=st)
    assert st.ttft_s > 0 and st.decode_tok_s > 0 and st.output_tokens == 8


# ---- real tiny models -------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_smollm")
    _, model = save_tiny_model("smollm", d, seed=3)
    return d, model


def test_greedy_matches_transformers(tiny_dir):
    import torch

    d, model = tiny_dir
    eng = Engine.load(d, device="cpu")
    assert eng.device == "cpu" and eng.tokenizer.has_text
    for prompt in ([1, 40, 41, 42], [1, 100, 7, 250, 33, 33]):
        ours = eng.generate_ids(prompt, max_tokens=32, ignore_eos=True)
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                                 pad_token_id=0)[0, len(prompt):].tolist()
        assert ours == ref
    np.testing.assert_allclose(eng.logits([1, 40, 41]),
                               model(torch.tensor([[1, 40, 41]])).logits[0].detach().numpy(), rtol=1e-4, atol=1e-4)


def test_engine_seeded_sampling_and_chat(tiny_dir):
    d, _ = tiny_dir
    eng = Engine.load(d, device="cpu")
    a = eng.generate("hi", temperature=1.5, seed=11, max_tokens=12, ignore_eos=True)
    b = eng.generate("hi", temperature=1.5, seed=11, max_tokens=12, ignore_eos=True)
    assert a == b
    assert eng.render_chat([{"role": "user", "content": "q"}]) == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    assert isinstance(eng.chat([{"role": "user", "content": "q"}], max_tokens=4), str)
    pieces = list(eng.chat([{"role": "user", "content": "q"}], stream=True, max_tokens=4))
    assert all(isinstance(p, str) for p in pieces)
    assert 2 in eng.config.eos_token_ids


def test_load_errors(tiny_dir, tmp_path):
    d, _ = tiny_dir
    with pytest.raises(RequestError, match="tp"):
        Engine.load(d, device="cpu", tp=2)
    with pytest.raises(RequestError, match="device"):
        Engine.load(d, device="tpu")
    with pytest.raises(HipEngineError):
        Engine.load(tmp_path / "missing")
    eng = Engine.load(d, device="cpu", max_context=16)
    assert eng.backend.max_context == 16
    with pytest.raises(RequestError, match="longer than the context"):
        eng.generate(list(range(3, 30)))


def test_gpu_request_without_gpu_is_a_clear_error(tiny_dir):
    from hipengine.engine import _gpu_count

    if _gpu_count() > 0:
        pytest.skip("a GPU is present")
    d, _ = tiny_dir
    with pytest.raises(HipEngineError):
        Engine.load(d, device="gpu")


def test_preset_takes_token_ids():
    presets = pytest.importorskip("hipengine.presets")
    tiny = [n for n, c in presets.PRESETS.items() if c.num_parameters() < 5_000_000]
    if not tiny:
        pytest.skip("no tiny preset shape")
    eng = Engine.load(shape=tiny[0], device="cpu", max_context=64)
    out = eng.generate([1, 2, 3], max_tokens=4, ignore_eos=True)
    assert out.count("<") == 4
    with pytest.raises(RequestError, match="token ids"):
        eng.generate("text prompt")


def test_gpu_default_is_the_monokernel_with_a_per_op_fallback(tiny_dir, monkeypatch, capsys):
    """Engine.load(device="gpu") asks for the monokernel; a model it cannot run (UnsupportedError) gets the
    per-op path with a one-line note, and an explicit monokernel=True/False is passed through unchanged."""
    import hipengine.gpu.executor as ex
    from hipengine.errors import UnsupportedError

    calls = []

    class FakeGpu:
        def __init__(self, loaded, max_context=None, tp=1, monokernel=False, allreduce="custom", device=0):
            calls.append(monokernel)
            if monokernel:
                raise UnsupportedError("the monokernel needs one weight dtype")
            self.config = loaded.config

    monkeypatch.setattr(ex, "GpuBackend", FakeGpu)
    d, _ = tiny_dir
    Engine.load(d, device="gpu")
    assert calls == [True, False]
    assert "note: per-op decode (the monokernel needs one weight dtype)" in capsys.readouterr().err
    calls.clear()
    Engine.load(d, device="gpu", monokernel=False)
    assert calls == [False]
    calls.clear()
    with pytest.raises(UnsupportedError):
        Engine.load(d, device="gpu", monokernel=True)
    assert calls == [True]
