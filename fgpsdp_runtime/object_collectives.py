"""Object collectives (pickled Python objects) whose tensors outlive gloo's thread.

torch's ``all_gather_object`` and ``broadcast_object_list`` pickle into tensors
they drop when they return, while gloo's worker thread may still hold the last
reference: on torch before its fix (pull request 154976) a
``destroy_process_group()`` right after can hang (the note at
``group_collectives.hold_past_gloo_worker``). The runtime's object collectives are
its set-up checks, ``full_state_dict()``'s metadata, the profile plan's broadcast
and the join's hyperparameters; with no wrapper alive to run the runtime's own
destroy hook first (a wrapping refused by the set-up checks, the error caught, the
group destroyed) it was seen on torch 2.4.1 (``bench/gloo_teardown_check.py``; the
counts are in docs/compatibility.md).

On a group that runs CPU tensors on gloo these exchange the same things torch's
do (each pickle's size, then the pickles padded to the longest), and keep the
tensors until the call site's next call: per site, the world size + 1 pickles
of the longest rank's size (the checkpoint metadata's grows with the parameter
count). A site called from two threads at once keeps only the later call's. On
other groups (NCCL, which torch sends from the current GPU:
``backends.objects_on``) they are torch's.
"""
from __future__ import annotations

import pickle
from typing import Any, Optional

import torch
import torch.distributed as dist

from .backends import backend_of
from .group_collectives import hold_past_gloo_worker


# Named on every tensor: a loop's torch.set_default_device("cuda") must not move
# the pickles (torch's name their device too).
_CPU = torch.device("cpu")


def _through_gloo(group: Optional[dist.ProcessGroup]) -> bool:
    return backend_of(group, _CPU) == "gloo"


def _as_bytes(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).clone()


def _from_bytes(data: torch.Tensor, size: int) -> Any:
    return pickle.loads(data[:size].numpy().tobytes())


def all_gather_objects(obj: Any, group: Optional[dist.ProcessGroup], site: str) -> list[Any]:
    """Every rank's ``obj``, in group-rank order (``dist.all_gather_object``).
    ``site`` names the caller, whose tensors are kept until its next call."""
    world = dist.get_world_size(group)
    if world == 1:
        return [obj]
    if not _through_gloo(group):
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, obj, group=group)
        return gathered
    # (Outside inference mode: torch 2.4's gloo failed a collective of inference
    # tensors on that rank alone, leaving the others waiting.)
    with torch.inference_mode(False):
        mine = _as_bytes(obj)
        size = torch.tensor([mine.numel()], dtype=torch.int64, device=_CPU)
        sizes = [torch.zeros(1, dtype=torch.int64, device=_CPU) for _ in range(world)]
        dist.all_gather(sizes, size, group=group)
        longest = max(int(s) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=_CPU)
        padded[:mine.numel()] = mine
        received = [torch.empty(longest, dtype=torch.uint8, device=_CPU) for _ in range(world)]
        dist.all_gather(received, padded, group=group)
    hold_past_gloo_worker(site, size, *sizes, padded, *received)
    return [_from_bytes(data, int(n)) for data, n in zip(received, sizes)]


def broadcast_object(obj: Any, src: int, group: Optional[dist.ProcessGroup], site: str) -> Any:
    """Group rank ``src``'s ``obj`` on every rank (``dist.broadcast_object_list`` of
    one object; the others' ``obj`` is ignored). ``site``: as above."""
    if dist.get_world_size(group) == 1:
        return obj
    global_src = dist.get_global_rank(group, src) if group is not None else src
    if not _through_gloo(group):
        box = [obj]
        dist.broadcast_object_list(box, src=global_src, group=group)
        return box[0]
    sender = dist.get_rank(group) == src
    with torch.inference_mode(False):
        data = _as_bytes(obj) if sender else None
        size = torch.tensor([data.numel() if sender else 0], dtype=torch.int64, device=_CPU)
        dist.broadcast(size, src=global_src, group=group)
        if not sender:
            data = torch.empty(int(size), dtype=torch.uint8, device=_CPU)
        dist.broadcast(data, src=global_src, group=group)
    hold_past_gloo_worker(site, size, data)
    return obj if sender else _from_bytes(data, int(size))
