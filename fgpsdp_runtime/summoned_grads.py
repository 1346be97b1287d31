"""Every parameter's whole reduced gradient in ``param.grad`` for the length of a block,
and what the block wrote there taken back into this rank's slices
(``ShardedOptimizer.summon_full_grads``).

[Note: summoned gradients]
Under torch DDP a loop may edit ``p.grad`` between backward and step: zero the rows of
an embedding it keeps fixed, add noise, clip by a rule of its own (timm's adaptive
clipping, per parameter), or hand the parameters to a library that does. Here
``p.grad`` is None after backward: each rank holds its slices of the reduced gradient.
The block gathers the whole buckets it needs (one all-gather each: the bytes of the
parameter exchange) and points each parameter's ``.grad`` at its part of its bucket,
laid out as the parameter: the same values on every rank, bit for bit what torch DDP's
``p.grad`` holds there. Under master weights the reduced slices are float32 beside
16-bit parameters, whose ``.grad`` must have their dtype: the block sees them rounded,
and an element it leaves at that rounding keeps its float32 value (what it writes, an
edit, is taken as written). Code in the block edits them as under torch DDP. At its end
each rank takes its own slice back from its copy; an edit every rank makes alike (as
under torch DDP, where every rank edits the same ``p.grad``) so reaches every slice's
owner. The copies are dropped then, and ``p.grad`` is None again.

Pure of decisions: the optimizer checks the call, finishes the reduce-scatters first,
and learns from ``write_back``'s result (all-reduced there) whether the gradient
changed, which then counts as a clip by value does (the norm measured again, two_stage's
speculative steps undone).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.distributed as dist

from .buckets import span_as_param
from .group_collectives import all_gather_single, all_reduce_held, hold_past_gloo_worker
from .slice_pieces import as_integers, same_bits

if TYPE_CHECKING:  # imported for annotations only
    from .ddp import DistributedDataParallel

@dataclass
class SummonedGrad:
    """A parameter whose ``.grad`` the block holds: ``view`` is its part of the gathered
    bucket, what ``param.grad`` was set to."""

    name: str
    param: torch.nn.Parameter
    view: torch.Tensor


@dataclass
class SummonedGrads:
    """What one block gathered: whole buckets (by bucket index) in the parameters'
    dtype, which the parameters' ``.grad`` point into (rounded where the reduced slices
    are float32 beside 16-bit parameters: master weights)."""

    whole_buckets: dict[int, torch.Tensor]
    grads: list[SummonedGrad]


def agree_on_the_selection(model: "DistributedDataParallel", indices: Sequence[int],
                           what: str) -> None:
    """Raises on every rank unless every rank named the same parameters (the wrapper's
    indices): one all-reduce of a flag per trainable parameter, which every rank's
    selection sets alike or not at all."""
    named = torch.zeros(len(model.named_trainable_parameters()), dtype=torch.float64,
                        device=model.device)
    named[list(indices)] = 1.0
    if model.world_size > 1:
        all_reduce_held(named, dist.ReduceOp.SUM, model.process_group, "summoned parameters")
    counts = named.cpu()
    if bool(((counts != 0) & (counts != model.world_size)).any()):
        raise ValueError(f"fgpsdp: {what} is a collective, and the ranks named other "
                         "parameters: every rank must name the same ones")


def gather(model: "DistributedDataParallel", indices: Sequence[int],
           has_gradient: Callable[[int, int], bool]) -> SummonedGrads:
    """Gather the buckets holding a gradient of the parameters at ``indices`` (the
    wrapper's trainable-parameter indices; ``has_gradient(bucket, index)`` says whether
    torch DDP's ``p.grad`` would hold one, the same on every rank), and set each such
    parameter's ``.grad`` to its part. A collective: one all-gather per bucket, in
    bucket order."""
    named = model.named_trainable_parameters()
    wanted: dict[int, list[int]] = {}
    for index in indices:
        found = model.reducer.slot.get(index)
        if found is not None and has_gradient(found[0], index):
            wanted.setdefault(found[0], []).append(index)
    whole_buckets = {}
    for b in sorted(wanted):
        # (float32 beside 16-bit parameters: the block sees them rounded)
        whole_buckets[b] = _whole_bucket(model, b).to(model.buckets[b].dtype)
    grads: list[SummonedGrad] = []
    for b in sorted(wanted):
        for index in wanted[b]:
            name, param = named[index]
            span = model.reducer.slot[index][1]
            view = span_as_param(whole_buckets[b][span.bucket_offset:span.bucket_end],
                                 param.shape, span.strides)
            # (p.grad is None here: the reduce-scatters took every p.grad, and the read
            # before refused, on every rank, one a backward under no_sync() left.)
            param.grad = view
            grads.append(SummonedGrad(name, param, view))
    return SummonedGrads(whole_buckets, grads)


def _whole_bucket(model: "DistributedDataParallel", b: int) -> torch.Tensor:
    """Bucket ``b``'s reduced gradient, whole: every rank's slice at its place."""
    storage = model.buckets[b]
    shard = storage.grad_shard
    world = model.world_size
    if world == 1:
        return shard.clone()
    gathered = torch.empty(world * shard.numel(), dtype=shard.dtype, device=shard.device)
    all_gather_single(gathered, shard, group=model.process_group)
    # Kept past gloo's thread until the next block (see group_collectives.py): on CPU
    # the last bucket gathered outlives the block.
    hold_past_gloo_worker("summoned gradients", gathered)
    # Group rank r's slice lands at chunk r; it belongs at chunk slice_index(r), which
    # differs under a hierarchical topology.
    slices = [model.topology.slice_index(r) for r in range(world)]
    if slices == list(range(world)):
        return gathered
    rank_of_slice = torch.argsort(torch.tensor(slices)).to(shard.device)
    return gathered.view(world, shard.numel())[rank_of_slice].reshape(-1)


def write_back(model: "DistributedDataParallel", summoned: SummonedGrads) -> bool:
    """Take this rank's slices back from the block's copies; True if any element
    changed (compared bit for bit). Local. A ``p.grad`` the block replaced by another
    tensor is read from that tensor; one set to None raises (no element would say
    what the step should take), before any slice changes."""
    for grad in summoned.grads:
        current = grad.param.grad
        if current is None:
            raise RuntimeError(
                f"fgpsdp: summon_full_grads(): p.grad of {grad.name!r} was set to None in "
                "the block; the step cannot leave out a parameter whose gradient was "
                "reduced (zero it instead, or leave it out of param groups)")
        if current is not grad.view:
            grad.view.copy_(current)
    changed = False
    for b, whole in summoned.whole_buckets.items():
        storage = model.buckets[b]
        mine = whole[storage.shard_start:storage.shard_end]
        shard = storage.grad_shard
        if shard.dtype != mine.dtype:
            # The block saw the float32 slice rounded: the elements it left at that
            # rounding keep their float32 value, the others take what it wrote.
            edited = as_integers(shard.to(mine.dtype)) != as_integers(mine)
            if bool(edited.any()):
                shard[edited] = mine[edited].to(shard.dtype)
                changed = True
        elif not same_bits(mine, shard):
            shard.copy_(mine)
            changed = True
    return changed


def restore(summoned: SummonedGrads) -> None:
    """Every ``p.grad`` the block set back to None (the slices hold the gradient)."""
    for grad in summoned.grads:
        grad.param.grad = None

