"""ModelConfig from HF config.json (as transformers writes it) and the random-weight presets."""
import json

import numpy as np
import pytest

from hipengine.backend import weight_shapes
from hipengine.config import ModelConfig
from hipengine.errors import ModelError, UnsupportedError
from hipengine.presets import PRESETS, preset_model


# ---- HF config.json ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_configs(tmp_path_factory):
    """kind -> directory holding config.json exactly as transformers writes it."""
    pytest.importorskip("transformers")
    from tiny_models import TINY_KINDS, tiny_config

    out = {}
    for kind in TINY_KINDS:
        d = tmp_path_factory.mktemp(kind)
        tiny_config(kind).save_pretrained(d)
        out[kind] = d
    return out


def test_hf_configs_of_every_family(saved_configs):
    from hipengine.loader.hf import read_hf_config

    c = {k: read_hf_config(d) for k, d in saved_configs.items()}
    assert [c[k].family for k in ("llama", "llama3", "mistral", "qwen2", "qwen3", "smollm")] == \
        ["llama", "llama", "mistral", "qwen2", "qwen3", "llama"]
    assert c["llama"].head_dim == 24 and c["llama"].q_dim == 96 and c["llama"].kv_dim == 48
    assert c["llama3"].rope_scaling["rope_type"] == "llama3" and c["llama3"].rope_scaling["factor"] == 8.0
    assert c["llama3"].rope_theta == 500000.0
    assert c["mistral"].sliding_window == 8
    assert c["qwen2"].attention_bias and c["qwen2"].tie_word_embeddings and c["qwen2"].sliding_window is None
    assert c["qwen3"].qk_norm and not c["qwen3"].attention_bias and c["qwen3"].head_dim == 32
    assert c["smollm"].tie_word_embeddings and c["smollm"].rms_norm_eps == 1e-5
    assert all(x.eos_token_ids == (2,) and x.bos_token_id == 1 for x in c.values())


def test_generation_config_eos_ids_are_merged(saved_configs, tmp_path):
    import shutil

    from hipengine.loader.hf import read_hf_config

    d = tmp_path / "m"
    shutil.copytree(saved_configs["llama3"], d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    assert read_hf_config(d).eos_token_ids == (2, 7, 9)


def test_llama3_inv_freq_matches_transformers(saved_configs):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from hipengine.loader.hf import read_hf_config

    d = saved_configs["llama3"]
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.from_pretrained(d), "cpu")
    got = read_hf_config(d).rope_inv_freq()
    assert np.allclose(got, want.double().numpy(), rtol=1e-6)


def test_config_errors(tmp_path):
    from hipengine.loader.hf import read_hf_config

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}))
    with pytest.raises(ModelError, match="num_attention_heads"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="config.json"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "mlp_bias": True}))
    with pytest.raises(UnsupportedError, match="mlp_bias"):
        read_hf_config(tmp_path)
    with pytest.raises(UnsupportedError, match="yarn"):
        ModelConfig(family="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=4, rope_scaling={"rope_type": "yarn", "factor": 4.0})


# ---- presets ----------------------------------------------------------------------------------------------

def test_published_preset_dims():
    p = PRESETS["llama-3.2-1b"]
    assert (p.hidden_size, p.num_layers, p.num_heads, p.num_kv_heads, p.head_dim, p.intermediate_size,
            p.vocab_size, p.tie_word_embeddings, p.rope_theta, p.rms_norm_eps) == \
        (2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0, 1e-5)
    assert p.rope_scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    # 1.24B parameters; 2.47 GB read per bf16 token (DESIGN.md's roofline figure)
    assert abs(p.num_parameters() - 1.236e9) < 0.01e9
    assert abs(p.decode_bytes_per_token() - 2.47e9) < 0.01e9
    assert abs(PRESETS["llama-3.2-3b"].num_parameters() - 3.21e9) < 0.02e9
    p8 = PRESETS["llama-3.1-8b"]
    assert not p8.tie_word_embeddings and p8.rope_scaling["factor"] == 8.0 and p8.intermediate_size == 14336
    assert abs(p8.num_parameters() - 8.03e9) < 0.02e9
    q = PRESETS["qwen2.5-1.5b"]
    assert q.attention_bias and q.tie_word_embeddings and q.rope_theta == 1e6 and q.rms_norm_eps == 1e-6
    assert abs(q.num_parameters() - 1.54e9) < 0.01e9


def test_preset_weights_are_lazy_deterministic_and_shaped():
    m = preset_model("llama-3.1-8b", seed=3)
    assert m.source == "preset" and m.path is None and m.gguf_reader is None
    shapes = weight_shapes(m.config)
    assert set(m.weights) == set(shapes) and len(m.weights) == len(shapes)
    a = m.weights["layers.31.wk"]  # generating one tensor does not touch the other 8B parameters
    assert a.dtype == np.float32 and a.shape == shapes["layers.31.wk"] == (1024, 4096)
    assert np.array_equal(a, preset_model("llama-3.1-8b", seed=3).weights["layers.31.wk"])
    assert not np.array_equal(a, preset_model("llama-3.1-8b", seed=4).weights["layers.31.wk"])
    assert abs(a.std() * np.sqrt(4096) - 1.0) < 0.01
    with pytest.raises(KeyError):
        m.weights["layers.32.wk"]


def test_tied_preset_head_is_the_embedding():
    m = preset_model("tiny-llama")
    e = m.weights["embed"]
    assert m.weights["lm_head"] is e


def test_preset_errors_and_max_context():
    with pytest.raises(UnsupportedError, match="no-such"):
        preset_model("no-such")
    assert preset_model("llama-3.2-1b", max_context=1024).config.max_position_embeddings == 1024


@pytest.mark.parametrize("name", [n for n in PRESETS if n.startswith("tiny-")])
def test_tiny_presets_run_peaked_on_the_reference(name):
    from hipengine.reference import ReferenceBackend

    be = ReferenceBackend(preset_model(name, seed=1), max_context=128)
    ids = np.random.default_rng(0).integers(0, be.config.vocab_size, 48)
    logits = be.prefill(ids, all_logits=True)  # (48, vocab)
    assert np.isfinite(logits).all()
    top2 = np.sort(logits, axis=-1)[:, -2:]
    gap = top2[:, 1] - top2[:, 0]
    assert np.median(gap) > 0.5  # peaked: far above float32/bf16 rounding of logits of std ~8
    p1 = 1.0 / np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)
    assert np.median(p1) > 0.5
