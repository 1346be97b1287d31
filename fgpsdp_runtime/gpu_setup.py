"""What a wrapper on a GPU sets up before its first collective: the module's GPU
made the current device, and the NCCL communicators of its groups created in one
order on every rank (with a warning where CUDA_DEVICE_MAX_CONNECTIONS=1 makes
concurrent communicators unsafe). Nothing here runs for a CPU module."""
from __future__ import annotations

import os
import warnings
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .backends import backend_of


def make_current_device(module: nn.Module) -> None:
    """Make the module's GPU the current one, as launchers' set_device does.

    torch DDP runs without it (its tutorial wraps ``model.to(rank)`` alone), but
    here NCCL's object collectives (the checks across ranks), the events that
    order the link streams and the streams the forward waits on all take the
    current device: left at cuda:0, every rank would meet there (NCCL refuses
    a duplicate GPU) and the forward would wait on another GPU's stream."""
    device = next((p.device for p in module.parameters() if p.device.type == "cuda"), None)
    if device is not None and device.index is not None \
            and torch.cuda.current_device() != device.index:
        torch.cuda.set_device(device)


def connect_nccl_groups(groups: Sequence[Optional[dist.ProcessGroup]],
                        device: torch.device) -> None:
    """NCCL creates a group's communicator at its first collective. Left to the link
    workers, each would create its own from its thread during the first backward,
    in an order that differs between ranks, while the others' kernels run: NCCL
    warns that this may deadlock. One small all-reduce per group, here, in the
    same order on every rank, creates them all before any of that."""
    if device.type != "cuda":
        return
    flag = torch.zeros(1, device=device)
    nccl_groups = [group for group in groups
                   if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER
                   and backend_of(group, device) == "nccl"]
    for group in nccl_groups:
        dist.all_reduce(flag, group=group)
    warn_if_one_hardware_queue(len(nccl_groups))


def warn_if_one_hardware_queue(nccl_groups: int) -> None:
    """CUDA_DEVICE_MAX_CONNECTIONS=1 (set for Megatron-style tensor-parallel
    overlap) gives every CUDA stream of the process one hardware queue, which runs
    kernels in launch order. NCCL kernels wait for their peers, and the link
    workers' launch orders across groups differ between ranks (link_worker.py):
    NCCL only guarantees progress to concurrent communicators whose kernels can
    run side by side (the hazard NCCL documents; not yet run on a GPU)."""
    if nccl_groups > 1 and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip() == "1":
        warnings.warn("fgpsdp: CUDA_DEVICE_MAX_CONNECTIONS=1 puts every CUDA stream of this "
                      "process in one hardware queue, while this wrapper runs collectives "
                      f"on {nccl_groups} NCCL communicators at once from separate threads, "
                      "in orders that may differ between ranks: their kernels can then wait "
                      "on each other across ranks (a hang). Unset it for training with "
                      "fgpsdp.", RuntimeWarning, stacklevel=4)
