"""This rank's slice of every bucket, cut where parameters begin and end.

The inner optimizer steps these pieces: each a 1-D view of a bucket's flat
parameter (a leaf tensor, so updates land in the model's storage), whose
``.grad`` is the matching view of the bucket's reduced gradient slice (see
[Note: slices as optimizer parameters] in optim.py). This module builds the
pieces, hands them their gradients bucket by bucket, and checks that they
still view their buckets. No communication.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch

if TYPE_CHECKING:  # imported for annotations only
    from .ddp import DistributedDataParallel


class SlicePieces:
    """The pieces of this rank's slices, by parameter and by bucket.

    ``by_param``: wrapper's parameter index -> [(piece, bucket, start, end)];
    ``by_bucket[b]``: [(parameter index, piece, start, end)]; ``of_bucket[b]``:
    bucket b's pieces alone. ``start`` and ``end`` are offsets in the bucket.
    """

    def __init__(self, model: "DistributedDataParallel"):
        self._model = model
        self.by_param: dict[int, list[tuple]] = {}
        self.by_bucket: list[list[tuple]] = [[] for _ in model.buckets]
        for b, storage in enumerate(model.buckets):
            for piece in storage.layout.shard_pieces(model.slice_index):
                start = piece.bucket_offset
                end = start + piece.numel
                tensor = storage.flat_param[start:end]  # a leaf view: updates land in place
                self.by_param.setdefault(piece.param_index, []).append((tensor, b, start, end))
                self.by_bucket[b].append((piece.param_index, tensor, start, end))
        self.of_bucket: list[list[torch.Tensor]] = [
            [tensor for _, tensor, _, _ in pieces] for pieces in self.by_bucket]
        # Buckets whose pieces assign_grads may have given a gradient.
        self._with_grads: set[int] = set()
        self._grad_views: dict[int, tuple] = {}  # see _grad_shard_views

    def check_they_view_their_buckets(self) -> None:
        """The pieces in ``param_groups`` must still view their buckets: a loop written
        for torch.optim that assigns ``p.data = ...`` to them (a hand-written weight
        decay) would have every later step write storage no all-gather reads, and the
        model would silently stop training."""
        model = self._model
        bases = [(s.flat_param.data_ptr(), s.flat_param.element_size())
                 for s in model.buckets]
        for index, pieces in self.by_param.items():
            for tensor, b, start, _ in pieces:
                base, element_size = bases[b]
                if tensor.data_ptr() != base + start * element_size:
                    name = model.named_trainable_parameters()[index][0]
                    raise RuntimeError(
                        f"fgpsdp: a piece of parameter {name!r} in "
                        "opt.param_groups was given new storage (p.data = ...): the tensors "
                        "there are views of this rank's bucket slices, and the step would "
                        "write storage the model never reads. Write them in place under "
                        "torch.no_grad() (p.mul_(...)), or use the optimizer's weight_decay")

    def assign_grads(self, globally_used: Optional[Sequence[bool]], buckets: Sequence[int],
                     grads: Optional[dict[int, torch.Tensor]] = None) -> None:
        """Piece gradients of ``buckets`` become views of the reduced shard (or of
        ``grads[b]``, a copy of it); all others None.

        A parameter no rank had a gradient for keeps grad=None (the inner
        optimizer skips it, as after torch DDP). ``globally_used=None`` takes
        every parameter as used (a stage-1 bucket; checked at the step).
        """
        # Bucket by bucket, touching only the buckets wanted now or given gradients
        # before: one inner step per chunk (and per speculative bucket) would
        # otherwise walk every piece of the model, buckets x pieces per step.
        wanted = set(buckets)
        storages = self._model.buckets
        for b in self._with_grads - wanted:
            for tensor in self.of_bucket[b]:
                tensor.grad = None
        for b in wanted:
            storage = storages[b]
            valid = storage.grad_shard_valid
            pieces = self.by_bucket[b]
            if grads is not None:
                source = grads[b]
                views = [source[start - storage.shard_start:end - storage.shard_start]
                         for _, _, start, end in pieces]
            else:
                views = self._grad_shard_views(b)
            for (index, tensor, _, _), view in zip(pieces, views):
                if valid and (globally_used is None or globally_used[index]):
                    tensor.grad = view
                else:
                    tensor.grad = None
        self._with_grads = wanted

    def _grad_shard_views(self, b: int) -> list[torch.Tensor]:
        """The views of bucket b's reduced gradient slice that its pieces take as
        ``.grad``: made once (a slice per piece per step costs microseconds each on a
        model of many small tensors), again only if the slice got other storage."""
        storage = self._model.buckets[b]
        shard = storage.grad_shard
        cached = self._grad_views.get(b)
        if cached is None or cached[0] is not shard or cached[1] != shard.data_ptr():
            views = [shard[start - storage.shard_start:end - storage.shard_start]
                     for _, _, start, end in self.by_bucket[b]]
            cached = self._grad_views[b] = (shard, shard.data_ptr(), views)
        return cached[2]
