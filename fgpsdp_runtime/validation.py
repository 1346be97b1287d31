"""Set-up checks that every rank agrees on, so bad input fails everywhere at once.

A check that fails on one rank only would leave the others waiting in their
next collective until the process-group timeout. Each rank therefore makes
its local checks, then one all_gather_object shares every rank's findings and
model description, and every rank raises the same exception.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class ParamDescription:
    name: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool


def describe(named_params: Sequence[tuple[str, torch.nn.Parameter]]) -> list[ParamDescription]:
    return [ParamDescription(name, tuple(p.shape), str(p.dtype).replace("torch.", ""),
                             bool(p.requires_grad)) for name, p in named_params]


def local_problems(module: torch.nn.Module,
                   trainable: Sequence[tuple[str, torch.nn.Parameter]]) -> list[str]:
    """What this rank finds wrong with its module, as sentences."""
    problems = []
    devices = {p.device for _, p in trainable}
    if len(devices) > 1:
        listing = ", ".join(f"{n} on {p.device}" for n, p in trainable[:8])
        problems.append(f"trainable parameters are on several devices ({listing}); "
                        "a module must live on one device")
    for name, param in trainable:
        if param.device.type == "meta":
            problems.append(f"parameter '{name}' is on the meta device; materialise it first")
            break
        if param.dtype not in SUPPORTED_DTYPES:
            problems.append(f"parameter '{name}' has dtype {param.dtype}; supported: "
                            + ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES))
            break
    for mod_name, mod in module.named_modules():
        if getattr(mod, "sparse", False) is True and any(
                p.requires_grad for p in mod.parameters(recurse=False)):
            problems.append(f"module '{mod_name or type(mod).__name__}' produces sparse "
                            "gradients (sparse=True); sparse gradients are not supported")
    return problems


def first_difference(reference: Sequence[ParamDescription],
                     other: Sequence[ParamDescription]) -> Optional[str]:
    for ref, oth in zip(reference, other):
        if ref != oth:
            return (f"parameter '{ref.name}' {list(ref.shape)} {ref.dtype} "
                    f"requires_grad={ref.requires_grad} on rank 0 vs '{oth.name}' "
                    f"{list(oth.shape)} {oth.dtype} requires_grad={oth.requires_grad}")
    if len(reference) != len(other):
        longer = reference if len(reference) > len(other) else other
        extra = longer[min(len(reference), len(other))]
        return (f"{len(reference)} parameters on rank 0 vs {len(other)}; first unmatched "
                f"parameter '{extra.name}' {list(extra.shape)}")
    return None


def agree_or_raise(group: Optional[dist.ProcessGroup], problems: list[str],
                   description: list[ParamDescription]) -> None:
    """Share findings and model descriptions; raise the same error on every rank."""
    world = dist.get_world_size(group)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (problems, description), group=group)
    messages = []
    for rank, (rank_problems, _) in enumerate(gathered):
        messages.extend(f"rank {rank}: {p}" for p in rank_problems)
    reference = gathered[0][1]
    for rank in range(1, world):
        diff = first_difference(reference, gathered[rank][1])
        if diff is not None:
            messages.append(f"rank {rank}: model differs from rank 0: {diff}")
    if messages:
        raise ValueError("fgpsdp: cannot wrap the module:\n  " + "\n  ".join(messages))
