"""This rank's slice of every bucket, cut where parameters begin and end.

The inner optimizer steps these pieces: each a 1-D view of a bucket's flat
parameter (a leaf tensor, so updates land in the model's storage), whose
``.grad`` is the matching view of the bucket's reduced gradient slice (see
[Note: slices as optimizer parameters] in optim.py). This module builds the
pieces, hands them their gradients bucket by bucket, and checks that they
still view their buckets. No communication.

Under the optimizer's ``master_weights``, a 16-bit bucket's pieces view a float32
copy of this rank's slice instead (its master weights), and its reduced gradient
slice is float32 too (BucketStorage.set_grad_dtype): the inner optimizer steps in
float32, and each step's result is written back, rounded, into the bucket's slice,
which the all-gather sends. See [Note: master weights].
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch

if TYPE_CHECKING:  # imported for annotations only
    from .ddp import DistributedDataParallel


# [Note: master weights]
# A 16-bit parameter stepped in its own dtype loses every update smaller than half
# its last place (bfloat16 keeps 8 bits: an AdamW step of lr 1e-4 vanishes on a
# weight of 1). So, as DeepSpeed's and Megatron's distributed optimizers do, the
# optimizer may keep a float32 copy of its own slice and step that; the bucket's
# 16-bit slice is that copy rounded (round-to-nearest-even, as tensor.copy_),
# written after every inner step and sent by the all-gather. Sharded like the
# optimizer state: 4 bytes per element over N ranks. The model's parameters stay
# the truth the loop sees: an element the loop wrote (model.load_state_dict, a
# hand-written re-initialisation, a WGAN's clamp through p.data) no longer holds
# the bits last written there, of which each rank keeps its slice's copy (2 bytes
# per element over N ranks), and the master takes the written value before the
# next step (follow_param_writes): a write is never undone by the next step's
# write-back. The loop may write the optimizer's own tensors too (opt.param_groups'
# pieces, in place: a hand-written weight decay), which are the masters here: they
# reach the parameters with the next step's write-back, beside any parameter the
# loop wrote. (Compared with the master rounded instead, a parameter untouched
# beside a written master looked written, and undid the master's write.)
MASTER_WEIGHT_DTYPES = (torch.float16, torch.bfloat16)


class SlicePieces:
    """The pieces of this rank's slices, by parameter and by bucket.

    ``by_param``: wrapper's parameter index -> [(piece, bucket, start, end)];
    ``by_bucket[b]``: [(parameter index, piece, start, end)]; ``of_bucket[b]``:
    bucket b's pieces alone. ``start`` and ``end`` are offsets in the bucket.
    """

    def __init__(self, model: "DistributedDataParallel", master_weights: bool = False):
        self._model = model
        self.by_param: dict[int, list[tuple]] = {}
        self.by_bucket: list[list[tuple]] = [[] for _ in model.buckets]
        # Bucket -> the float32 master copy of this rank's slice (16-bit buckets
        # under master_weights only).
        self.masters: dict[int, torch.Tensor] = {}
        for b, storage in enumerate(model.buckets):
            if master_weights and storage.dtype in MASTER_WEIGHT_DTYPES:
                self.masters[b] = storage.param_shard.detach().to(torch.float32, copy=True)
            for piece in storage.layout.shard_pieces(model.slice_index):
                start = piece.bucket_offset
                end = start + piece.numel
                if b in self.masters:
                    offset = start - storage.shard_start
                    tensor = self.masters[b][offset:offset + piece.numel]
                else:
                    tensor = storage.flat_param[start:end]  # a leaf view: updates land in place
                self.by_param.setdefault(piece.param_index, []).append((tensor, b, start, end))
                self.by_bucket[b].append((piece.param_index, tensor, start, end))
        self.of_bucket: list[list[torch.Tensor]] = [
            [tensor for _, tensor, _, _ in pieces] for pieces in self.by_bucket]
        # Bucket -> its master's version counter after our last write to it: another
        # value means the loop wrote the optimizer's tensors (see the note).
        self._versions_written = {b: m._version for b, m in self.masters.items()}
        # Bucket -> this rank's 16-bit slice as we last wrote it (or took it in): an
        # element that differs from it now was written by the loop.
        self._last_written = {b: model.buckets[b].param_shard.detach().clone()
                              for b in self.masters}
        # Buckets whose pieces assign_grads may have given a gradient.
        self._with_grads: set[int] = set()
        self._grad_views: dict[int, tuple] = {}  # see _grad_shard_views

    def check_they_view_their_buckets(self) -> None:
        """The pieces in ``param_groups`` must still view their buckets: a loop written
        for torch.optim that assigns ``p.data = ...`` to them (a hand-written weight
        decay) would have every later step write storage no all-gather reads, and the
        model would silently stop training."""
        model = self._model
        bases = [(s.flat_param.data_ptr(), s.flat_param.element_size(), 0)
                 if b not in self.masters else
                 (self.masters[b].data_ptr(), self.masters[b].element_size(), s.shard_start)
                 for b, s in enumerate(model.buckets)]
        for index, pieces in self.by_param.items():
            for tensor, b, start, _ in pieces:
                base, element_size, origin = bases[b]
                if tensor.data_ptr() != base + (start - origin) * element_size:
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

    def follow_param_writes(self, buckets: Sequence[int]) -> None:
        """Before stepping ``buckets``: where the loop wrote a bucket's 16-bit slice
        since our last write to it, the master takes the written value (see
        [Note: master weights])."""
        storages = self._model.buckets
        for b in buckets:
            master = self.masters.get(b)
            if master is None:
                continue
            shard, last = storages[b].param_shard, self._last_written[b]
            # On the GPU, one select, not a test first: asking whether any element was
            # written would wait for the GPU, every bucket, every step. On the CPU the
            # select (a compare, a cast, a select over the slice) would cost a third of
            # a step: first whether any bit changed at all, as 64-bit words.
            if shard.is_cuda or not same_bits(shard, last):
                written = shard != last
                torch.where(written, shard.to(master.dtype), master, out=master)
                last.copy_(shard)
            self._versions_written[b] = master._version

    def note_master_restored(self, b: int) -> None:
        """Bucket b's master was put back with its slice (an undone speculative step)."""
        if b in self.masters:
            self._last_written[b].copy_(self._model.buckets[b].param_shard)
            self._versions_written[b] = self.masters[b]._version

    def master_written_by_the_loop(self, b: int) -> Optional[str]:
        """The name of a parameter of bucket b if the loop wrote the optimizer's
        tensors of it (its master) since our last write, else None."""
        master = self.masters.get(b)
        if master is None or master._version == self._versions_written[b] \
                or not self.by_bucket[b]:
            return None
        index = self.by_bucket[b][0][0]
        return self._model.named_trainable_parameters()[index][0]

    def load_masters(self, saved: dict) -> None:
        """A checkpoint's master weights: ``saved[b]`` this rank's slice of bucket b
        whole, or [(offset in the slice, values)]. A bucket it does not hold (a dict
        saved without master weights, or by a torch optimizer) restarts from its
        parameters' values, rounded, as a run with master weights starts; a
        parameter loaded later is followed as any write (follow_param_writes)."""
        storages = self._model.buckets
        with torch.no_grad():
            for b, master in self.masters.items():
                if b not in saved:
                    self._model.finish_param_all_gather(b)  # (lands our slice too)
                    master.copy_(storages[b].param_shard)
                elif torch.is_tensor(saved[b]):
                    master.copy_(saved[b])
                else:
                    for offset, values in saved[b]:
                        master[offset:offset + values.numel()].copy_(values)
                # As if just written back: parameters that are the masters rounded (the
                # model's checkpoint of the same step, loaded before or after) are not
                # taken for writes.
                self._last_written[b].copy_(master)
                self._versions_written[b] = master._version

    def write_back(self, buckets: Sequence[int]) -> None:
        """After stepping ``buckets``: their 16-bit slices become their masters, rounded."""
        storages = self._model.buckets
        for b in buckets:
            master = self.masters.get(b)
            if master is not None:
                storages[b].param_shard.copy_(master)
                self._last_written[b].copy_(storages[b].param_shard)
                self._versions_written[b] = master._version


_INTEGER_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_integers(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of their width: equal only if bit for bit (-0.0
    apart from 0.0, a NaN equal to itself), which comparing the floats is not."""
    return t.view(_INTEGER_OF_WIDTH[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two flat tensors of one size and dtype hold the same bits: compared as
    64-bit words where both are aligned for it (a quarter of the 16-bit elements to
    compare), else element by element."""
    per_word = 8 // a.element_size()
    if per_word > 1 and a.numel() % per_word == 0 and a.storage_offset() % per_word == 0 \
            and b.storage_offset() % per_word == 0:
        return torch.equal(a.view(torch.int64), b.view(torch.int64))
    return torch.equal(as_integers(a), as_integers(b))
