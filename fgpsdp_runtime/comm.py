"""Collectives on flat buffers, with byte accounting.

Knows nothing of models or optimizers: it moves flat tensors between the
ranks of a process group and counts the bytes it sends. Every operation is
asynchronous and returns a :class:`PendingOp`; the caller decides when to
wait (``start_*`` / ``finish_*`` pairs live in the wrapper).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist


# torch 2.13 renamed the flat-tensor collectives; older releases have only the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class PendingOp:
    """An issued collective and what must happen once it has landed."""

    work: Optional[dist.Work]
    on_done: Optional[Callable[[], None]] = None
    _finished: bool = field(default=False, repr=False)

    def wait(self) -> None:
        if self._finished:
            return
        if self.work is not None:
            # Work.wait(), not the future: gloo's is_completed() is not reliable
            # after a future wait.
            self.work.wait()
        self._finished = True
        if self.on_done is not None:
            self.on_done()


class CommStats:
    """Bytes this rank sent, per link class and phase, since the last reset.

    The figures are what the algorithm puts on the wire per rank (a ring
    reduce-scatter or all-gather of B bytes over n ranks sends (n-1)/n * B),
    so they are the same whatever the backend's internal algorithm, and equal
    on every rank when the load is balanced.
    """

    def __init__(self) -> None:
        self._bytes: dict[tuple[str, str], int] = defaultdict(int)

    def add(self, link: str, phase: str, nbytes: int) -> None:
        self._bytes[(link, phase)] += int(nbytes)

    def reset(self) -> None:
        self._bytes.clear()

    def as_dict(self) -> dict[str, dict[str, int]]:
        """``{link: {phase: bytes, ..., "total": bytes}}``."""
        out: dict[str, dict[str, int]] = {}
        for (link, phase), nbytes in sorted(self._bytes.items()):
            per_link = out.setdefault(link, {"total": 0})
            per_link[phase] = nbytes
            per_link["total"] += nbytes
        return out


def ring_bytes_sent(total_bytes: int, group_size: int) -> int:
    """Bytes one rank sends in a ring reduce-scatter/all-gather of total_bytes."""
    return total_bytes * (group_size - 1) // group_size


class FlatCommunicator:
    """Reduce-scatter and all-gather over one process group (one link class)."""

    def __init__(self, group: Optional[dist.ProcessGroup], *, link: str = "flat",
                 stats: Optional[CommStats] = None) -> None:
        self.group = group
        self.link = link
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = str(dist.get_backend(group))
        self.stats = stats if stats is not None else CommStats()

    def start_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> PendingOp:
        """Sum ``input`` over ranks; this rank receives slice ``rank`` in ``output``."""
        if input.numel() != output.numel() * self.world_size:
            raise ValueError(
                f"reduce-scatter sizes: input {input.numel()} != "
                f"{self.world_size} x output {output.numel()}")
        self.stats.add(self.link, "reduce_scatter",
                       ring_bytes_sent(input.numel() * input.element_size(), self.world_size))
        if self.world_size == 1:
            output.copy_(input)
            return PendingOp(None)
        work = _reduce_scatter_single(output, input, op=dist.ReduceOp.SUM,
                                      group=self.group, async_op=True)
        return PendingOp(work)

    def start_all_gather(self, output: torch.Tensor, input: torch.Tensor) -> PendingOp:
        """Every rank's ``input`` lands at slice ``rank`` of ``output``.

        ``input`` may be the rank's own slice of ``output`` (in place). NCCL
        documents that case; for other backends the slice is copied first,
        since their copy of input into output would alias.
        """
        if output.numel() != input.numel() * self.world_size:
            raise ValueError(
                f"all-gather sizes: output {output.numel()} != "
                f"{self.world_size} x input {input.numel()}")
        self.stats.add(self.link, "all_gather",
                       ring_bytes_sent(output.numel() * output.element_size(), self.world_size))
        if self.world_size == 1:
            if input.data_ptr() != output.data_ptr():
                output.copy_(input)
            return PendingOp(None)
        if self.backend != "nccl" and _aliases(input, output):
            input = input.clone()
        work = _all_gather_single(output, input, group=self.group, async_op=True)
        return PendingOp(work)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Blocking sum of a small tensor (norms, flags); not counted as bucket traffic."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    a_lo = a.data_ptr()
    a_hi = a_lo + a.numel() * a.element_size()
    b_lo = b.data_ptr()
    b_hi = b_lo + b.numel() * b.element_size()
    return a_lo < b_hi and b_lo < a_hi
