"""One rank's buffers (and, at construction, frozen parameters) copied into every
rank's tensors in place, one flat broadcast per device and dtype (rank 0's, or under
``model.join()`` the last rank to join); and the context the forward's broadcast runs
in, which leaves the buffers' version counters as they were (autograd may have saved
one for backward)."""
from __future__ import annotations

import contextlib
import functools
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .group_collectives import hold_past_gloo_worker


@functools.lru_cache(maxsize=None)
def version_keeper_takes_tuples() -> bool:
    # Out of inference mode: the first call may come from a validation forward under
    # torch.inference_mode(), whose tensors have no version counter to read.
    with torch.inference_mode(False):
        try:
            torch.autograd._unsafe_preserve_version_counter((torch.empty(0),))
            return True
        except (AttributeError, TypeError):  # torch 2.4: one tensor only
            return False


def versions_kept(tensors: Sequence[torch.Tensor]) -> contextlib.AbstractContextManager:
    """The tensors' version counters restored on exit (an in-place broadcast into
    buffers autograd saved must not fail backward's version check, as torch DDP's
    does not): one context for them all, or, where torch takes no tuple, one
    each (about ten times slower for a ResNet's buffers)."""
    if version_keeper_takes_tuples():
        return torch.autograd._unsafe_preserve_version_counter(tuple(tensors))
    stack = contextlib.ExitStack()
    for tensor in tensors:
        stack.enter_context(torch.autograd._unsafe_preserve_version_counter(tensor))
    return stack


# A tensor this large is broadcast in place, on its own: a copy into the flat one
# would cost a copy each way, and be held past gloo's thread (see below).
_IN_PLACE_BYTES = 1 << 20


def broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int,
                        group: Optional[dist.ProcessGroup]) -> None:
    """Broadcast many small tensors as one flat tensor per (device, dtype); large
    contiguous ones in place. The same calls on every rank: the models agree."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t.is_contiguous() and t.numel() * t.element_size() >= _IN_PLACE_BYTES:
            # The module's own tensor: alive past gloo's thread without a hold.
            dist.broadcast(t.detach(), src=src, group=group)
        else:
            groups.setdefault((t.device, t.dtype), []).append(t)
    flats = []
    for members in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in members])
        dist.broadcast(flat, src=src, group=group)
        flats.append(flat)
        offset = 0
        for t in members:
            n = t.numel()
            t.detach().copy_(flat[offset:offset + n].view_as(t))
            offset += n
    # The flats of small tensors only (under _IN_PLACE_BYTES each): see group_collectives.py.
    hold_past_gloo_worker("buffer broadcast", *flats)
