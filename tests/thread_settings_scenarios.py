"""Per-thread and process-wide torch settings changed by the loop after the scheduler
thread started (see fgpsdp_runtime/thread_settings.py).

Imported by the spawned ranks (module-level functions only).
"""
from __future__ import annotations

import copy
import time

import torch
from torch import nn

import fgpsdp_runtime as fgp

from .scenarios import MLP


class TinyHead(nn.Module):
    """An MLP plus a zero-initialised parameter whose gradient is ~1e-38: its Adam
    state falls into subnormal floats, which flushing zeroes."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(13, 37), nn.Tanh(), nn.Linear(37, 5))
        self.head = nn.Module()
        self.head.s = nn.Parameter(torch.zeros(5))  # registered last: stage 1's first bucket

    def forward(self, x):
        return self.net(x) + self.head.s * 1e-36


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def _side_by_side(rank: int, model_class, optimizer_class, steps: int, before_step):
    """fgpsdp two_stage (stage 1 from the first step) beside torch DDP; ``before_step(step,
    phase)`` runs at phase "start" of each step and "between" backward and step.
    Returns (elements of parameters and optimizer state that differ bitwise, commits,
    rollbacks)."""
    torch.manual_seed(0)
    base = model_class()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ours = fgp.DistributedDataParallel(base, schedule="two_stage", overlap_plan="layout",
                                       bucket_cap_mb=0.0001)
    opt = fgp.ShardedOptimizer(ours, optimizer_class, lr=1e-2)
    ref_opt = optimizer_class(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    try:
        for step in range(steps):
            before_step(step, "start")
            x, y = torch.randn(16, 13, generator=g), torch.randn(16, 5, generator=g)
            nn.functional.mse_loss(ours(x), y).backward()
            nn.functional.mse_loss(ref(x), y).backward()
            before_step(step, "between")
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
    finally:
        torch.set_flush_denormal(False)
        torch.set_default_dtype(torch.float32)
    ours.synchronize()
    differing = sum(int((_bits(a) != _bits(b)).sum())
                    for a, b in zip(ours.module.parameters(), ref.module.parameters()))
    full = opt.full_state_dict()["state"]
    for i, entries in ref_opt.state_dict()["state"].items():
        for key, value in entries.items():
            mine = full[i][key]
            if value.dtype != mine.dtype:
                differing += value.numel()
            elif value.dim() and value.dtype == torch.float32:
                differing += int((_bits(value) != _bits(mine)).sum())
            elif not torch.equal(value, mine):
                differing += value.numel()
    return differing, ours.scheduler.commits, ours.scheduler.rollbacks


def flushing_turned_on_after_the_first_step(rank: int, world_size: int) -> tuple:
    def before_step(step, phase):
        if step == 1 and phase == "start":
            torch.set_flush_denormal(True)
    return _side_by_side(rank, TinyHead, torch.optim.AdamW, 4, before_step)


def flushing_turned_on_between_backward_and_step(rank: int, world_size: int) -> tuple:
    def before_step(step, phase):
        if step == 1 and phase == "between":
            time.sleep(0.3)  # stage 1 has stepped (without flushing) by now
            torch.set_flush_denormal(True)
    return _side_by_side(rank, TinyHead, torch.optim.AdamW, 3, before_step)


def default_dtype_changed_between_backward_and_step(rank: int, world_size: int) -> tuple:
    def before_step(step, phase):
        if phase == "start":
            torch.set_default_dtype(torch.float32)
        elif step == 0:
            time.sleep(0.3)  # stage 1 has stepped (created its state) by now
            torch.set_default_dtype(torch.float64)
    return _side_by_side(rank, MLP, torch.optim.NAdam, 3, before_step)


def clip_after_the_thread_count_changes(rank: int, world_size: int, schedule: str) -> dict:
    """A float64 model whose slices span many of the norm kernel's 32K-element chunks;
    every third step is clipped by clip_grad_norm_ after the loop lowered its intra-op
    thread count from 3 to 2 between backward and step (the scheduler thread takes a
    count over only at the next forward, so under two_stage the speculated bucket's
    norm was taken with 3 threads), the other steps commit (a clipped step keeps the
    next from speculating). Returns the parameters, the clipped steps' totals and the
    scheduler's commits and rollbacks: two_stage must clip as serial does, bit for
    bit (before the norm kernel summed in a fixed order, a sum split by the thread
    count differed in its last bits between the two threads)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1000, 1000), nn.Tanh(), nn.Linear(1000, 1000), nn.Tanh(),
                        nn.Linear(1000, 4)).double()
    model = fgp.DistributedDataParallel(net, schedule=schedule, overlap_plan="layout",
                                        bucket_cap_mb=4.0)
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=1.0)
    g = torch.Generator().manual_seed(rank)
    threads = torch.get_num_threads()
    totals = []
    try:
        for step in range(12):
            torch.set_num_threads(3)
            x = torch.randn(16, 1000, generator=g, dtype=torch.float64)
            model(x).square().mean().backward()
            if step % 3 == 2:
                torch.set_num_threads(2)
                totals.append(float(opt.clip_grad_norm_(1e-3)).hex())
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
    model.synchronize()
    return {"params": [p.detach().clone() for p in model.module.parameters()],
            "totals": totals,
            "rollbacks": model.scheduler.rollbacks if model.scheduler else 0,
            "commits": model.scheduler.commits if model.scheduler else 0}
