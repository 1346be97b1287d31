"""opt.step() whose inner optimizer raises on the main thread, part-way, on one
rank or on every rank; the loop calls it again or goes on. Imported by the
spawned ranks."""
from __future__ import annotations

import contextlib
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


def _replicas_differ(module, world_size: int) -> float:
    now = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    gathered = [torch.empty_like(now) for _ in range(world_size)]
    dist.all_gather(gathered, now)
    return max(float((g - now).abs().max()) for g in gathered)


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
        self.armed = False  # the next main-thread inner step raises (once)

    def step(self, closure=None):
        if threading.current_thread() is threading.main_thread():
            if self.armed:
                self.armed = False
                raise _Injected(f"injected on rank {dist.get_rank()}")
            n = self._counts.get(self.loop_step, 0)
            self._counts[self.loop_step] = n + 1
            if (dist.get_rank() in self.failing and self.loop_step == self.fail_step
                    and n == self.fail_at):
                raise _Injected(f"injected on rank {dist.get_rank()}")
        return super().step(closure)


def _backward_both(model, ref, step: int, rank: int) -> torch.Tensor:
    """This rank's batch of ``step`` through ours and torch DDP's, backward; its input."""
    x, y = make_batch("mlp", step, 0, rank)
    loss_fn("mlp", model(x), y).backward()
    loss_fn("mlp", ref(x), y).backward()
    return x


def step_raises(rank: int, world_size: int, schedule: str, who: str, then: str,
                clip: bool = True, join: bool = False) -> dict[str, Any]:
    """Step 1 raises at its first inner step (``then="go_on"``: the loop zeroes and
    trains on, as torch DDP skipping that step) or at its second (``then="retry"``:
    the loop calls opt.step() again, as torch DDP whose step did not fail), on rank
    1 (``who="one_rank"``) or on every rank; clipping at 1e-3 throughout
    (``clip=False``: none, so two_stage's speculative steps commit). Between the
    error and the retry, ``then="state_dict_then_retry"`` saves the model (which
    lands the all-gathers in flight), ``"strict_state_dict_then_retry"`` tries that
    twice under warnings-as-errors, and ``"lr_change_then_retry"`` halves the
    learning rate. ``join``: the loop runs inside ``model.join()``. The
    replicas are compared after every step."""
    torch.manual_seed(0)
    module = MLP()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(module))
    model = fgp.DistributedDataParallel(module, schedule=schedule, bucket_cap_mb=0.0001,
                                        overlap_plan="layout" if schedule == "two_stage" else "auto")
    max_norm = MAX_NORM if clip else None
    opt = fgp.ShardedOptimizer(model, RaisingOnTheMainThreadAdamW, lr=1e-2, max_grad_norm=max_norm)
    opt.optim.failing = {1} if who == "one_rank" else set(range(world_size))
    retry = then != "go_on"
    # serial and overlap_backward step once per step: only the first can raise; so
    # does two_stage without clipping, where the speculative steps committed.
    opt.optim.fail_at = 1 if retry and model.gathers_overlap_forward and clip else 0
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    caught, replicas_differ, strict_saves_raised = [], 0.0, 0
    with warnings.catch_warnings(record=True) as seen, \
            (model.join() if join else contextlib.nullcontext()):
        warnings.simplefilter("always")
        for step in range(4):
            opt.optim.loop_step = step
            _backward_both(model, ref, step, rank)
            try:
                opt.step()
            except _Injected:
                caught.append(step)
                if then == "state_dict_then_retry":
                    model.state_dict()
                if then == "strict_state_dict_then_retry":
                    with warnings.catch_warnings():
                        warnings.simplefilter("error")
                        for _ in range(2):
                            try:
                                model.state_dict()
                            except RuntimeWarning:
                                strict_saves_raised += 1
                if then == "lr_change_then_retry":
                    opt.param_groups[0]["lr"] /= 2
                if retry:
                    opt.step()
            if then == "lr_change_then_retry" and step == 1 and (who == "all_ranks" or rank == 1):
                ref_opt.param_groups[0]["lr"] /= 2
            if clip:
                reference_clip_(ref.parameters(), MAX_NORM)
            if not (step == 1 and not retry and rank in opt.optim.failing):
                ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            model.synchronize()
            replicas_differ = max(replicas_differ, _replicas_differ(module, world_size))
    return {"caught": caught,
            "diff_to_ddp": max(float((a - b).abs().max())
                               for a, b in zip(module.parameters(), ref.parameters())),
            "replicas_differ": replicas_differ,
            "speculating": model.scheduler.speculating if model.scheduler is not None else None,
            "warned": [str(w.message)[:80] for w in seen if "raised before" in str(w.message)],
            "save_warned": sum("while this rank's opt.step() is unfinished" in str(w.message)
                               for w in seen),
            "strict_saves_raised": strict_saves_raised,
            "hyperparameters_warned": sum("changed between opt.step() raising" in str(w.message)
                                          for w in seen)}


