"""Per-parameter reads of the reduced gradient: each parameter's norm, and one
parameter's whole gradient.

After backward every ``param.grad`` is None (see [Note: slices as optimizer
parameters] in optim.py): a parameter's reduced gradient lies in pieces, each in
the slice of the rank that owns it. A loop that logs per-layer gradient norms,
or looks at one layer's gradient, reads ``p.grad`` under torch DDP; these put
the same figures together from the pieces, each with one all-reduce over the
wrapper's group. The optimizer calls them once every reduce-scatter has landed
(``ShardedOptimizer.grad_norms`` and ``full_grad``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.distributed as dist

from .buckets import span_as_param
from .group_collectives import all_reduce_held

if TYPE_CHECKING:  # imported for annotations only
    from .ddp import DistributedDataParallel
    from .slice_pieces import SlicePieces


def _device(model: "DistributedDataParallel") -> torch.device:
    """Where the buckets, and so the collectives' tensors, live."""
    return model.buckets[0].device if model.buckets else torch.device("cpu")


def _has_gradient(model: "DistributedDataParallel", globally_used: Optional[Sequence[bool]],
                  bucket: int, index: int) -> bool:
    """Would torch DDP's ``p.grad`` hold a tensor: the bucket was not zeroed to None
    since its last backward, and some rank's backward reached the parameter (the
    optimizer's own rule, slice_pieces.assign_grads). The same on every rank."""
    return model.buckets[bucket].grad_shard_valid and (
        globally_used is None or bool(globally_used[index]))


def grad_norms(model: "DistributedDataParallel", pieces: "SlicePieces",
               globally_used: Optional[Sequence[bool]]) -> dict[str, torch.Tensor]:
    """``{name: norm}``: each trainable parameter's L2 norm of its reduced gradient,
    as ``p.grad.norm()`` under torch DDP (0-dim, in the gradient's dtype), for the
    parameters that would have a ``p.grad``. The squares are summed in float64, piece
    by piece and then over the ranks, so the last bit may differ from torch's
    (which sums in the gradient's dtype). A collective."""
    names = [name for name, _ in model.named_trainable_parameters()]
    device = _device(model)
    squares = torch.zeros(len(names), dtype=torch.float64, device=device)
    where: dict[int, int] = {}  # parameter index -> its bucket
    for b, storage in enumerate(model.buckets):
        for span in storage.layout.spans:
            where[span.param_index] = b
        if not storage.grad_shard_valid or not pieces.by_bucket[b]:
            continue
        shard = storage.grad_shard
        indices, sums = [], []
        for index, _, start, end in pieces.by_bucket[b]:
            lo = start - storage.shard_start
            indices.append(index)
            sums.append(shard[lo:lo + (end - start)].double().square().sum())
        squares.index_add_(0, torch.tensor(indices, device=device), torch.stack(sums))
    if model.world_size > 1:
        all_reduce_held(squares, dist.ReduceOp.SUM, model.process_group, "gradient norms")
    norms = squares.sqrt().cpu()
    dtypes = [s.grad_shard.dtype for s in model.buckets]
    return {name: norms[index].to(device=device, dtype=dtypes[where[index]])
            for index, name in enumerate(names)
            if index in where and _has_gradient(model, globally_used, where[index], index)}


def full_grad(model: "DistributedDataParallel", pieces: "SlicePieces",
              globally_used: Optional[Sequence[bool]], index: int) -> Optional[torch.Tensor]:
    """Trainable parameter ``index``'s reduced gradient, whole, shaped and laid out as
    the parameter (None where torch DDP's ``p.grad`` would be None). A collective.

    Each rank fills in its pieces and leaves zeros elsewhere, and the buffer is
    summed over the ranks as bytes: every byte is non-zero on at most its owner,
    so the sum is that rank's byte, with no carry. Every value arrives bit for bit,
    -0.0 and a NaN's payload included, which a sum of floats (x + 0.0) would not
    keep for -0.0."""
    bucket, span = next((b, span) for b, storage in enumerate(model.buckets)
                        for span in storage.layout.spans if span.param_index == index)
    if not _has_gradient(model, globally_used, bucket, index):
        return None  # (every rank alike: no collective)
    storage = model.buckets[bucket]
    whole = torch.zeros(span.numel, dtype=storage.grad_shard.dtype, device=storage.device)
    for _, _, start, end in pieces.by_param.get(index, ()):
        lo = start - storage.shard_start
        whole[start - span.bucket_offset:end - span.bucket_offset].copy_(
            storage.grad_shard[lo:lo + (end - start)])
    if model.world_size > 1:
        all_reduce_held(whole.view(torch.uint8), dist.ReduceOp.SUM, model.process_group,
                        "a parameter's whole gradient")
    param = model.named_trainable_parameters()[index][1]
    return span_as_param(whole, param.shape, span.strides)


def check_same_parameter(model: "DistributedDataParallel", index: int) -> None:
    """ValueError on every rank unless every rank asked for parameter ``index``: a
    different one would sum buffers of other parameters (or other lengths)."""
    figures = torch.tensor([1.0, float(index), float(index) ** 2], dtype=torch.float64,
                           device=_device(model))
    if model.world_size > 1:
        all_reduce_held(figures, dist.ReduceOp.SUM, model.process_group,
                        "which parameter's gradient")
    count, total, squares = (float(v) for v in figures.cpu())
    if count * squares != total * total:  # equal only if every rank's index is
        raise ValueError("fgpsdp: opt.full_grad(param) is a collective: every rank must "
                         "ask for the same parameter at the same point of its loop")
