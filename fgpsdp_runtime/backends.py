"""Which backend a process group runs for tensors of one device type.

``dist.get_backend(group)`` names one backend only where the group was made with
one: a job's group made by ``init_process_group()`` with no backend (torch then
takes gloo for CPU tensors and NCCL for CUDA ones) says ``"undefined"``, and one
made with ``"cpu:gloo,cuda:nccl"`` (torchtitan's) says that string, while its CUDA
collectives run on NCCL all the same. So the runtime asks the group for the
backend of the device its buckets live on.
"""
from __future__ import annotations

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
