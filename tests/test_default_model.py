"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF): our loader + reference vs transformers on the same file.

transformers dequantizes the GGUF itself (and un-permutes q/k itself), so agreement checks our metadata
parsing, dequantization and q/k layout fix-up independently. Loading through transformers takes most of this
module's time, so each side is loaded once per module. Greedy generation on this model is checked through
the Engine in test_default_model_text.py.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWrite a Python function that reverses a list.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def ours(default_model_path):
    from hipengine.loader import load_model

    return load_model(default_model_path, progress=False)


@pytest.fixture(scope="module")
def hf(default_model_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    d, f = str(default_model_path.parent), default_model_path.name
    cfg = AutoConfig.from_pretrained(d, gguf_file=f)  # parsed once, shared: each GGUF parse takes seconds
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f, config=cfg)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, config=cfg, dtype=torch.float32)
    model.eval()
    return tok, model


def test_config_from_gguf_metadata(ours):
    c = ours.config
    assert ours.source == "gguf" and ours.gguf_reader is not None
    assert (c.family, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == \
        ("llama", 30, 576, 9, 3, 64)
    assert (c.intermediate_size, c.vocab_size, c.rope_theta, c.tie_word_embeddings) == (1536, 49152, 1e5, True)
    assert abs(c.rms_norm_eps - 1e-5) < 1e-9 and c.bos_token_id == 1 and 2 in c.eos_token_ids
    assert ours.weights["lm_head"] is ours.weights["embed"]
    assert all(w.dtype == np.float32 for w in ours.weights.values())


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers_gguf(ours, hf, prompt):
    from hipengine.reference import ReferenceBackend

    tok, model = hf
    ids = tok(prompt, return_tensors="pt").input_ids  # (1, T)
    with torch.no_grad():
        ref = model(ids).logits[0].numpy()  # (T, vocab)
    got = ReferenceBackend(ours).prefill(ids[0].numpy(), all_logits=True)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < 1e-3, rel

