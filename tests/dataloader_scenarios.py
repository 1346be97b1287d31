"""Training loops fed by a DataLoader with worker processes, beside torch DDP.

A DataLoader with ``num_workers > 0`` forks its workers when it is iterated: at
each epoch's start, right after the previous epoch's last step, while the
wrapper's threads are still landing that step's all-gathers (``next_forward``,
``two_stage``) and hold their locks, sockets and shared-memory mappings. The
workers must neither disturb that exchange nor hang at their exit.

Imported by the spawned ranks (module-level functions and classes only).
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import fgpsdp_runtime as fgp

from .profile_window_scenarios import slow_all_gathers
from .scenarios import MLP, param_diff, reference_clip_


class RankBatches(Dataset):
    """Samples that depend only on (rank, index): the same batches whichever worker
    makes them."""

    def __init__(self, rank: int, length: int = 24):
        self.rank = rank
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        g = torch.Generator().manual_seed(1000 * self.rank + index)
        return torch.randn(13, generator=g), torch.randn(5, generator=g)


def train_from_worker_processes(rank: int, world_size: int, schedule: str,
                                persistent_workers: bool) -> dict[str, Any]:
    """3 epochs of 6 AdamW steps, each batch fed to both wrappers, the norm measured
    at every step (``max_grad_norm=1e3`` never clips: two_stage's speculative steps
    commit); an evaluation pass through a second worker-fed loader after every
    epoch. Every
    all-gather sleeps 20 ms on its link worker first, so that the forked workers
    start while the last step's all-gathers are still running (counted)."""
    with slow_all_gathers(0.02):
        return _train_from_worker_processes(rank, world_size, schedule, persistent_workers)


def _train_from_worker_processes(rank: int, world_size: int, schedule: str,
                                 persistent_workers: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    base = MLP()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    speculate = {"overlap_plan": "layout"} if schedule == "two_stage" else {}
    ours = fgp.DistributedDataParallel(base, schedule=schedule, bucket_cap_mb=0.001,
                                       **speculate)
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2, max_grad_norm=1e3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    train = DataLoader(RankBatches(rank), batch_size=4, num_workers=2,
                       persistent_workers=persistent_workers)
    evaluate = DataLoader(RankBatches(rank + world_size, length=8), batch_size=4,
                          num_workers=2)
    eval_losses = []
    forks_beside_all_gathers = 0  # loaders iterated (workers forked) while some ran
    for _ in range(3):
        forks_beside_all_gathers += ours._gathers.in_flight
        for x, y in train:
            for model, optimizer in ((ours, opt), (ref, ref_opt)):
                nn.functional.mse_loss(model(x), y).backward()
                if optimizer is ref_opt:
                    reference_clip_(ref.parameters(), 1e3)
                optimizer.step()
                optimizer.zero_grad()
        forks_beside_all_gathers += ours._gathers.in_flight
        with torch.no_grad():
            eval_losses.append([sum(float(nn.functional.mse_loss(model(x), y))
                                    for x, y in evaluate) for model in (ours, ref)])
    ours.synchronize()
    return {"param_diff": param_diff(ours, ref),
            "eval_losses": eval_losses,
            "forks_beside_all_gathers": forks_beside_all_gathers,
            "speculated": ours.scheduler.commits if ours.scheduler is not None else None}


def train_from_worker_processes_by_schedule(rank: int, world_size: int, schedules: list[str],
                                            persistent_workers: bool) -> dict[str, dict]:
    return {s: train_from_worker_processes(rank, world_size, s, persistent_workers)
            for s in schedules}
