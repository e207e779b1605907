"""Tiny random Hugging Face models for tests (shared by every test module that needs a real checkpoint).

``make_tiny_model(kind, seed)`` builds a transformers model on CPU in float32; ``save_tiny_model(kind, dir)``
writes it with ``save_pretrained`` (safetensors) plus, optionally, a byte-level tokenizer so ``Engine.load``
works on the directory. Weights are drawn larger than transformers' default init (std 0.02) and the norm
weights / biases are perturbed away from 1 / 0: the default init gives near-uniform next-token distributions
whose top-1/top-2 ties would make greedy comparisons flaky, and unit norms would hide a missing norm weight.
"""
from __future__ import annotations

import json
from pathlib import Path

TINY_KINDS = ("llama", "llama3", "mistral", "qwen2", "qwen3", "smollm")

_COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               bos_token_id=1, eos_token_id=2)


def tiny_config(kind: str, **overrides):
    """transformers config object for one tiny model kind."""
    import transformers as tf

    kw = dict(_COMMON)
    if kind == "llama":
        cls = tf.LlamaConfig
        kw.update(rope_theta=10000.0, head_dim=24)  # explicit head_dim != hidden / heads
    elif kind == "llama3":
        cls = tf.LlamaConfig
        kw.update(rope_theta=500000.0, num_attention_heads=8, num_key_value_heads=2,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    elif kind == "smollm":
        cls = tf.LlamaConfig
        kw.update(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16, rope_theta=100000.0,
                  tie_word_embeddings=True, rms_norm_eps=1e-5)
    elif kind == "mistral":
        cls = tf.MistralConfig
        kw.update(sliding_window=8, head_dim=16, rope_theta=1e6)  # window < prompt: the mask is exercised
    elif kind == "qwen2":
        cls = tf.Qwen2Config
        kw.update(tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6, use_sliding_window=False)
    elif kind == "qwen3":
        cls = tf.Qwen3Config
        kw.update(head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}; choose from {TINY_KINDS}")
    kw.update(overrides)
    cfg = cls(**kw)
    cfg._attn_implementation = "eager"  # exact float32 math; SDPA may pick other kernels
    return cfg


def make_tiny_model(kind: str, seed: int = 0, **overrides):
    """A transformers CausalLM in float32, eval mode, with test-friendly (peaked) random weights."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tiny_config(kind, **overrides)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:  # matrices and the embedding: std ~1/sqrt(fan_in)-ish, so logits span several units
                p.copy_(torch.randn_like(p) * (0.6 / p.shape[-1] ** 0.5 if p.dim() == 2 else 1.0))
        emb = model.get_input_embeddings().weight
        emb.copy_(torch.randn_like(emb))  # unit-scale embeddings keep the residual stream O(1)
        head = model.get_output_embeddings().weight
        if head is not emb:  # an untied head gets a larger scale so next-token distributions are peaked
            head.copy_(torch.randn_like(head) * (3.0 / head.shape[-1] ** 0.5))
    model.eval()
    return model


def write_byte_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer (256 byte tokens + ChatML specials, no merges) and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1 (bos), 2 (eos)
    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    byte_chars.sort()
    vocab = {t: i for i, t in enumerate(specials)}
    for c in byte_chars:
        vocab[c] = len(vocab)
    assert len(vocab) <= vocab_size
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(path / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<unk>",
        "chat_template": template, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1))


def save_tiny_model(kind: str, path, seed: int = 0, max_shard_size: str | None = None,
                    tokenizer: bool = True, **overrides):
    """Save a tiny model to ``path`` (safetensors); returns (path, the transformers model)."""
    path = Path(path)
    model = make_tiny_model(kind, seed, **overrides)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kw)
    if tokenizer:
        write_byte_tokenizer(path, model.config.vocab_size)
    return path, model


def _permute_like_llama_cpp(w, n_head: int):
    """What llama.cpp's converter does to llama q/k rows: rotate-half pairs -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_from_hf(model, path, qtype: str = "F32") -> Path:
    """Write a transformers tiny model as a GGUF file the way llama.cpp's converter lays it out (llama q/k rows
    permuted, llama3 scaling as a rope_freqs tensor). Matrices are stored as ``qtype`` (F32, F16, BF16, Q8_0,
    ...; quantized through gguf.quants), norms and biases as F32."""
    import gguf
    import numpy as np

    cfg = model.config
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[cfg.model_type]
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(H)
    w.add_head_count_kv(Hkv)
    w.add_key_length(D)
    w.add_value_length(D)
    rp = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    if cfg.model_type == "mistral" and cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    qt = gguf.GGMLQuantizationType[qtype]

    def add(name, arr, quantize=True):
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if quantize and arr.ndim == 2 and qt != gguf.GGMLQuantizationType.F32:
            if qt == gguf.GGMLQuantizationType.F16:
                w.add_tensor(name, arr.astype(np.float16))
            else:
                w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, arr)

    if rp.get("rope_type") == "llama3":  # llama.cpp stores llama3 scaling as per-frequency divisors
        from hipengine.config import ModelConfig

        kw = dict(family="llama", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                  intermediate_size=cfg.intermediate_size, num_layers=cfg.num_hidden_layers,
                  num_heads=H, num_kv_heads=Hkv, head_dim=D, rope_theta=float(rp["rope_theta"]))
        rs = {k: v for k, v in rp.items() if k != "rope_theta"}
        base, scaled = ModelConfig(**kw).rope_inv_freq(), ModelConfig(**kw, rope_scaling=rs).rope_inv_freq()
        w.add_rope_scaling_orig_ctx_len(int(rs["original_max_position_embeddings"]))
        add("rope_freqs.weight", base / scaled, quantize=False)
    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"])
    perm = arch == "llama"
    names = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
             "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
             "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
             "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
             "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
             "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            key = f"model.layers.{i}.{hf}"
            if key not in sd:
                continue
            arr = sd[key]
            if perm and hf.startswith("self_attn.q_proj"):
                arr = _permute_like_llama_cpp(arr, H)
            elif perm and hf.startswith("self_attn.k_proj"):
                arr = _permute_like_llama_cpp(arr, Hkv)
            add(f"blk.{i}.{gg}", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
