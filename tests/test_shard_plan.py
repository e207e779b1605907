"""ShardPlan: the sharded forward (sum of per-rank partial outputs) equals the unsharded one, in float64.

The tiny forward here is written in numpy for this test (prefill of a few tokens, causal GQA attention,
rotate-half RoPE, SwiGLU); it is run once on the whole model and once per rank on ``shard_weights`` slices
with each all-reduce replaced by the sum of the ranks' partials in rank order."""
import numpy as np
import pytest

from hipengine.backend import weight_shapes
from hipengine.comm.shard import (ShardPlan, local_argmax, local_logsumexp, local_topk, merge_argmax,
                                  merge_logsumexp, merge_topk, valid_tp)
from hipengine.config import ModelConfig
from hipengine.errors import UnsupportedError


def tiny(nh=8, nkv=2, bias=False, qk_norm=False, vocab=203, tied=True):
    return ModelConfig(family="qwen3" if qk_norm else ("qwen2" if bias else "llama"), vocab_size=vocab,
                       hidden_size=32, intermediate_size=48, num_layers=2, num_heads=nh, num_kv_heads=nkv,
                       head_dim=8, rope_theta=10000.0, tie_word_embeddings=tied, attention_bias=bias,
                       qk_norm=qk_norm)


def random_weights(cfg, seed=0):
    rng = np.random.default_rng(seed)
    w = {}
    for name, shape in weight_shapes(cfg).items():
        if name.endswith("norm"):
            w[name] = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            w[name] = rng.standard_normal(shape) / np.sqrt(shape[-1])
    if cfg.tie_word_embeddings:
        w["lm_head"] = w["embed"]
    return w


def rmsnorm(x, g, eps):  # x (T, d), g (d,)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g


