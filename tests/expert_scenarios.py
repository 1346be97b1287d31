"""Expert-parallel training in small, beside torch DDP: trainable parameters named
in ``_ddp_params_and_buffers_to_ignore`` (each rank's own expert), which the wrapper
leaves to the user.

Imported by the spawned ranks (module-level functions only).
"""
from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import torch
from torch import nn

import fgpsdp_runtime as fgp

from .ddp_keyword_scenarios import _equal, _max_diff


class ExpertNet(nn.Module):
    """Tutel-style expert parallelism in small: ``expert`` is rank-local (each rank
    its own expert, started apart), named in torch's ignore list and trained by an
    optimizer of its own; ``body`` and ``out`` are replicated."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.expert = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.out(h + torch.tanh(self.expert(h)))


EXPERT_NAMES = ["expert.weight", "expert.bias"]


def _expert_params(model: nn.Module) -> list[nn.Parameter]:
    return [model.expert.weight, model.expert.bias]


def _expert_model(rank: int) -> ExpertNet:
    """The replicated layers alike on every rank, each rank's expert its own, named
    in torch's ignore list."""
    torch.manual_seed(1234)
    base = ExpertNet()
    torch.manual_seed(99 + rank)
    base.expert.reset_parameters()
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        base, EXPERT_NAMES)
    return base


