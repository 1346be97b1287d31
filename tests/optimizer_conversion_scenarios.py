"""ShardedOptimizer.from_optimizer beside torch DDP: a torch.optim optimizer built
over the module's parameters (as a framework's setup receives it), converted once the
module is wrapped. Imported by the spawned ranks."""
from __future__ import annotations

import copy

import torch
from torch import nn

import fgpsdp_runtime as fgp

from .scenarios import MLP, loss_fn, make_batch, reference_clip_

CLIP = 0.05  # binds on every step of MLP


def _torch_optimizer(module: nn.Module, named: bool) -> torch.optim.Optimizer:
    """AdamW over two groups with their own hyperparameters, a frozen weight among
    them (torch.optim numbers it in its state dict though it never steps it)."""
    module.net[0].weight.requires_grad_(False)
    named_params = list(module.named_parameters())
    decay = [(n, p) for n, p in named_params if p.ndim >= 2]
    no_decay = [(n, p) for n, p in named_params if p.ndim < 2]
    if not named:
        decay, no_decay = [p for _, p in decay], [p for _, p in no_decay]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3}],
                             lr=1e-2, betas=(0.8, 0.99))


def converted_beside_torch_ddp(rank: int, world_size: int, schedule: str,
                               stepped_before: bool, named: bool, steps: int = 4) -> dict:
    """The same module and torch optimizer, trained on under torch DDP and under
    fgpsdp with the optimizer converted, clipping on every step. ``stepped_before``:
    the optimizer took two steps on the plain module first (the same on every rank),
    so its moments must carry over."""
    torch.manual_seed(0)
    module = MLP()
    optimizer = _torch_optimizer(module, named)
    if stepped_before:
        for step in range(2):
            x, y = make_batch("mlp", 100 + step, 0, 0)
            loss_fn("mlp", module(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    ref_module, ref_optimizer = copy.deepcopy((module, optimizer))  # one copy: same mapping
    ref = nn.parallel.DistributedDataParallel(ref_module)
    ours = fgp.DistributedDataParallel(module, bucket_cap_mb=0.0001, schedule=schedule,
                                       overlap_plan="layout" if schedule == "two_stage"
                                       else "auto")
    sharded = fgp.ShardedOptimizer.from_optimizer(ours, optimizer, max_grad_norm=CLIP)
    again = fgp.ShardedOptimizer.from_optimizer(ours, sharded)  # already one: itself
    for step in range(steps):
        x, y = make_batch("mlp", step, 0, rank)
        loss_fn("mlp", ours(x), y).backward()
        sharded.step()
        sharded.zero_grad()
        loss_fn("mlp", ref(x), y).backward()
        reference_clip_(list(ref.parameters()), CLIP)  # torch's rule, summed in float64
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    ours.synchronize()
    full = sharded.full_state_dict()
    theirs = ref_optimizer.state_dict()
    return {
        "class": type(sharded.optim).__name__,
        "same object again": again is sharded,
        "max diff": max(float((a.detach() - b.detach()).abs().max())
                        for a, b in zip(module.parameters(), ref_module.parameters())),
        "groups": [{k: v for k, v in g.items() if k not in ("params", "param_names")}
                   for g in sharded.param_groups],
        "torch groups": [{k: v for k, v in g.items() if k not in ("params", "param_names")}
                         for g in ref_optimizer.param_groups],
        "state keys": (sorted(full["state"]), sorted(theirs["state"])),
        "param_names": ([g.get("param_names") for g in full["param_groups"]],
                        [g.get("param_names") for g in theirs["param_groups"]]),
        "moments diff": max(float((full["state"][i]["exp_avg_sq"]
                                   - theirs["state"][i]["exp_avg_sq"]).abs().max())
                            for i in theirs["state"]),
        "frozen weight moved": not torch.equal(module.net[0].weight,
                                                ref_module.net[0].weight),
    }
