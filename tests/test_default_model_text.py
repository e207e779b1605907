"""The default model (SmolLM2-135M-Instruct GGUF) end to end through Engine: greedy 32 tokens and their text
identical to transformers loading the same file (dequantized to float32)."""
from __future__ import annotations

import pytest

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]
CHAT = [{"role": "user", "content": "Give me three colours, comma separated."}]
N = 32


@pytest.fixture(scope="module")
def engine(default_model_path):
    from hipengine.engine import Engine

    return Engine.load(default_model_path, device="cpu", max_context=256, progress=False)


@pytest.fixture(scope="module")
def hf(default_model_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    d, f = str(default_model_path.parent), default_model_path.name
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    return model, tok


def _hf_greedy(hf, ids, eos):
    import torch

    model, _ = hf
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False, pad_token_id=eos[0],
                             eos_token_id=list(eos))[0, len(ids):].tolist()
    for i, t in enumerate(out):  # transformers pads/keeps the EOS; Engine stops before it
        if t in eos:
            return out[:i]
    return out


def _generate_recording_ids(engine, prompt):
    """Engine.generate's text, plus the ids the backend produced on the way (one decode pass for both)."""
    backend, seen = engine.backend, []
    inner = type(backend).generate_ids

    def recording(prompt_ids, params, should_stop):
        for t in inner(backend, prompt_ids, params, should_stop):
            seen.append(int(t))
            yield t

    backend.generate_ids = recording
    try:
        text = engine.generate(prompt, max_tokens=N)
    finally:
        del backend.generate_ids
    eos = set(engine.config.eos_token_ids)
    return [t for t in seen if t not in eos], text


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_ids_and_text_match_transformers(engine, hf, prompt):
    _, tok = hf
    ids = engine.tokenizer.encode(prompt)
    assert ids == tok(prompt)["input_ids"]
    eos = sorted(engine.config.eos_token_ids)
    want = _hf_greedy(hf, ids, eos)
    got_ids, text = _generate_recording_ids(engine, prompt)
    assert got_ids == want
    assert text == tok.decode(want, skip_special_tokens=True)


def test_chat_greedy_matches_transformers(engine, hf):
    _, tok = hf
    ids = tok.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert engine.chat_ids(CHAT) == ids
    want = _hf_greedy(hf, ids, sorted(engine.config.eos_token_ids))
    got_ids, text = _generate_recording_ids(engine, ids)
    assert got_ids == want
    assert text == tok.decode(want, skip_special_tokens=True)