def rank_local_experts(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Trainable parameters in ``_ddp_params_and_buffers_to_ignore`` beside torch DDP:
    never broadcast nor reduced, each rank's stepped by a torch optimizer of its own;
    the rest ends where torch DDP's does. ``cfg``: ``schedule``, ``max_norm`` (ours
    by ``max_grad_norm``, torch DDP's by a clip over the wrapper's parameters; each
    side's expert by a clip over its own); ``clip_ignored`` ("max_grad_norm" or
    "call": ours with ``clip_ignored_parameters``, torch DDP's by one global norm
    over its parameters and every rank's expert, as Megatron clips);
    ``inf_at_step``: rank 1's expert gradient holds an inf then; ``zero``: "model"
    (the loop zeroes through the wrapper) or "optimizer_first" (the ShardedOptimizer's
    zero_grad before the experts' step)."""
    base = _expert_model(rank)
    expert_at_start = [p.detach().clone() for p in _expert_params(base)]
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    max_norm = cfg.get("max_norm")
    clip_ignored = cfg.get("clip_ignored")
    # two_stage: the layout plan and small buckets, so that stage 1 speculates.
    speculate = {"overlap_plan": "layout", "bucket_cap_mb": 0.0001} \
        if cfg["schedule"] == "two_stage" else {}
    ours = fgp.DistributedDataParallel(base, schedule=cfg["schedule"], **speculate)
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2,
                               max_grad_norm=None if clip_ignored == "call" else max_norm,
                               clip_ignored_parameters=clip_ignored is not None)
    fused = {"fused": True} if cfg.get("expert_fused") else {}  # no version counter moves
    expert_opt = torch.optim.AdamW(_expert_params(ours.module), lr=1e-2, **fused)
    ref_shared = [p for n, p in ref.module.named_parameters() if n not in EXPERT_NAMES]
    ref_opt = torch.optim.AdamW(ref_shared, lr=1e-2)
    ref_expert_opt = torch.optim.AdamW(_expert_params(ref.module), lr=1e-2, **fused)
    result = {"expert_kept_at_wrap": _equal(_expert_params(ours.module), expert_at_start),
              "expert_grads_local": [],  # per step, how far from torch DDP's
              "norms": [], "skipped": []}
    step_experts = cfg.get("expert_optimizer", True)  # False: the user forgot it
    caught = warnings.catch_warnings(record=True)
    seen = caught.__enter__()
    warnings.simplefilter("always")
    for step in range(4):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        y = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * step + rank + 5))
        nn.functional.mse_loss(ours(x), y).backward()
        nn.functional.mse_loss(ref(x), y).backward()
        if cfg.get("list_experts_late"):  # as a loop that then reduces them over its group
            [p for n, p in ours.module.named_parameters() if n in EXPERT_NAMES]
        # Not reduced: each rank's gradient is its own (torch DDP's too).
        result["expert_grads_local"].append(
            _max_diff([p.grad for p in _expert_params(ours.module)],
                      [p.grad for p in _expert_params(ref.module)]))
        if step == cfg.get("inf_at_step") and rank == 1:
            ours.module.expert.weight.grad[0, 0] = float("inf")
            ref.module.expert.weight.grad[0, 0] = float("inf")
        ref_total = None
        if clip_ignored is not None:
            ref_total = _global_clip(ref_shared, _expert_params(ref.module), max_norm)
            ours_total = float(opt.clip_grad_norm_(max_norm)) if clip_ignored == "call" else None
            result["norms"].append((ours_total, ref_total))
        elif max_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref_shared, max_norm)
            torch.nn.utils.clip_grad_norm_(_expert_params(ours.module), max_norm)
            torch.nn.utils.clip_grad_norm_(_expert_params(ref.module), max_norm)
        opt.step()
        result["skipped"].append(opt.last_step_skipped)
        zero_first = cfg.get("zero") == "optimizer_first"  # resets its own only, as torch's
        if zero_first:
            opt.zero_grad()
        if step_experts and not opt.last_step_skipped:  # (an inf anywhere skips both)
            expert_opt.step()
        if ref_total is None or math.isfinite(ref_total):
            ref_opt.step()
            if zero_first:
                ref_opt.zero_grad()
            ref_expert_opt.step()
        if cfg.get("zero") == "model":  # every parameter's, as nn.Module's
            ours.zero_grad()
            ref.zero_grad()
        else:
            for o in (opt, expert_opt, ref_opt, ref_expert_opt):
                o.zero_grad()
    caught.__exit__(None, None, None)
    result["warnings"] = [str(w.message) for w in seen if "fgpsdp" in str(w.message)]
    # Numbered as AdamW(model.parameters()) numbers them, the experts with no state.
    full = opt.full_state_dict()
    result["full_numbering"] = (full["param_groups"][0]["params"], sorted(full["state"]))
    ours.synchronize()
    named_ours = dict(ours.module.named_parameters())
    named_ref = dict(ref.module.named_parameters())
    result["shared_diff"] = _max_diff([v for n, v in named_ours.items() if n not in EXPERT_NAMES],
                                      [v for n, v in named_ref.items() if n not in EXPERT_NAMES])
    result["expert_diff"] = _max_diff(_expert_params(ours.module), _expert_params(ref.module))
    result["expert_moved"] = not _equal(_expert_params(ours.module), expert_at_start)
    result["expert"] = [p.detach().clone() for p in _expert_params(ours.module)]
    scheduler = ours.scheduler
    result["speculated"] = (scheduler.commits, scheduler.rollbacks) if scheduler else None
    result["in_buckets"] = [n for n in EXPERT_NAMES
                            if ours.param_index(named_ours[n]) is not None]
    return result


def _global_clip(shared: list[nn.Parameter], experts: list[nn.Parameter],
                 max_norm: float) -> float:
    """One norm over the replicated gradients and every rank's own expert's, in
    float64, and torch's clip by it; the norm."""
    shared_sq = sum(float(p.grad.double().pow(2).sum()) for p in shared)
    expert_sq = torch.tensor(sum(float(p.grad.double().pow(2).sum()) for p in experts),
                             dtype=torch.float64)
    torch.distributed.all_reduce(expert_sq)
    total = math.sqrt(shared_sq + float(expert_sq))
    coefficient = max_norm / (total + 1e-6)
    if math.isfinite(total) and coefficient < 1.0:
        torch._foreach_mul_([p.grad for p in shared + experts],
                            torch.tensor(coefficient, dtype=torch.float64))
    return total


def rank_local_experts_many(rank: int, world_size: int,
                            cfgs: dict[str, dict]) -> dict[str, dict]:
    return {name: rank_local_experts(rank, world_size, cfg) for name, cfg in cfgs.items()}