def joined_rank_step_raises(rank: int, world_size: int, schedule: str) -> dict[str, Any]:
    """Under model.join(), rank 1's loop ends after 2 steps, rank 0's after 4; the
    first stand-in step rank 1 takes for rank 0's steps raises in its inner
    optimizer. Rank 1 sends the rest unstepped, shadows on, and raises when the
    join ends; rank 0 trains through (before, it waited out the group's timeout)."""
    torch.manual_seed(0)
    module = MLP()
    model = fgp.DistributedDataParallel(module, schedule=schedule, bucket_cap_mb=0.0001)
    opt = fgp.ShardedOptimizer(model, RaisingOnTheMainThreadAdamW, lr=1e-2,
                               max_grad_norm=MAX_NORM)
    raised = None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            with model.join():
                for step in range(4 if rank == 0 else 2):
                    x, y = make_batch("mlp", step, 0, rank)
                    loss_fn("mlp", model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
                opt.optim.armed = rank == 1
        except _Injected as error:
            raised = str(error)
    model.synchronize()
    return {"raised": raised,
            "replicas_differ": _replicas_differ(module, world_size),
            "warned": [str(w.message)[:200] for w in seen if "raised before" in str(w.message)]}


def between_error_and_retry(rank: int, world_size: int, schedule: str, case: str) -> dict[str, Any]:
    """Rank 1's step 1 raises; then, before it calls opt.step() again:

    - "clip": the loop calls opt.clip_grad_norm_(), which raises locally (the
      other rank waits inside its step under serial: a collective there would
      hang) and the retry finishes the step;
    - "send_raises": the error is not the inner optimizer's but comes as the
      first all-gather is queued after its chunk was stepped: the retry must not
      step that chunk again (AdamW's step count stays one per step);
    - "warnings_as_errors": the loop goes on under warnings-as-errors: the
      forward raises the warning, after the rest was sent (before, nothing went).
    Compared with torch DDP whose step did not fail (clip, send_raises)."""
    torch.manual_seed(0)
    module = MLP()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(module))
    model = fgp.DistributedDataParallel(module, schedule=schedule, bucket_cap_mb=0.0001)
    opt = fgp.ShardedOptimizer(model, RaisingOnTheMainThreadAdamW, lr=1e-2, max_grad_norm=MAX_NORM)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    if case != "send_raises":
        opt.optim.failing = {1}
    queue = model.queue_param_all_gather
    armed = [False]

    def queue_once_raising(b):
        if armed[0]:
            armed[0] = False
            raise _Injected("injected as an all-gather is queued")
        queue(b)
    model.queue_param_all_gather = queue_once_raising
    refused, forward_warned = [], []
    for step in range(4):
        opt.optim.loop_step = step
        armed[0] = case == "send_raises" and step == 1 and rank == 1
        x = _backward_both(model, ref, step, rank)
        try:
            opt.step()
        except _Injected:
            if case == "clip":
                try:
                    opt.clip_grad_norm_(1.0)
                except RuntimeError as error:
                    refused.append(str(error)[:100])
            if case == "drop_send_raises":  # going on, the first send raising
                armed[0] = True
                try:
                    model(x)
                except _Injected:
                    refused.append("send raised")  # the next forward sends the rest
            if case == "warnings_as_errors":
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    try:
                        model(x)
                    except RuntimeWarning as warning:
                        forward_warned.append(str(warning)[:40])
            elif case != "drop_send_raises":
                opt.step()
        reference_clip_(ref.parameters(), MAX_NORM)
        if not (case in ("warnings_as_errors", "drop_send_raises") and step == 1 and rank == 1):
            ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    model.synchronize()
    steps = {float(state["step"]) for state in opt.optim.state.values() if "step" in state}
    return {"refused": refused, "forward_warned": forward_warned, "adam_steps": sorted(steps),
            "diff_to_ddp": max(float((a - b).abs().max())
                               for a, b in zip(module.parameters(), ref.parameters())),
            "replicas_differ": _replicas_differ(module, world_size)}


def last_step_raises_in_join(rank: int, world_size: int, schedule: str,
                             warnings_as_errors: bool = False) -> dict[str, Any]:
    """Under model.join(), rank 1's last step raises and its loop ends there (it
    catches the error): the rest goes out as the join begins (before, under
    serial the join's announcement met the other rank still in its step). With
    ``warnings_as_errors`` the warning is raised once the join is over (before,
    it left the join unshadowed and the other rank waiting)."""
    torch.manual_seed(0)
    module = MLP()
    model = fgp.DistributedDataParallel(module, schedule=schedule, bucket_cap_mb=0.0001)
    opt = fgp.ShardedOptimizer(model, RaisingOnTheMainThreadAdamW, lr=1e-2, max_grad_norm=MAX_NORM)
    opt.optim.failing, opt.optim.fail_step = {1}, 2
    raised_warning = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("error" if warnings_as_errors else "always")
        try:
            with model.join():
                for step in range(3):
                    opt.optim.loop_step = step
                    x, y = make_batch("mlp", step, 0, rank)
                    loss_fn("mlp", model(x), y).backward()
                    try:
                        opt.step()
                    except _Injected:
                        break
                    opt.zero_grad()
        except RuntimeWarning as warning:
            raised_warning.append(str(warning))
    model.synchronize()
    return {"warned": sum("raised before" in str(w.message) for w in seen)
            + sum("raised before" in w for w in raised_warning),
            "replicas_differ": _replicas_differ(module, world_size)}
