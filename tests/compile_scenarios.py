"""torch.compile around the wrapper, around the module, or around a submodule.

Imported by the spawned ranks (module-level functions only).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

import fgpsdp_runtime as fgp

from .scenarios import MLP, make_batch


def compiled_side_by_side(rank: int, world_size: int, how: str, schedule: str,
                          steps: int = 5) -> float:
    """Largest parameter difference to torch DDP (compiled alike) after ``steps`` steps.

    aot_eager: dynamo and AOTAutograd as inductor sees them, without its
    C++ compile time (inductor gave the same results when tried).
    """
    torch.manual_seed(0)
    base = MLP()
    reference = copy.deepcopy(base)
    if how == "module":
        base = torch.compile(base, backend="aot_eager")
    elif how == "submodule":
        base.net[2] = torch.compile(base.net[2], backend="aot_eager")
    ours = fgp.DistributedDataParallel(base, schedule=schedule, bucket_cap_mb=0.0001)
    ref = nn.parallel.DistributedDataParallel(reference)
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    run_ours = torch.compile(ours, backend="aot_eager") if how == "wrapper" else ours
    run_ref = torch.compile(ref, backend="aot_eager")
    for step in range(steps):
        x, y = make_batch("mlp", step, 0, rank)
        nn.functional.mse_loss(run_ours(x), y).backward()
        nn.functional.mse_loss(run_ref(x), y).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    ours.synchronize()
    return max(float((a.detach() - b.detach()).abs().max())
               for a, b in zip(ours.module.parameters(), ref.module.parameters()))


def compiled_many(rank: int, world_size: int, cases: list[tuple[str, str]]) -> dict:
    return {case: compiled_side_by_side(rank, world_size, *case) for case in cases}