def experts_through_a_join(rank: int, world_size: int, use_join: bool) -> dict[str, Any]:
    """Rank 0 steps 4 times, rank 1 twice, under ``model.join()``; or, without it,
    rank 1 feeds zero gradients in its last two steps, which a joined rank stands
    for. The loop zeroes before each backward, so a joined rank's last expert
    gradients are still there: they must count for nothing in the norm."""
    model = fgp.DistributedDataParallel(_expert_model(rank), schedule="two_stage")
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2, clip_ignored_parameters=True)
    expert_opt = torch.optim.AdamW(_expert_params(model.module), lr=1e-2)
    steps = 4 if rank == 0 or not use_join else 2
    norms = []
    with model.join(enable=use_join):
        for step in range(steps):
            opt.zero_grad()
            expert_opt.zero_grad()
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            y = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * step + rank + 5))
            loss = nn.functional.mse_loss(model(x), y)
            (loss * 0 if rank == 1 and step >= 2 else loss).backward()
            norms.append(float(opt.clip_grad_norm_(0.05)))
            opt.step()
            expert_opt.step()
    model.synchronize()
    return {"norms": norms, "shared": [p.detach().clone() for n, p in
                                       model.module.named_parameters() if n not in EXPERT_NAMES]}


def experts_through_a_join_and_without(rank: int, world_size: int) -> dict[str, Any]:
    return {"join": experts_through_a_join(rank, world_size, True),
            "zeros": experts_through_a_join(rank, world_size, False)}


def experts_under_loss_scaling(rank: int, world_size: int, inf_on: tuple,
                               clip_ignored: bool = False, unscale_experts_first: bool = True,
                               update_each: str = "", new_scales: tuple = (),
                               fused_experts: bool = False, idle_on_rank_0: bool = False,
                               growth_interval: int = 2000, steps: int = 4,
                               two_losses: bool = False) -> dict[str, Any]:
    """Loss scaling with the experts' optimizer on the same ShardedGradScaler, an inf
    in the experts' gradients at step 1 on the ranks ``inf_on``: the scale each
    rank's backward ran with, step by step, the replicated parameters, the fgpsdp
    warnings (``two_losses``: two halves of the loss scaled apart for one backward). The
    experts' lr is 0: whether their step is skipped on a rank changes nothing, so
    the replicated parameters depend on the scales alone. ``update_each``: "sharded"
    or "experts" first, each step followed by its own update(), as Lightning's and
    Accelerate's loops run them. ``new_scales``: at step 2 each rank updates to its
    entry (None: by its infs) (before, a scale given on one rank alone left the others
    in the collective);
    ``fused_experts``: their AdamW fused (torch's scaler never unscales it, it checks
    its infs at its step); ``idle_on_rank_0``: rank 0's expert got no gradient at step
    1, so that rank does not step their optimizer then (torch's scaler refuses one
    with no gradient)."""
    model = fgp.DistributedDataParallel(_expert_model(rank), schedule="two_stage")
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2,
                               max_grad_norm=0.05 if clip_ignored else None,
                               clip_ignored_parameters=clip_ignored)
    expert_opt = torch.optim.AdamW(_expert_params(model.module), lr=0.0, fused=fused_experts)
    scaler = fgp.ShardedGradScaler("cpu", init_scale=1024.0, growth_interval=growth_interval)
    scales = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(steps):
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            y = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * step + rank + 5))
            loss = nn.functional.mse_loss(model(x), y)
            scaled = scaler.scale(loss / 2) + scaler.scale(loss / 2) if two_losses \
                else scaler.scale(loss)
            scales.append(float(scaler.get_scale()))  # the one this backward runs with
            scaled.backward()
            if step == 1 and rank in inf_on:
                model.module.expert.weight.grad[0, 0] = float("inf")
            idle = idle_on_rank_0 and rank == 0 and step == 1
            if idle:
                for p in _expert_params(model.module):
                    p.grad = None
            if update_each:
                for o in ((opt, expert_opt) if update_each == "sharded" else (expert_opt, opt)):
                    if o is expert_opt and idle:
                        continue  # (its step and its update: one update() fewer here)
                    scaler.step(o)
                    scaler.update()
            else:
                if unscale_experts_first and not fused_experts and not idle:
                    scaler.unscale_(expert_opt)
                scaler.step(opt)
                if not idle:
                    scaler.step(expert_opt)
                scaler.update(new_scales[rank] if new_scales and step == 2 else None)
            opt.zero_grad()
            expert_opt.zero_grad()
    model.synchronize()
    return {"scales": scales,
            "shared": [p.detach().clone() for n, p in model.module.named_parameters()
                       if n not in EXPERT_NAMES],
            "warnings": [str(w.message) for w in seen if "fgpsdp" in str(w.message)]}


