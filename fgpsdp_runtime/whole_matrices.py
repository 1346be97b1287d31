"""The matrices an inner step of MuonWithAdamW puts together from every rank's slices.

See [Note: whole matrices from slices] in muon.py. For one wrapper, this module
finds, for the buckets one inner step runs over, the matrices of a use_muon group
that have a gradient (the same on every rank: from the layout and all-reduced
figures), and gives each this rank's pieces; it picks the rank that orthogonalises
each matrix, brings that rank every other rank's pieces of the matrix, and brings
every rank its pieces' part of the result (two all-to-all exchanges of bytes).

[Note: each matrix to its owner and back]
A rank holds one contiguous piece of a matrix or none: a matrix lies in one bucket,
whose slices are contiguous ranges. Which ranks hold which piece follows from the
layout alone, so every rank knows what it sends and receives without asking. Up
to 539eca8 both exchanges were all-reduces of every matrix's bytes, each rank
filling in its pieces and zeros elsewhere: a ring all-reduce sends about twice the
buffer per rank, so a step moved about 2 x (4 + 2) bytes per matrix element per
rank (float32 updates, bfloat16 results) at any world size. Sent to the owner and
back, a rank sends its pieces of the matrices others own (about 1/N of the
matrices' updates) and its own matrices' results to their holders: about
(4 + 2) / N bytes per element. The owner of a matrix is picked for balance first
(Newton-Schulz's work), then, among ranks as loaded, the one holding most of it:
what it holds it does not receive. What each rank sends every other ends in a status
byte (so every pair exchanges at least that): a rank that raised before an exchange
(its momentum, its Newton-Schulz) still takes part in it, and every rank raises.
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from .buckets import span_as_param
from .grad_reads import has_gradient
from .group_collectives import exchange_bytes
from .muon import MatrixPieces, newton_schulz_dtype, not_a_matrix

if TYPE_CHECKING:  # imported for annotations only
    from .ddp import DistributedDataParallel
    from .slice_pieces import SlicePieces


class WholeMatrices:
    """MuonWithAdamW's matrices on one wrapper's slices: their pieces, and the two
    exchanges that put them together on their owners and share the results."""

    def __init__(self, model: "DistributedDataParallel", pieces: "SlicePieces"):
        self.model = model
        self.pieces = pieces
        self._rank_of_slice = {model.topology.slice_index(r): r
                               for r in range(model.world_size)}
        self._holders: dict[int, dict[int, tuple[int, int]]] = {}
        # The last owners() asked for, by the matrices' parameter indices: both of a
        # step's exchanges ask, and a step's matrices are mostly the last step's.
        self._owners: tuple[tuple, list[int]] = ((), [])

    def holders(self, index: int) -> dict[int, tuple[int, int]]:
        """Group rank -> its piece of trainable parameter ``index`` as (offset in the
        bucket, elements), for every rank holding one. The same on every rank."""
        found = self._holders.get(index)
        if found is None:
            bucket, span = self.model.reducer.slot[index]
            size = self.model.buckets[bucket].layout.shard_numel
            found = {}
            for s in range(span.bucket_offset // size, (span.bucket_end - 1) // size + 1):
                lo, hi = max(span.bucket_offset, s * size), min(span.bucket_end, (s + 1) * size)
                found[self._rank_of_slice[s]] = (lo, hi - lo)
            self._holders[index] = found
        return found

    def matrices_in(self, indices: Sequence[int], buckets: Sequence[int],
                    globally_used: Optional[Sequence[bool]]) -> list[MatrixPieces]:
        """The matrices among trainable parameters ``indices`` (a group's, in its
        order) that lie in ``buckets`` and have a gradient, in that order."""
        model = self.model
        wanted = set(buckets)
        params = model.named_trainable_parameters()  # (a new list at each call)
        found = []
        for index in indices:
            slot = model.reducer.slot.get(index)
            if slot is None:  # an empty parameter: in no bucket, and nothing to step
                continue
            if slot[0] not in wanted or not has_gradient(model, globally_used, slot[0], index):
                continue
            mine = self.pieces.by_param.get(index, ())
            held = self.holders(index).get(model.rank)
            if [(start, end - start) for _, _, start, end in mine] != ([held] if held else []):
                raise RuntimeError(f"fgpsdp: internal error: this rank's pieces of parameter "
                                   f"{index} are not where the layout puts them")
            name, param = params[index]
            if param.ndim != 2:  # (a group set to use_muon=True since: on every rank)
                raise not_a_matrix(name, param.shape)
            found.append(MatrixPieces(param.shape,
                                      [tensor for tensor, *_ in mine], handle=index))
        return found

    def owners(self, matrices: Sequence[MatrixPieces]) -> list[int]:
        """owners() of these matrices, with what each rank holds of them (both fixed
        by the layout, so the last answer holds for the same matrices)."""
        key = tuple(m.handle for m in matrices)
        if key != self._owners[0]:
            self._owners = (key, owners([m.shape for m in matrices], self.model.world_size,
                                        [{r: n for r, (_, n) in self.holders(m.handle).items()}
                                         for m in matrices]))
        return self._owners[1]

    def _values_dtype(self, matrix: MatrixPieces) -> torch.dtype:
        # The pieces' gradients' (float32 under master weights): every rank knows it,
        # with or without a piece of the matrix.
        return self.model.buckets[self.model.reducer.slot[matrix.handle][0]].grad_shard.dtype

    def _flat(self, matrix: MatrixPieces, whole: torch.Tensor) -> torch.Tensor:
        """``whole`` (matrix-shaped) laid out as the matrix's span in its bucket."""
        span = self.model.reducer.slot[matrix.handle][1]
        flat = torch.empty(span.numel, dtype=whole.dtype, device=whole.device)
        span_as_param(flat, matrix.shape, span.strides).copy_(whole)
        return flat

    def put_together(self, matrices: Sequence[MatrixPieces],
                     values: Optional[Sequence[list[torch.Tensor]]],
                     raised: Optional[Exception] = None) -> list[Optional[torch.Tensor]]:
        """Matrix i whole, from every rank's values on its pieces (``values[i]``: this
        rank's, in ``matrices[i].pieces``' order), on the rank owners() gives it; None
        on the others. One exchange for them all.

        ``raised``: this rank's error in computing its values (None without one).
        Every rank's error travels in the exchange, as orthogonalised()'s do, and is
        raised on every rank."""
        model, me = self.model, self.model.rank
        owner = self.owners(matrices)
        dtypes = [self._values_dtype(m) for m in matrices]
        device = self._device()
        outgoing: list[list[tuple[int, int]]] = [[] for _ in range(model.world_size)]
        incoming: list[list[tuple[int, int, int]]] = [[] for _ in range(model.world_size)]
        for i, matrix in enumerate(matrices):
            held = self.holders(matrix.handle)
            if owner[i] != me and me in held:
                outgoing[owner[i]].append((i, held[me][1]))
            elif owner[i] == me:
                for rank, (start, numel) in held.items():
                    if rank != me:
                        incoming[rank].append((i, start, numel))
        sends = []
        for wanted in outgoing:
            buffer = _empty_bytes([(k, dtypes[i]) for i, k in wanted], device, status=True)
            try:
                if raised is None:
                    for (i, _), region in zip(wanted, _unpacked(
                            buffer, [(k, dtypes[i]) for i, k in wanted])):
                        region.copy_(_one_piece(values[i], dtypes[i]))
            except Exception as error:  # noqa: BLE001 - said on every rank, below
                raised = error
            sends.append(buffer)
        received = self._exchange(
            sends, [[(k, dtypes[i]) for i, _, k in wanted] for wanted in incoming], raised,
            "Muon's whole matrices",
            "MuonWithAdamW's step raised on rank(s) {} before its matrices were put together")
        wholes: list[Optional[torch.Tensor]] = [None] * len(matrices)
        flats: dict[int, torch.Tensor] = {}
        for i, matrix in enumerate(matrices):
            if owner[i] == me:
                span = model.reducer.slot[matrix.handle][1]
                flats[i] = torch.empty(span.numel, dtype=dtypes[i], device=device)
                wholes[i] = span_as_param(flats[i], matrix.shape, span.strides)
                if me in self.holders(matrix.handle):
                    start, numel = self.holders(matrix.handle)[me]
                    at = start - span.bucket_offset
                    flats[i][at:at + numel].copy_(_one_piece(values[i], dtypes[i]))
        for wanted, buffer in zip(incoming, received):
            for (i, start, numel), part in zip(wanted, _unpacked(
                    buffer, [(n, dtypes[i]) for i, _, n in wanted])):
                at = start - model.reducer.slot[matrices[i].handle][1].bucket_offset
                flats[i][at:at + numel].copy_(part)
        return wholes

    def orthogonalised(self, matrices: Sequence[MatrixPieces],
                       orthogonalise: Callable[[int], torch.Tensor]) -> list[list[torch.Tensor]]:
        """Matrix i orthogonalised (``orthogonalise(i)``, matrix-shaped) on the rank
        owners() gives it, and each rank's pieces' part of every result, per matrix
        in ``matrices[i].pieces``' order: one exchange. The work is spread over this
        inner step's matrices: the ranks meet at that exchange, so a step's wall
        time is its busiest rank's.

        An error in a rank's ``orthogonalise`` travels in the same exchange (a byte
        at the end of what each rank sends every other) and is raised on every rank:
        that rank's own, the others' naming it; they would wait for a result otherwise."""
        model, me, n = self.model, self.model.rank, self.model.world_size
        owner = self.owners(matrices)
        dtypes = [newton_schulz_dtype(self._values_dtype(m)) for m in matrices]
        flats: dict[int, torch.Tensor] = {}
        raised: Optional[Exception] = None
        with model.timeline.span("compute", "Newton-Schulz"):
            for i, matrix in enumerate(matrices):
                if owner[i] == me:
                    try:
                        result = orthogonalise(i)
                    except Exception as error:  # noqa: BLE001 - said on every rank, below
                        raised = error
                        break
                    flats[i] = self._flat(matrix, result.to(dtypes[i]))
        outgoing: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
        incoming: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
        for i, matrix in enumerate(matrices):
            for rank, (start, numel) in self.holders(matrix.handle).items():
                if owner[i] == me and rank != me:
                    outgoing[rank].append((i, start, numel))
                elif owner[i] != me and rank == me:
                    incoming[owner[i]].append((i, start, numel))
        device = self._device()
        sends = []
        for wanted in outgoing:
            buffer = _empty_bytes([(k, dtypes[i]) for i, _, k in wanted], device, status=True)
            if raised is None:
                for (i, start, numel), region in zip(wanted, _unpacked(
                        buffer, [(k, dtypes[i]) for i, _, k in wanted])):
                    at = start - model.reducer.slot[matrices[i].handle][1].bucket_offset
                    region.copy_(flats[i][at:at + numel])
            sends.append(buffer)
        received = self._exchange(
            sends, [[(k, dtypes[i]) for i, _, k in wanted] for wanted in incoming], raised,
            "Muon's orthogonalised matrices",
            "Newton-Schulz raised on rank(s) {}, which orthogonalises matrices for this one too")
        parts: list[list[torch.Tensor]] = [[] for _ in matrices]
        for i, matrix in enumerate(matrices):
            if owner[i] == me and me in self.holders(matrix.handle):
                start, numel = self.holders(matrix.handle)[me]
                at = start - model.reducer.slot[matrix.handle][1].bucket_offset
                parts[i] = [flats[i][at:at + numel]]
        for rank, wanted in enumerate(incoming):
            for (i, _, _), part in zip(wanted, _unpacked(
                    received[rank], [(k, dtypes[i]) for i, _, k in wanted])):
                parts[i] = [part]
        return parts

    def _exchange(self, sends: list[torch.Tensor],
                  incoming: Sequence[Sequence[tuple[int, torch.dtype]]],
                  raised: Optional[Exception], site: str, what: str) -> list[torch.Tensor]:
        """Send ``sends[j]`` (from _empty_bytes, with a status byte) to each rank j and
        receive buffers of ``incoming[j]``'s sizes from it; then raise this rank's
        ``raised``, or an error naming the ranks that raised (``what``, its {} for
        them), on every rank alike."""
        for buffer in sends:
            buffer[-1] = int(raised is not None)
        received = [_empty_bytes(sizes, self._device(), status=True) for sizes in incoming]
        with self.model.timeline.span("compute", site):  # (one per exchange in a trace)
            exchange_bytes(self.model.process_group, sends, received, site)
        if raised is not None:
            raise raised
        # (The status bytes read in one copy: on a GPU, one synchronisation, not N.)
        statuses = torch.stack([buffer[-1] for buffer in received]).tolist()
        failed = [rank for rank, status in enumerate(statuses)
                  if rank != self.model.rank and status]
        if failed:
            raise RuntimeError("fgpsdp: " + what.format(failed) + " (see its error); the "
                               "step stopped on every rank with these matrices unchanged "
                               "(opt.step() called again takes it up there)")
        return received

    def _device(self) -> torch.device:
        return self.model.buckets[0].device if self.model.buckets else torch.device("cpu")


