"""The gradient norm with tensor (model) parallelism beside the wrapper.

A job with Megatron-style tensor-parallel layers wraps its module over the
data-parallel group; each tensor-parallel rank then holds other shards of some
parameters, and replicas of the rest (a LayerNorm, a bias added after the
row-parallel all-reduce). Clipping needs one norm over the whole model, as
Megatron takes it: the squares of every shard, and of each replicated parameter
once. With ``ShardedOptimizer(..., model_parallel_group=tp_group)`` the norm's
sum over the wrapper's group is summed over ``tp_group`` too, and a parameter
counts on every rank of that group only if it is marked as Megatron marks its
sharded ones (``param.tensor_model_parallel = True``); the others count on the
group's first rank alone. Infs and NaNs count wherever they are (Megatron's
``found_inf``): only the squares leave the replicas out. With pipeline stages
too, ``pipeline_parallel_group=pp_group`` (the ranks holding the other stages of
this rank's model) sums the norm over the stages as well: every stage's
parameters are its own, so all of them count (Megatron's model-parallel group is
both together; its replica rule takes the tensor-parallel rank).

Pure: which elements of this rank's slices count (grad_norm_figures.py does the sums).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch.distributed as dist

if TYPE_CHECKING:  # imported for annotations only
    from .ddp import DistributedDataParallel
    from .slice_pieces import SlicePieces


_GROUP_HOLDS = {
    "model_parallel_group": "the ranks holding the other shards of this rank's layers",
    "pipeline_parallel_group": "the ranks holding the other pipeline stages of this "
                               "rank's model",
}
# ShardedOptimizer's keywords (and attributes) for the groups the norm also sums over.
GROUP_KEYWORDS = tuple(_GROUP_HOLDS)


def check_model_parallel_group(group: object, clip_ignored_parameters: bool,
                               name: str = "model_parallel_group") -> None:
    """``group`` given as ShardedOptimizer's ``name`` (model_parallel_group or
    pipeline_parallel_group): a process group holding this rank, or None."""
    if group is None:
        return
    holds = _GROUP_HOLDS[name]
    # (torch's new_group gives the ranks outside the group this marker, an int)
    if (isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER) or \
            (isinstance(group, dist.ProcessGroup) and dist.get_rank(group) < 0):
        raise ValueError(f"{name} does not hold this rank: pass the group of {holds}")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name} must be a torch.distributed ProcessGroup ({holds}), got "
                        f"{type(group).__name__}")
    if clip_ignored_parameters:
        raise ValueError(f"{name} and clip_ignored_parameters are not supported together")


def counted_ranges(model: "DistributedDataParallel", pieces: "SlicePieces",
                   group: Optional[dist.ProcessGroup]) -> list[Optional[list[tuple[int, int]]]]:
    """Per bucket, the element ranges of this rank's gradient slice the norm counts:
    None for all of it (no group, the group's first rank, or a slice holding only
    parameters marked ``tensor_model_parallel``), else those of the marked ones."""
    if group is None or dist.get_rank(group) == 0:
        return [None] * len(model.buckets)
    params = [p for _, p in model.named_trainable_parameters()]
    ranges: list[Optional[list[tuple[int, int]]]] = []
    for b, storage in enumerate(model.buckets):
        in_bucket = pieces.by_bucket[b]
        counted = [(start - storage.shard_start, end - storage.shard_start)
                   for index, _, start, end in in_bucket
                   if getattr(params[index], "tensor_model_parallel", False)]
        ranges.append(None if len(counted) == len(in_bucket) else counted)
    return ranges