def experts_under_loss_scaling_cases(rank: int, world_size: int) -> dict[str, Any]:
    return {"inf_on_rank_1": experts_under_loss_scaling(rank, world_size, (1,)),
            "inf_on_both": experts_under_loss_scaling(rank, world_size, (0, 1)),
            **{f"{case}_update_each_{first}_first": experts_under_loss_scaling(
                rank, world_size, inf_on, update_each=first)
               for case, inf_on in (("inf_on_rank_1", (1,)), ("inf_on_both", (0, 1)))
               for first in ("sharded", "experts")},
            "new_scale_on_rank_0": experts_under_loss_scaling(rank, world_size, (),
                                                              new_scales=(2048.0, None)),
            "new_scales_apart": experts_under_loss_scaling(rank, world_size, (),
                                                           new_scales=(128.0, 256.0),
                                                           growth_interval=3, steps=10),
            **{f"{case}_fused{each}": experts_under_loss_scaling(
                rank, world_size, inf_on, fused_experts=True, update_each=first)
               for case, inf_on in (("inf_on_rank_1", (1,)), ("inf_on_both", (0, 1)))
               for each, first in (("", ""), ("_update_each", "sharded"))},
            "inf_on_rank_1_idle_rank_0": experts_under_loss_scaling(rank, world_size, (1,),
                                                                    idle_on_rank_0=True),
            **{f"{case}_growing": experts_under_loss_scaling(rank, world_size, inf_on,
                                                             growth_interval=2, steps=7)
               for case, inf_on in (("inf_on_rank_1", (1,)), ("inf_on_both", (0, 1)))},
            "two_losses": experts_under_loss_scaling(rank, world_size, (), two_losses=True),
            "inf_on_rank_1_idle_rank_0_update_each": experts_under_loss_scaling(
                rank, world_size, (1,), idle_on_rank_0=True, update_each="sharded"),
            "clip_unscaled_first": experts_under_loss_scaling(rank, world_size, (), True),
            "clip_still_scaled": experts_under_loss_scaling(rank, world_size, (), True,
                                                            unscale_experts_first=False)}


def torch_checkpoint_with_expert_state(rank: int, world_size: int) -> dict[str, Any]:
    """A torch DDP loop's checkpoint of one ``AdamW(model.parameters())``, experts
    included, loaded into the ShardedOptimizer: their state is not loaded, said."""
    model = fgp.DistributedDataParallel(_expert_model(rank))
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    plain = _expert_model(rank)
    torch_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    plain(torch.randn(3, 8)).sum().backward()
    torch_opt.step()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.load_state_dict(torch_opt.state_dict())
    return {"warnings": [str(w.message) for w in seen if "fgpsdp" in str(w.message)],
            "loaded": sorted(opt.full_state_dict()["state"])}


def expert_replaced_after_wrapping(rank: int, world_size: int) -> dict[str, Any]:
    """An expert given a new parameter after wrapping (the user's to do: torch DDP
    never looks at it) is the one model.zero_grad() resets and the clip covers."""
    model = fgp.DistributedDataParallel(_expert_model(rank))
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2, max_grad_norm=1e-3,
                               clip_ignored_parameters=True)
    model.module.expert.weight = nn.Parameter(torch.ones(16, 16))
    model(torch.randn(3, 8)).sum().backward()
    grad_before = model.module.expert.weight.grad.clone()
    opt.step()  # clips: the new parameter's gradient too
    clipped = float(model.module.expert.weight.grad.norm()) < 0.5 * float(grad_before.norm())
    model.zero_grad()
    return {"covered": [n for n, p in model.named_ignored_parameters()
                        if p is model.module.expert.weight],
            "clipped": clipped, "reset": model.module.expert.weight.grad is None}


