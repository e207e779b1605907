"""Tensor-parallel shard plan: which slice of every canonical weight each rank holds.

Megatron-style split, chosen so that each transformer block needs exactly two all-reduces (after the
O-projection and after the down-projection) and the LM head needs only a tiny candidate exchange:

* attention by heads: rank r owns a contiguous run of query heads and the KV heads they read. When there
  are at least as many KV heads as ranks, KV heads are split too; when there are fewer, each KV head is
  replicated on ``tp / num_kv_heads`` consecutive ranks, and those ranks split that head's query group.
  ``wq/wk/wv`` (+ biases) are sliced by rows, ``wo`` by columns -> each rank's O-projection output is a
  partial sum over its heads.
* MLP: ``w_gate``/``w_up`` by rows (output columns of x @ W.T), ``w_down`` by columns -> partial sums.
* LM head vocab-parallel: rank r owns a contiguous vocabulary range and picks its local best (or a small
  top-k candidate set); ranks exchange only (logit, index) pairs (``merge_argmax`` / ``merge_topk``).
* embedding, norms, q_norm/k_norm: replicated (the embedding row read per token is negligible).

Ranks hold contiguous ranges so that the slices are plain row/column views of the canonical arrays.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ..config import ModelConfig
from ..errors import UnsupportedError

SUPPORTED_TP = (1, 2, 4, 8)


@dataclass(frozen=True)
class RankShard:
    """What one rank owns. Ranges are half-open [start, stop) in units of heads / rows / tokens."""

    rank: int
    q_heads: tuple[int, int]  # query heads of this rank
    kv_heads: tuple[int, int]  # KV heads this rank holds (one replicated head when kv < tp)
    ffn: tuple[int, int]  # rows of w_gate/w_up = columns of w_down
    vocab: tuple[int, int]  # LM-head rows (token ids) this rank scores
    head_dim: int

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def q_rows(self) -> slice:
        return slice(self.q_heads[0] * self.head_dim, self.q_heads[1] * self.head_dim)

    @property
    def kv_rows(self) -> slice:
        return slice(self.kv_heads[0] * self.head_dim, self.kv_heads[1] * self.head_dim)

    @property
    def ffn_rows(self) -> slice:
        return slice(*self.ffn)

    @property
    def vocab_rows(self) -> slice:
        return slice(*self.vocab)

    @property
    def intermediate_size(self) -> int:
        return self.ffn[1] - self.ffn[0]

    @property
    def vocab_size(self) -> int:
        return self.vocab[1] - self.vocab[0]


def valid_tp(config: ModelConfig, limit: int = 8) -> list[int]:
    """Every tensor-parallel degree up to ``limit`` that ShardPlan can split ``config`` into."""
    out = []
    for tp in range(1, limit + 1):
        try:
            _check(config, tp)
            out.append(tp)
        except UnsupportedError:
            pass
    return out


def _check(cfg: ModelConfig, tp: int) -> None:
    nh, nkv, f = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if not isinstance(tp, int) or tp < 1:
        raise UnsupportedError(f"tensor-parallel degree must be a positive integer, got {tp!r}")
    if nh % tp:
        raise UnsupportedError(f"tp={tp} cannot split {nh} attention heads evenly")
    if nkv % tp and tp % nkv:
        # e.g. 6 KV heads on 4 ranks: a rank would need parts of two KV heads' query groups.
        raise UnsupportedError(f"tp={tp} cannot split {nkv} KV heads (need kv_heads % tp == 0 or tp % kv_heads == 0)")
    if f % tp:
        raise UnsupportedError(f"tp={tp} cannot split intermediate size {f} evenly")


class ShardPlan:
    """Per-rank slices of a model for tensor parallelism of degree ``tp``.

    ``ShardPlan(cfg, tp)`` raises one-line ``UnsupportedError`` for shapes it cannot split (the default
    SmolLM2-135M has 9 heads / 3 KV heads: only tp 1 and 3 split it, so TP=2 is refused)."""

    def __init__(self, config: ModelConfig, tp: int):
        try:
            _check(config, tp)
        except UnsupportedError as e:
            ok = [t for t in valid_tp(config) if t > 1]
            hint = f"; this model splits at tp in {ok}" if ok else "; this model runs on one GPU only (tp=1)"
            name = config.name or f"{config.num_heads}-head model"
            raise UnsupportedError(f"{name}: {e}{hint}") from None
        self.config = config
        self.tp = tp
        nh, nkv, hd = config.num_heads, config.num_kv_heads, config.head_dim
        hp = nh // tp
        fp = config.intermediate_size // tp
        # Vocab need not divide tp (128256 / 8 does, 151936 / 8 does, odd vocabs would not): ceil-sized
        # contiguous ranges, the last rank gets the remainder.
        vp = -(-config.vocab_size // tp)
        group = nh // nkv  # query heads per KV head (GQA)
        shards = []
        for r in range(tp):
            q0, q1 = r * hp, (r + 1) * hp
            if nkv >= tp:
                kvp = nkv // tp
                kv = (r * kvp, (r + 1) * kvp)
            else:
                # tp % nkv == 0 and nh % tp == 0 => hp divides group, so all of this rank's query heads
                # read the same KV head: q0 // group.
                kv = (q0 // group, q0 // group + 1)
            assert (q1 - 1) // group < kv[1] and q0 // group >= kv[0]
            shards.append(RankShard(rank=r, q_heads=(q0, q1), kv_heads=kv, ffn=(r * fp, (r + 1) * fp),
                                    vocab=(min(r * vp, config.vocab_size), min((r + 1) * vp, config.vocab_size)),
                                    head_dim=hd))
        self.ranks: tuple[RankShard, ...] = tuple(shards)

    def __repr__(self) -> str:
        return f"ShardPlan(tp={self.tp}, heads/rank={self.ranks[0].num_heads}, kv/rank={self.ranks[0].num_kv_heads})"

    @property
    def kv_replicated(self) -> bool:
        return self.config.num_kv_heads < self.tp

    def rank_config(self, rank: int) -> ModelConfig:
        """The shape one rank computes: its heads, its FFN columns, its vocabulary slice."""
        s = self.ranks[rank]
        return self.config.replace(num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
                                   intermediate_size=s.intermediate_size, vocab_size=max(s.vocab_size, 1))

    def slice_of(self, name: str, rank: int) -> tuple[slice, ...]:
        """Index tuple selecting rank's part of canonical weight ``name`` (``()`` = replicated)."""
        s = self.ranks[rank]
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("wq", "bq"):
            return (s.q_rows,)
        if leaf in ("wk", "wv", "bk", "bv"):
            return (s.kv_rows,)
        if leaf == "wo":
            return (slice(None), s.q_rows)
        if leaf in ("w_gate", "w_up"):
            return (s.ffn_rows,)
        if leaf == "w_down":
            return (slice(None), s.ffn_rows)
        if name == "lm_head":
            return (s.vocab_rows,)
        # embed, attn_norm, ffn_norm, final_norm, q_norm, k_norm
        return ()

    def shard_weights(self, weights: Mapping[str, np.ndarray], rank: int) -> dict[str, np.ndarray]:
        """Rank's weights: views into the canonical arrays (no copy); the caller packs/uploads them.
        Reads names lazily from ``weights`` so a lazy mapping materialises each tensor once per call."""
        return {name: weights[name][self.slice_of(name, rank)] for name in weights}

    def rank_bytes(self, rank: int, bytes_per_weight: float = 2.0) -> float:
        """Weight bytes rank reads per decode step (embedding row ignored; the LM head counted once)."""
        return self.rank_config(rank).decode_bytes_per_token(bytes_per_weight)


