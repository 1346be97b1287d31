"""The matrices an inner step of MuonWithAdamW puts together from every rank's slices.

See [Note: whole matrices from slices] in muon.py. This module finds, for the
buckets one inner step runs over, the matrices of a use_muon group that have a
gradient (the same on every rank: from the layout and all-reduced figures), and
gives each this rank's pieces, the collective that makes the whole matrix of
their values, the rank that orthogonalises it and the collective that shares the
results, and the cut of a matrix back into the pieces.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .buckets import span_as_param
from .grad_reads import byte_regions, has_gradient, wholes_from_pieces
from .group_collectives import all_reduce_held
from .muon import MatrixPieces

if TYPE_CHECKING:  # imported for annotations only
    from .ddp import DistributedDataParallel
    from .slice_pieces import SlicePieces


def matrices_in(model: "DistributedDataParallel", pieces: "SlicePieces",
                indices: Sequence[int], buckets: Sequence[int],
                globally_used: Optional[Sequence[bool]]) -> list[MatrixPieces]:
    """The matrices among trainable parameters ``indices`` (a group's, in its order)
    that lie in ``buckets`` and have a gradient, in that order."""
    wanted = set(buckets)
    params = model.named_trainable_parameters()  # (a new list at each call)
    found = []
    for index in indices:
        slot = model.reducer.slot.get(index)
        if slot is None:  # an empty parameter: in no bucket, and nothing to step
            continue
        bucket, span = slot
        if bucket not in wanted or not has_gradient(model, globally_used, bucket, index):
            continue
        mine = [(tensor, start) for tensor, _, start, _ in pieces.by_param.get(index, ())]
        shape = params[index][1].shape
        found.append(MatrixPieces(
            shape, [tensor for tensor, _ in mine],
            lambda whole, span=span, mine=mine: _parts(whole, span, mine),
            handle=(index, [start for _, start in mine])))
    return found


def put_together(model: "DistributedDataParallel", matrices: Sequence[MatrixPieces],
                 values: Sequence[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Each matrix whole from every rank's values on its pieces (``values[i]`` this
    rank's, in ``matrices[i].pieces``' order): one all-reduce for them all."""
    requests = []
    for matrix, mine in zip(matrices, values):
        index, starts = matrix.handle
        # Every rank must sum the same bytes: one without a piece of the matrix takes
        # the dtype of its gradient slice, which the pieces' updates are in.
        dtype = mine[0].dtype if mine else \
            model.buckets[model.reducer.slot[index][0]].grad_shard.dtype
        requests.append((index, dtype, list(zip(starts, mine))))
    return wholes_from_pieces(model, requests, "Muon's whole matrices")


def _parts(whole: torch.Tensor, span, mine) -> list[torch.Tensor]:
    """``whole``'s values on this rank's pieces: laid out in the bucket's order first."""
    flat = torch.empty(span.numel, dtype=whole.dtype, device=whole.device)
    span_as_param(flat, whole.shape, span.strides).copy_(whole)
    return [flat[start - span.bucket_offset:start - span.bucket_offset + tensor.numel()]
            for tensor, start in mine]


def orthogonalised(model: "DistributedDataParallel", matrices: Sequence[MatrixPieces],
                   dtypes: Sequence[torch.dtype],
                   orthogonalise: Callable[[int], torch.Tensor]) -> list[torch.Tensor]:
    """Matrix i orthogonalised (``orthogonalise(i)``, a ``dtypes[i]`` tensor of its
    shape) on the rank owners() gives it, then every result on every rank: one
    all-reduce of their bytes, each non-zero on its owner alone. The work is spread
    over this inner step's matrices: the ranks meet at that all-reduce, so a chunk's
    wall time is its busiest rank's (a chunk of one matrix keeps the others idle).

    An error in a rank's ``orthogonalise`` is carried by the same all-reduce (a byte
    per rank) and raised on every rank: that rank's own, the others' naming it; the
    others would wait for a result otherwise."""
    owner = owners([m.shape for m in matrices], model.world_size)
    places, total = byte_regions([(m.shape.numel(), d) for m, d in zip(matrices, dtypes)])
    if not matrices:
        return []
    device = model.buckets[0].device if model.buckets else torch.device("cpu")
    buffer = torch.zeros(total + model.world_size, dtype=torch.uint8, device=device)
    results = [buffer[start:start + nbytes].view(dtype).view(matrix.shape)
               for (start, nbytes), dtype, matrix in zip(places, dtypes, matrices)]
    raised: Optional[Exception] = None
    for i, result in enumerate(results):
        if owner[i] == model.rank:
            try:
                result.copy_(orthogonalise(i))
            except Exception as error:  # noqa: BLE001 - said on every rank, below
                raised = error
                buffer[total + model.rank] = 1
                break
    if model.world_size > 1:
        all_reduce_held(buffer, dist.ReduceOp.SUM, model.process_group,
                        "Muon's orthogonalised matrices")
    failed = buffer[total:].nonzero().flatten().tolist()
    if raised is not None:
        raise raised
    if failed:
        raise RuntimeError(f"fgpsdp: Newton-Schulz raised on rank(s) {failed}, which "
                           "orthogonalises matrices for this one too (see its error); the "
                           "step stopped on every rank with these matrices unchanged "
                           "(opt.step() called again takes it up there)")
    return results


def owners(shapes: Sequence[torch.Size], world_size: int) -> list[int]:
    """The rank that orthogonalises each matrix: the biggest first, each to the rank
    with the least work so far (Newton-Schulz's cost, min(m, n)^2 * max(m, n)), the
    lowest rank on a tie. The same on every rank."""
    load = [0] * world_size
    owner = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-_cost(shapes[i]), i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += _cost(shapes[i])
    return owner


def _cost(shape: torch.Size) -> int:
    small, large = sorted(shape)
    return small * small * large