def _one_piece(values: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """This rank's one piece of a matrix (see [Note: each matrix to its owner and back])."""
    if len(values) != 1 or values[0].dtype != dtype:
        raise RuntimeError("fgpsdp: internal error: a Muon update is not one piece in its "
                           "gradient's dtype")
    return values[0].reshape(-1)


def byte_regions(sizes: Sequence[tuple[int, torch.dtype]]) -> tuple[list[tuple[int, int]], int]:
    """Where each of ``sizes`` (elements, dtype) lies in one byte buffer: (first byte,
    bytes) each, and the buffer's length. Each starts at a multiple of 16, so that
    every region can be viewed in its dtype."""
    places, total = [], 0
    for numel, dtype in sizes:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        places.append((total, nbytes))
        total += -(-nbytes // 16) * 16
    return places, total


def _empty_bytes(sizes: Sequence[tuple[int, torch.dtype]], device: torch.device,
                 status: bool = False) -> torch.Tensor:
    """A byte buffer for ``sizes`` laid out by byte_regions, and a status byte after
    them where ``status``."""
    _, total = byte_regions(sizes)
    return torch.zeros(total + int(status), dtype=torch.uint8, device=device)


def _unpacked(buffer: torch.Tensor, sizes: Sequence[tuple[int, torch.dtype]]
              ) -> list[torch.Tensor]:
    """The regions of ``buffer`` (from _empty_bytes) viewed as 1-D tensors of ``sizes``."""
    places, _ = byte_regions(sizes)
    return [buffer[start:start + nbytes].view(dtype)
            for (start, nbytes), (_, dtype) in zip(places, sizes)]


def owners(shapes: Sequence[torch.Size], world_size: int,
           held: Optional[Sequence[dict[int, int]]] = None) -> list[int]:
    """The rank that orthogonalises each matrix: the biggest first, each to the rank
    with the least work so far (Newton-Schulz's cost, min(m, n)^2 * max(m, n)); among
    those, the one holding most of its elements (``held[i]``: rank -> elements of
    matrix i), then the lowest rank. The same on every rank.

    The least loaded rank comes from a heap of (load, rank), entries left behind by a
    rank's later load skipped as they surface: matrices x log(ranks), not matrices x
    ranks (a thousand matrices on a thousand ranks, twice a step)."""
    load = [0] * world_size
    owner = [0] * len(shapes)
    heap = [(0, r) for r in range(world_size)]  # (sorted: already a heap)
    for i in sorted(range(len(shapes)), key=lambda i: (-_cost(shapes[i]), i)):
        while heap[0][0] != load[heap[0][1]]:
            heapq.heappop(heap)
        least = heap[0][0]
        mine = held[i] if held is not None else {}
        rank = min((r for r in mine if load[r] == least), key=lambda r: (-mine[r], r),
                   default=heap[0][1])
        owner[i] = rank
        load[rank] += _cost(shapes[i])
        heapq.heappush(heap, (load[rank], rank))
    return owner


def _cost(shape: torch.Size) -> int:
    small, large = sorted(shape)
    return small * small * large