# ---- vocab-parallel selection ---------------------------------------------------------------------
# Each rank reduces its logits slice to a few (value, global index) pairs; only those cross GPUs.
# Ties resolve to the smallest index, exactly like np.argmax over the full vocabulary, so TP=N greedy
# decoding picks the same token as TP=1 given the same logits.

def local_argmax(logits: np.ndarray, offset: int) -> tuple[float, int]:
    """(max logit, global index) of one rank's slice."""
    i = int(np.argmax(logits))
    return float(logits[i]), offset + i


def merge_argmax(candidates: list[tuple[float, int]]) -> int:
    """Global argmax from per-rank (value, index) pairs; ties -> smallest index."""
    best_v, best_i = candidates[0]
    for v, i in candidates[1:]:
        if v > best_v or (v == best_v and i < best_i):
            best_v, best_i = v, i
    return best_i


def local_topk(logits: np.ndarray, offset: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """k best (values, global indices) of one slice, sorted by value desc then index asc."""
    k = min(k, logits.shape[0])
    idx = np.lexsort((np.arange(logits.shape[0]), -logits))[:k]
    return logits[idx], idx.astype(np.int64) + offset


def merge_topk(parts: list[tuple[np.ndarray, np.ndarray]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Global top-k from per-rank top-k lists (each rank's top-k is a superset of its share)."""
    v = np.concatenate([p[0] for p in parts])
    i = np.concatenate([p[1] for p in parts])
    order = np.lexsort((i, -v))[:k]
    return v[order], i[order]


def local_logsumexp(logits: np.ndarray) -> tuple[float, float]:
    """(max, sum exp(x - max)) of one slice: merged by ``merge_logsumexp`` for full-vocab softmax
    normalisers (temperature sampling without top-k) at the cost of two floats per rank."""
    m = float(np.max(logits))
    return m, float(np.sum(np.exp(logits.astype(np.float64) - m)))


def merge_logsumexp(parts: list[tuple[float, float]]) -> float:
    m = max(p[0] for p in parts)
    return m + float(np.log(sum(s * np.exp(pm - m) for pm, s in parts)))
