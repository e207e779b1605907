"""Tensor-parallel communication: the shard plan, the custom all-reduce (host side) and NCCL/RCCL.

Submodules import their GPU dependencies lazily, so ``ShardPlan`` and the protocol model work on a CPU-only
machine."""
from .shard import RankShard, ShardPlan, merge_argmax, merge_topk, valid_tp

__all__ = ["RankShard", "ShardPlan", "merge_argmax", "merge_topk", "valid_tp"]
