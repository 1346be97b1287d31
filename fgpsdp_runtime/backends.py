"""Which backend a process group runs for tensors of one device type, and the device
object collectives run from.

``dist.get_backend(group)`` names one backend only where the group was made with
one: a job's group made by ``init_process_group()`` with no backend (torch then
takes gloo for CPU tensors and NCCL for CUDA ones) says ``"undefined"``, and one
made with ``"cpu:gloo,cuda:nccl"`` (torchtitan's) says that string, while its CUDA
collectives run on NCCL all the same. So the runtime asks the group for the
backend of the device its buckets live on.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist


def backend_of(group: Optional[dist.ProcessGroup], device: torch.device) -> Optional[str]:
    """``"gloo"``, ``"nccl"``, ... for ``device``'s tensors on ``group`` (None: the
    default group), or None where the group has no backend for that device type."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    name = str(dist.get_backend(pg))
    if name != dist.Backend.UNDEFINED and name in dist.Backend.backend_list:
        return name  # one backend for every device type
    try:
        return pg._get_backend(torch.device(device.type)).name()
    except (AttributeError, RuntimeError, ValueError):  # no backend for it; private API
        return None


def objects_on(device: torch.device):
    """Context for an object collective (``all_gather_object``, ``broadcast_object_list``)
    of a wrapper on ``device``: on NCCL torch sends the pickled objects from the
    calling thread's current GPU, which is cuda:0 on a thread that never set one (a
    checkpoint thread) or another GPU after the loop switched: every rank would meet
    on one GPU. A no-op off CUDA (gloo sends them from the CPU)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()
