"""Per-parameter reads of the reduced gradient: each parameter's norm, and one
parameter's whole gradient.

After backward every ``param.grad`` is None (see [Note: slices as optimizer
parameters] in optim.py): a parameter's reduced gradient lies in pieces, each in
the slice of the rank that owns it. A loop that logs per-layer gradient norms,
or looks at one layer's gradient, reads ``p.grad`` under torch DDP; these put
the same figures together from the pieces, each with one all-reduce over the
wrapper's group. The optimizer calls them once every reduce-scatter has landed
(``ShardedOptimizer.grad_norms`` and ``full_grad``), after agree_on_the_read's
check that every rank makes the same read. ``full_state`` makes that check too, and
puts a parameter's per-element optimizer state together with whole_from_pieces.
(MuonWithAdamW's step brings each matrix to one rank only: whole_matrices.py.)
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


# full_grad's and full_state's index for a tensor no bucket holds: a parameter of the
# module frozen when it was wrapped (its p.grad is None, its state what torch's
# optimizer gives it at construction), or no parameter of the model at all (refused).
# The ranks agree on them as on an index (agree_on_the_read), so that a rank passing
# one of those while the others pass a parameter raises with them.
NOT_BUCKETED = -1
NOT_A_PARAMETER = -2


def has_gradient(model: "DistributedDataParallel", globally_used: Optional[Sequence[bool]],
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
    named = model.named_trainable_parameters()
    device = model.device
    squares = torch.zeros(len(named), dtype=torch.float64, device=device)
    for b, storage in enumerate(model.buckets):
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
    norms = squares.sqrt()  # (on the buckets' device: no copy per parameter)
    found = {}
    for index, (name, param) in enumerate(named):
        slot = model.reducer.slot.get(index)
        if slot is None:  # an empty parameter: its p.grad is its own, as torch DDP's
            if param.grad is not None:
                found[name] = torch.zeros((), dtype=param.grad.dtype, device=param.grad.device)
        elif has_gradient(model, globally_used, slot[0], index):
            found[name] = norms[index].to(model.buckets[slot[0]].grad_shard.dtype)
    return found


def full_grad(model: "DistributedDataParallel", pieces: "SlicePieces",
              globally_used: Optional[Sequence[bool]], index: int) -> Optional[torch.Tensor]:
    """Trainable parameter ``index``'s reduced gradient, whole, shaped and laid out as
    the parameter (None where torch DDP's ``p.grad`` would be None). A collective
    (see whole_from_pieces)."""
    param = model.named_trainable_parameters()[index][1]
    found = model.reducer.slot.get(index)
    if found is None:  # an empty parameter: no bucket holds it, its p.grad is its own
        return None if param.grad is None else param.grad.detach().clone()
    bucket, span = found
    if not has_gradient(model, globally_used, bucket, index):
        return None  # (every rank alike: no collective)
    storage = model.buckets[bucket]
    mine = [(start, storage.grad_shard[start - storage.shard_start:end - storage.shard_start])
            for _, _, start, end in pieces.by_param.get(index, ())]
    return whole_from_pieces(model, index, storage.grad_shard.dtype, mine,
                             "a parameter's whole gradient")


def whole_from_pieces(model: "DistributedDataParallel", index: int, dtype: torch.dtype,
                      mine: Sequence[tuple[int, torch.Tensor]], site: str) -> torch.Tensor:
    """Trainable parameter ``index`` whole, shaped and laid out as the parameter, from
    every rank's pieces of it: ``mine`` holds this rank's, as (offset in the bucket,
    values). A collective.

    Each rank fills in its pieces and leaves zeros elsewhere, and the buffer is
    summed over the ranks as bytes: every byte is non-zero on at most its owner,
    so the sum is that rank's byte, with no carry. Every value arrives bit for bit,
    -0.0 and a NaN's payload included, which a sum of floats (x + 0.0) would not
    keep for -0.0."""
    bucket, span = model.reducer.slot[index]
    whole = torch.zeros(span.numel, dtype=dtype, device=model.buckets[bucket].device)
    for start, values in mine:
        offset = start - span.bucket_offset
        whole[offset:offset + values.numel()].copy_(values)
    if model.world_size > 1:
        all_reduce_held(whole.view(torch.uint8), dist.ReduceOp.SUM, model.process_group, site)
    param = model.named_trainable_parameters()[index][1]
    return span_as_param(whole, param.shape, span.strides)


def agree_on_the_read(model: "DistributedDataParallel", what: str, kind: int, index: int,
                      unreduced: bool) -> None:
    """Before a read's collectives, one all-reduce of [1, kind, kind^2, index, index^2,
    unreduced]: raises on every rank unless every rank makes the same read (``kind``:
    which call; ``index``: full_grad's or full_state's parameter, or NOT_BUCKETED /
    NOT_A_PARAMETER), and, for a gradient read, of reduced gradients. Without it a
    full_grad() on one rank beside a grad_norms() on another of as many parameters
    would sum the one's figures with the other's, silently.

    ``unreduced``: this rank holds gradients a backward under no_sync() left in
    ``param.grad``. Reduced now, apart from the rest of the accumulation, they would
    change what the step computes (two reductions added round otherwise than one of
    the sum), so the read is refused instead; torch DDP's ``p.grad`` there is this
    rank's own gradient."""
    figures = torch.tensor([1.0, float(kind), float(kind) ** 2, float(index),
                            float(index) ** 2, float(unreduced)], dtype=torch.float64,
                           device=model.device)
    if model.world_size > 1:
        all_reduce_held(figures, dist.ReduceOp.SUM, model.process_group,
                        "which gradient read")
    count, kinds, kind_squares, indices, index_squares, unreduced_ranks = \
        (float(v) for v in figures.cpu())
    # n * sum(x^2) == sum(x)^2 only if every rank's x is the same.
    if count * kind_squares != kinds * kinds or count * index_squares != indices * indices:
        raise ValueError(f"fgpsdp: {what} is a collective, and the ranks made different "
                         "reads at the same point (another call, or full_grad() of another "
                         "parameter): every rank must make the same one")
    if unreduced_ranks > 0:
        raise RuntimeError(unreduced_refusal(what))


def unreduced_refusal(what: str) -> str:
    """Why a read after a backward under no_sync() is refused (agree_on_the_read)."""
    return (f"fgpsdp: {what} after a backward under no_sync(): this step's gradients are "
            "not reduced yet (each rank's own are in param.grad, as under torch DDP); "
            "reducing them now, apart from the rest of the accumulation, would change what "
            "opt.step() computes. Read them after the synchronised backward")
