"""opt.step() whose inner optimizer raises on the main thread, part-way, on one
rank or on every rank; the loop calls it again or goes on. Imported by the
spawned ranks."""
from __future__ import annotations

import copy
import threading
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fgpsdp_runtime as fgp

from .scenarios import MLP, loss_fn, make_batch, reference_clip_

MAX_NORM = 1e-3  # clips every step: under two_stage every bucket is stepped at the step


class _Injected(Exception):
    pass


class RaisingOnTheMainThreadAdamW(torch.optim.AdamW):
    """AdamW whose ``fail_at``-th inner step on the main thread in loop step
    ``fail_step`` raises, before writing anything, on the ranks in ``failing``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loop_step, self.fail_step, self.fail_at = 0, 1, 0
        self.failing: set[int] = set()
        self._counts: dict[int, int] = {}

    def step(self, closure=None):
        if threading.current_thread() is threading.main_thread():
            n = self._counts.get(self.loop_step, 0)
            self._counts[self.loop_step] = n + 1
            if (dist.get_rank() in self.failing and self.loop_step == self.fail_step
                    and n == self.fail_at):
                raise _Injected(f"injected on rank {dist.get_rank()}")
        return super().step(closure)


def step_raises(rank: int, world_size: int, schedule: str, who: str, then: str) -> dict[str, Any]:
    """Step 1 raises at its first inner step (``then="go_on"``: the loop zeroes and
    trains on, as torch DDP skipping that step) or at its second (``then="retry"``:
    the loop calls opt.step() again, as torch DDP whose step did not fail), on rank
    1 (``who="one_rank"``) or on every rank; clipping at 1e-3 throughout."""
    torch.manual_seed(0)
    module = MLP()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(module))
    model = fgp.DistributedDataParallel(module, schedule=schedule, bucket_cap_mb=0.0001,
                                        overlap_plan="layout" if schedule == "two_stage" else "auto")
    opt = fgp.ShardedOptimizer(model, RaisingOnTheMainThreadAdamW, lr=1e-2, max_grad_norm=MAX_NORM)
    opt.optim.failing = {1} if who == "one_rank" else set(range(world_size))
    retry = then == "retry"
    # serial and overlap_backward step once per step: only the first can raise.
    opt.optim.fail_at = 1 if retry and model.gathers_overlap_forward else 0
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    caught = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(4):
            opt.optim.loop_step = step
            x, y = make_batch("mlp", step, 0, rank)
            loss_fn("mlp", model(x), y).backward()
            loss_fn("mlp", ref(x), y).backward()
            try:
                opt.step()
            except _Injected:
                caught.append(step)
                if retry:
                    opt.step()
            reference_clip_(ref.parameters(), MAX_NORM)
            if not (step == 1 and not retry and rank in opt.optim.failing):
                ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
    model.synchronize()
    params = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    gathered = [torch.empty_like(params) for _ in range(world_size)]
    dist.all_gather(gathered, params)
    return {"caught": caught,
            "diff_to_ddp": max(float((a - b).abs().max())
                               for a, b in zip(module.parameters(), ref.parameters())),
            "replicas_differ": max(float((g - params).abs().max()) for g in gathered),
            "warned": [str(w.message)[:80] for w in seen if "raised before" in str(w.message)]}