def expert_module_replaced_after_wrapping(rank: int, world_size: int) -> dict[str, Any]:
    """The expert submodule itself replaced after wrapping: model.zero_grad() and the
    clip find the new one's parameters (looked up by path at each use)."""
    model = fgp.DistributedDataParallel(_expert_model(rank))
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2, clip_ignored_parameters=True)
    model.module.expert = nn.Linear(16, 16)
    model(torch.randn(3, 8)).sum().backward()
    covered = [n for n, p in model.named_ignored_parameters()
               if any(p is q for q in _expert_params(model.module))]
    opt.step()
    model.zero_grad()
    return {"covered": covered,
            "reset": all(p.grad is None for p in _expert_params(model.module))}


def replicated_experts(rank: int, world_size: int, replicas: int) -> dict[str, Any]:
    """Each expert held by 2 ranks (expert-data-parallel: ranks e and e + 2 hold
    expert e, their gradients averaged over that pair by the loop), clipped by one
    norm counting each expert once, as Megatron counts them; torch DDP beside it,
    clipped so in float64. Ours with ``ignored_parameter_replicas=replicas``."""
    torch.manual_seed(1234)
    base = ExpertNet()
    torch.manual_seed(99 + rank % 2)  # expert e on ranks e and e + 2
    base.expert.reset_parameters()
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        base, EXPERT_NAMES)
    pairs = [torch.distributed.new_group([e, e + 2]) for e in range(2)]
    pair = pairs[rank % 2]
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ours = fgp.DistributedDataParallel(base, schedule="two_stage")
    max_norm = 0.05
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2, max_grad_norm=max_norm,
                               clip_ignored_parameters=True,
                               ignored_parameter_replicas=replicas)
    expert_opt = torch.optim.AdamW(_expert_params(ours.module), lr=1e-2)
    ref_shared = [p for n, p in ref.module.named_parameters() if n not in EXPERT_NAMES]
    ref_opt = torch.optim.AdamW(ref_shared, lr=1e-2)
    ref_expert_opt = torch.optim.AdamW(_expert_params(ref.module), lr=1e-2)
    norms = []
    for step in range(4):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        y = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * step + rank + 5))
        nn.functional.mse_loss(ours(x), y).backward()
        nn.functional.mse_loss(ref(x), y).backward()
        for model in (ours, ref):  # the expert's data-parallel average, by the loop
            for p in _expert_params(model.module):
                p.grad /= 2
                torch.distributed.all_reduce(p.grad, group=pair)
        shared_sq = sum(float(p.grad.double().pow(2).sum()) for p in ref_shared)
        expert_sq = torch.tensor(sum(float(p.grad.double().pow(2).sum())
                                     for p in _expert_params(ref.module)), dtype=torch.float64)
        torch.distributed.all_reduce(expert_sq)
        total = math.sqrt(shared_sq + float(expert_sq) / 2)  # each expert once
        torch._foreach_mul_([p.grad for p in ref_shared + _expert_params(ref.module)],
                            torch.tensor(max_norm / (total + 1e-6), dtype=torch.float64))
        norms.append((float(opt.clip_grad_norm_(max_norm)), total))
        opt.step()
        expert_opt.step()
        ref_opt.step()
        ref_expert_opt.step()
        for o in (opt, expert_opt, ref_opt, ref_expert_opt):
            o.zero_grad()
    ours.synchronize()
    named_ours = dict(ours.module.named_parameters())
    named_ref = dict(ref.module.named_parameters())
    return {"norms": norms,
            "shared_diff": _max_diff([v for n, v in named_ours.items() if n not in EXPERT_NAMES],
                                     [v for n, v in named_ref.items() if n not in EXPERT_NAMES]),
            "expert_diff": _max_diff(_expert_params(ours.module), _expert_params(ref.module))}


def replicated_experts_both(rank: int, world_size: int) -> dict[int, dict[str, Any]]:
    return {r: replicated_experts(rank, world_size, r) for r in (2, 1)}