def rope(x, pos, inv):  # x (T, heads, hd) rotate-half form
    ang = pos[:, None] * inv[None, :]  # (T, hd/2)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention_partial(cfg, w, i, x):
    """Attention block of layer i on (T, hidden) -> O-projection output (T, hidden) of the heads in w."""
    p, hd, T = f"layers.{i}.", cfg.head_dim, x.shape[0]
    nh, nkv = w[p + "wq"].shape[0] // hd, w[p + "wk"].shape[0] // hd
    xn = rmsnorm(x, w[p + "attn_norm"], cfg.rms_norm_eps)
    q, k, v = xn @ w[p + "wq"].T, xn @ w[p + "wk"].T, xn @ w[p + "wv"].T
    if cfg.attention_bias:
        q, k, v = q + w[p + "bq"], k + w[p + "bk"], v + w[p + "bv"]
    q, k, v = q.reshape(T, nh, hd), k.reshape(T, nkv, hd), v.reshape(T, nkv, hd)
    if cfg.qk_norm:
        q, k = rmsnorm(q, w[p + "q_norm"], cfg.rms_norm_eps), rmsnorm(k, w[p + "k_norm"], cfg.rms_norm_eps)
    pos = np.arange(T, dtype=np.float64)
    q, k = rope(q, pos, cfg.rope_inv_freq()), rope(k, pos, cfg.rope_inv_freq())
    group = nh // nkv
    out = np.empty((T, nh, hd))
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for h in range(nh):
        s = q[:, h] @ k[:, h // group].T / np.sqrt(hd) + mask
        pr = np.exp(s - s.max(-1, keepdims=True))
        out[:, h] = (pr / pr.sum(-1, keepdims=True)) @ v[:, h // group]
    return out.reshape(T, nh * hd) @ w[p + "wo"].T


def mlp_partial(cfg, w, i, x):
    p = f"layers.{i}."
    xn = rmsnorm(x, w[p + "ffn_norm"], cfg.rms_norm_eps)
    g, u = xn @ w[p + "w_gate"].T, xn @ w[p + "w_up"].T
    return (g / (1 + np.exp(-g)) * u) @ w[p + "w_down"].T


def forward(cfg, ws, tokens):
    """ws: list of per-rank weight dicts (one entry = unsharded). Returns per-rank logit slices."""
    x = ws[0]["embed"][tokens]  # embedding replicated: every rank gathers the same rows
    for i in range(cfg.num_layers):
        x = x + sum(attention_partial(cfg, w, i, x) for w in ws)  # all-reduce, fixed rank order
        x = x + sum(mlp_partial(cfg, w, i, x) for w in ws)
    xn = rmsnorm(x, ws[0]["final_norm"], cfg.rms_norm_eps)
    return [xn @ w["lm_head"].T for w in ws]


CONFIGS = {
    "gqa-8/2": dict(nh=8, nkv=2),  # tp 4, 8: KV heads replicated
    "mha-8/8": dict(nh=8, nkv=8),
    "mqa-8/1": dict(nh=8, nkv=1),
    "qwen2-bias": dict(nh=8, nkv=4, bias=True, tied=False, vocab=256),
    "qwen3-qknorm": dict(nh=8, nkv=2, qk_norm=True),
}


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_sharded_forward_equals_unsharded(name, tp):
    cfg = tiny(**CONFIGS[name])
    w = random_weights(cfg)
    tokens = np.array([3, 17, 5, 200, 42])
    full = forward(cfg, [w], tokens)[0]
    plan = ShardPlan(cfg, tp)
    ws = [plan.shard_weights(w, r) for r in range(tp)]
    parts = forward(cfg, ws, tokens)
    np.testing.assert_allclose(np.concatenate(parts, axis=1), full, rtol=1e-12, atol=1e-12)
    # vocab-parallel greedy: only (value, index) per rank crosses GPUs
    for t in range(len(tokens)):
        cands = [local_argmax(parts[r][t], plan.ranks[r].vocab[0]) for r in range(tp)]
        assert merge_argmax(cands) == int(np.argmax(full[t]))
        v, idx = merge_topk([local_topk(parts[r][t], plan.ranks[r].vocab[0], 5) for r in range(tp)], 5)
        ref = np.lexsort((np.arange(full.shape[1]), -full[t]))[:5]
        assert list(idx) == list(ref)
        lse = merge_logsumexp([local_logsumexp(parts[r][t]) for r in range(tp)])
        m = full[t].max()
        assert lse == pytest.approx(m + np.log(np.exp(full[t] - m).sum()), rel=1e-12)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_rank_shapes_cover_model(tp):
    cfg = tiny(nh=8, nkv=2, vocab=203)
    plan = ShardPlan(cfg, tp)
    w = random_weights(cfg)
    group = cfg.num_heads // cfg.num_kv_heads
    assert sum(s.num_heads for s in plan.ranks) == cfg.num_heads
    assert sum(s.intermediate_size for s in plan.ranks) == cfg.intermediate_size
    assert sum(s.vocab_size for s in plan.ranks) == cfg.vocab_size  # 203 is not a multiple of 2/4/8
    assert plan.kv_replicated == (tp > cfg.num_kv_heads)
    for s in plan.ranks:
        rc = plan.rank_config(s.rank)
        # every query head of the rank reads a KV head the rank holds
        assert all(s.kv_heads[0] <= h // group < s.kv_heads[1] for h in range(*s.q_heads))
        sw = plan.shard_weights(w, s.rank)
        assert sw["layers.0.wq"].shape == (rc.q_dim, cfg.hidden_size)
        assert sw["layers.0.wk"].shape == (rc.kv_dim, cfg.hidden_size)
        assert sw["layers.0.wo"].shape == (cfg.hidden_size, rc.q_dim)
        assert sw["layers.1.w_down"].shape == (cfg.hidden_size, rc.intermediate_size)
        assert sw["embed"] is w["embed"] or sw["embed"].shape == w["embed"].shape
        assert np.shares_memory(sw["layers.0.wq"], w["layers.0.wq"])  # views, no copies
    # per-rank bytes shrink tp-fold while KV heads split (replicated KV heads and norms cost a little more)
    total = ShardPlan(cfg, 1).rank_bytes(0)
    if tp <= cfg.num_kv_heads:
        assert plan.rank_bytes(0) <= total / tp + 4 * cfg.hidden_size * cfg.num_layers * 2
    assert plan.rank_bytes(0) < total or tp == 1


def test_default_model_shape_refused_at_tp2():
    smol = ModelConfig(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                       num_heads=9, num_kv_heads=3, head_dim=64, name="SmolLM2-135M")
    with pytest.raises(UnsupportedError) as e:
        ShardPlan(smol, 2)
    msg = str(e.value)
    assert "\n" not in msg and "9 attention heads" in msg and "[3]" in msg
    assert valid_tp(smol) == [1, 3]
    ShardPlan(smol, 3)  # 3 heads + 1 KV head per rank works


def test_unsplittable_kv_and_ffn():
    with pytest.raises(UnsupportedError, match="KV heads"):
        ShardPlan(tiny(nh=12, nkv=6), 4)  # 6 KV heads on 4 ranks
    with pytest.raises(UnsupportedError, match="intermediate"):
        ShardPlan(tiny().replace(intermediate_size=50), 4)
    with pytest.raises(UnsupportedError):
        ShardPlan(tiny(), 0)
