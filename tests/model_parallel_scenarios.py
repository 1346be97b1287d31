"""Tensor (model) parallelism beside the wrapper: Megatron-style layers of plain
tensors over a tensor-parallel group, the wrapper over the data-parallel group, and
the norm over both (``ShardedOptimizer(..., model_parallel_group=...)``).

Imported by the spawned ranks (module-level functions only).
"""
from __future__ import annotations

import contextlib
import copy
import math
import warnings
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fgpsdp_runtime as fgp

from .scenarios import loss_fn, make_batch


class _GatherGradients(torch.autograd.Function):
    """Megatron's copy to the tensor-parallel region: identity forward, the
    gradient all-reduced over the group in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOutputs(torch.autograd.Function):
    """Megatron's reduce from the tensor-parallel region: the partial outputs
    all-reduced in forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TensorParallelMLP(nn.Module):
    """A column-parallel then a row-parallel Linear of plain tensors over ``group``
    (each of its 2 ranks holds half the hidden features), then a replicated bias
    and LayerNorm."""

    def __init__(self, tp_rank: int, group):
        super().__init__()
        self.group = group
        torch.manual_seed(1234)  # the full layers alike everywhere; each rank its half
        full_in, full_out = nn.Linear(13, 24), nn.Linear(24, 5, bias=False)
        half = slice(12 * tp_rank, 12 * tp_rank + 12)
        self.column = nn.Linear(13, 12)
        self.row = nn.Linear(12, 5, bias=False)
        with torch.no_grad():
            self.column.weight.copy_(full_in.weight[half])
            self.column.bias.copy_(full_in.bias[half])
            self.row.weight.copy_(full_out.weight[:, half])
        self.bias = nn.Parameter(torch.zeros(5))
        self.norm = nn.LayerNorm(5)
        self.mark_shards()

    def mark_shards(self) -> None:
        """Megatron's mark of a parameter sharded over the tensor-parallel group
        (a deep copy of a parameter does not keep it)."""
        for sharded in (self.column.weight, self.column.bias, self.row.weight):
            sharded.tensor_model_parallel = True

    def forward(self, x):
        h = torch.relu(self.column(_GatherGradients.apply(x, self.group)))
        return self.norm(_SumOutputs.apply(self.row(h), self.group) + self.bias)

    def __deepcopy__(self, memo):  # (a process group does not copy)
        copied = nn.Module.__new__(type(self))
        copied.__dict__ = {k: v if k == "group" else copy.deepcopy(v, memo)
                           for k, v in self.__dict__.items()}
        copied.mark_shards()
        return copied


def _two_by_two():
    """A 2 x 2 ("dp", "tp") mesh: it, this rank's coordinates, its tensor-parallel group."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh.get_coordinate()
    return mesh, dp_rank, tp_rank, mesh["tp"].get_group()


def _beside_torch_ddp(base: nn.Module, mesh, schedule: str, **optimizer_kw):
    """fgpsdp's wrapper of ``base`` over mesh["dp"] (two_stage: the layout plan and
    small buckets, so that stage 1 speculates) with a ShardedOptimizer (AdamW), and
    torch DDP of a copy with its AdamW: (ours, ref, opt, ref_opt)."""
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_mesh=mesh["dp"])
    speculate = {"overlap_plan": "layout", "bucket_cap_mb": 0.0001} \
        if schedule == "two_stage" else {}
    ours = fgp.DistributedDataParallel(base, device_mesh=mesh["dp"], schedule=schedule,
                                       **speculate)
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2, **optimizer_kw)
    return ours, ref, opt, torch.optim.AdamW(ref.parameters(), lr=1e-2)


def _param_diff(ours: fgp.DistributedDataParallel, ref: nn.Module) -> float:
    return max(float((a.detach().double() - b.detach().double()).abs().max())
               for a, b in zip(ours.module.parameters(), ref.module.parameters()))


def _megatron_clip(model: nn.Module, group, max_norm: float, pp_group=None) -> float:
    """Megatron's clip in float64: the marked shards' squares summed over the
    tensor-parallel group (``group``, None without one), the replicated parameters'
    once, the stages' sums summed over ``pp_group`` (if any); torch's coefficient."""
    params = [p for p in model.parameters() if p.grad is not None]
    sharded = torch.tensor(sum(float(p.grad.double().pow(2).sum()) for p in params
                               if getattr(p, "tensor_model_parallel", False)),
                           dtype=torch.float64)
    if group is not None:
        torch.distributed.all_reduce(sharded, group=group)
    replicated = sum(float(p.grad.double().pow(2).sum()) for p in params
                     if not getattr(p, "tensor_model_parallel", False))
    stage = torch.tensor(float(sharded) + replicated, dtype=torch.float64)
    if pp_group is not None:
        torch.distributed.all_reduce(stage, group=pp_group)
    total = math.sqrt(float(stage))
    coefficient = max_norm / (total + 1e-6)
    if coefficient < 1.0:
        torch._foreach_mul_([p.grad for p in params],
                            torch.tensor(coefficient, dtype=torch.float64))
    return total


def clipped_beside_tensor_parallel(rank: int, world_size: int,
                                   cfg: dict[str, Any]) -> dict[str, Any]:
    """A 2 x 2 ("dp", "tp") mesh; ours over mesh["dp"] clipped by ``max_grad_norm``
    or ``clip_grad_norm_`` (cfg ``clip``) with ``model_parallel_group`` (cfg ``mp``),
    torch DDP beside it clipped as Megatron clips; 4 AdamW steps. cfg ``schedule``,
    ``max_norm``."""
    mesh, dp_rank, tp_rank, tp_group = _two_by_two()
    return _clipped_steps(TensorParallelMLP(tp_rank, tp_group), mesh, cfg, dp_rank, 0,
                          tp_group if cfg["mp"] else None, None, tp_group, None)


def _clipped_steps(base: nn.Module, mesh, cfg: dict[str, Any], dp_rank: int, micro: int,
                   tp_group, pp_group, ref_tp_group, ref_pp_group) -> dict[str, Any]:
    """``base`` under ours over mesh["dp"] (``model_parallel_group=tp_group``,
    ``pipeline_parallel_group=pp_group``) and torch DDP clipped as Megatron clips over
    ``ref_tp_group`` and ``ref_pp_group``; 4 AdamW steps on the batches of ``micro``."""
    max_norm, by_call = cfg["max_norm"], cfg["clip"] == "call"
    ours, ref, opt, ref_opt = _beside_torch_ddp(
        base, mesh, cfg["schedule"], max_grad_norm=None if by_call else max_norm,
        model_parallel_group=tp_group, pipeline_parallel_group=pp_group)
    norms = []
    for step in range(4):
        x, y = make_batch("mlp", step, micro, dp_rank)
        loss_fn("mlp", ours(x), y).backward()
        loss_fn("mlp", ref(x), y).backward()
        ref_total = _megatron_clip(ref.module, ref_tp_group, max_norm, ref_pp_group)
        norms.append((float(opt.clip_grad_norm_(max_norm)) if by_call else None, ref_total))
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    ours.synchronize()
    return {"norms": norms, "param_diff": _param_diff(ours, ref),
            "commits": ours.scheduler.commits if ours.scheduler is not None else None}


def clipped_beside_tensor_parallel_many(rank: int, world_size: int,
                                        cfgs: dict[str, dict]) -> dict[str, dict]:
    return {name: clipped_beside_tensor_parallel(rank, world_size, cfg)
            for name, cfg in cfgs.items()}


def clipped_beside_pipeline_stages(rank: int, world_size: int,
                                   cfg: dict[str, Any]) -> dict[str, Any]:
    """Two pipeline stages, each a model of its own trained on batches of its own
    (the norm's coupling, not a pipeline's schedule, is under test). cfg ``layout``:
    "pp x dp", a 2 x 2 ("pp", "dp") mesh of plain MLPs, or "pp x tp", a 2 x 1 x 2
    ("pp", "dp", "tp") mesh of TensorParallelMLPs (the wrapper over a group of one);
    ours with ``pipeline_parallel_group`` (cfg ``pp``) and the tensor-parallel group,
    torch DDP beside it clipped by Megatron's norm over the stages."""
    tensor_parallel = cfg["layout"] == "pp x tp"
    mesh = init_device_mesh("cpu", (2, 1, 2) if tensor_parallel else (2, 2),
                            mesh_dim_names=("pp", "dp", "tp") if tensor_parallel
                            else ("pp", "dp"))
    coordinate = mesh.get_coordinate()
    pp_rank, dp_rank = coordinate[0], coordinate[1]
    pp_group = mesh["pp"].get_group()
    tp_group = mesh["tp"].get_group() if tensor_parallel else None
    if tensor_parallel:
        base = TensorParallelMLP(coordinate[2], tp_group)
    else:
        torch.manual_seed(100 + pp_rank)  # a stage's layers its own
        base = nn.Sequential(nn.Linear(13, 24), nn.ReLU(), nn.Linear(24, 5))
    return _clipped_steps(base, mesh, cfg, dp_rank, pp_rank, tp_group,
                          pp_group if cfg["pp"] else None, tp_group, pp_group)


def clipped_beside_pipeline_stages_many(rank: int, world_size: int,
                                        cfgs: dict[str, dict]) -> dict[str, dict]:
    return {name: clipped_beside_pipeline_stages(rank, world_size, cfg)
            for name, cfg in cfgs.items()}


def _an_unmarked_element(opt: fgp.ShardedOptimizer) -> tuple[int, int]:
    """(bucket, offset in this rank's slice) of an element of a parameter not marked
    ``tensor_model_parallel`` (a replica: the norm counts it on the first rank only)."""
    params = [p for _, p in opt.model.named_trainable_parameters()]
    for b, pieces in enumerate(opt._slice_pieces.by_bucket):
        for index, _, start, _ in pieces:
            if not getattr(params[index], "tensor_model_parallel", False):
                return b, start - opt.model.buckets[b].shard_start
    raise AssertionError("no replicated parameter in this rank's slices")


def an_inf_on_one_rank(rank: int, world_size: int, with_group: bool,
                       where: str = "rank 0") -> list[bool]:
    """At step 1 a reduced slice holds an inf: rank 0's first element ("rank 0"), or
    an element of a replicated parameter on rank 1, a tensor-parallel rank other than
    the first ("replica on rank 1"). Which ranks skip which steps."""
    mesh, dp_rank, tp_rank, tp_group = _two_by_two()
    ours = fgp.DistributedDataParallel(TensorParallelMLP(tp_rank, tp_group),
                                       device_mesh=mesh["dp"], schedule="serial")
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2, max_grad_norm=0.05,
                               model_parallel_group=tp_group if with_group else None)
    skipped = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the skip's warning
        for step in range(3):
            x, y = make_batch("mlp", step, 0, dp_rank)
            loss_fn("mlp", ours(x), y).backward()
            if step == 1 and rank == (0 if where == "rank 0" else 1):
                opt._finish_reduce_scatters()  # (the slice landed: then the inf)
                b, at = (0, 0) if where == "rank 0" else _an_unmarked_element(opt)
                ours.buckets[b].grad_shard[at] = float("inf")
            opt.step()
            skipped.append(opt.last_step_skipped)
            opt.zero_grad()
    return skipped


def an_inf_on_one_rank_both(rank: int, world_size: int) -> dict[Any, list[bool]]:
    return {**{g: an_inf_on_one_rank(rank, world_size, g) for g in (True, False)},
            "replica on rank 1": an_inf_on_one_rank(rank, world_size, True,
                                                    "replica on rank 1")}


def values_clamped_on_one_tensor_parallel_side(rank: int, world_size: int) -> dict[str, Any]:
    """clip_grad_value_ that clamps on tensor-parallel rank 0's shards only (its
    column layer scaled up), then the step clipping by norm: beside torch DDP
    clamped and clipped as Megatron clips."""
    mesh, dp_rank, tp_rank, tp_group = _two_by_two()
    base = TensorParallelMLP(tp_rank, tp_group)
    if tp_rank == 0:
        with torch.no_grad():
            base.column.weight.mul_(20)
            base.column.bias.mul_(20)
    ours, ref, opt, ref_opt = _beside_torch_ddp(base, mesh, "serial", max_grad_norm=0.05,
                                                model_parallel_group=tp_group)
    clamped_here = []
    for step in range(3):
        x, y = make_batch("mlp", step, 0, dp_rank)
        loss_fn("mlp", ours(x), y).backward()
        loss_fn("mlp", ref(x), y).backward()
        # Above every replica's gradient and tensor-parallel rank 1's, below the
        # largest of rank 0's shards'.
        grads = [p.grad for p in ref.module.parameters()]
        top = {marked: max([float(p.grad.abs().max()) for p in ref.module.parameters()
                            if getattr(p, "tensor_model_parallel", False) == marked])
               for marked in (True, False)}
        tops = torch.tensor([top[False] if tp_rank == 0 else max(top.values()),
                             top[True] if tp_rank == 0 else 0.0])
        torch.distributed.all_reduce(tops, op=torch.distributed.ReduceOp.MAX)
        one_sided = bool(tops[1] > tops[0])  # else a clip_value that clamps nothing
        clip_value = float(tops.mean()) if one_sided else float("inf")
        clamped_here.append((one_sided, any(bool((g.abs() > clip_value).any())
                                            for g in grads)))
        opt.clip_grad_value_(clip_value)
        torch.nn.utils.clip_grad_value_(ref.module.parameters(), clip_value)
        _megatron_clip(ref.module, tp_group, 0.05)
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    ours.synchronize()
    return {"clamped_here": clamped_here, "param_diff": _param_diff(ours, ref)}


MICROBATCHES = 4


def _pipeline_stage_module(pp_rank: int) -> nn.Module:
    torch.manual_seed(10 + pp_rank)
    return nn.Sequential(nn.Linear(13, 16), nn.Tanh()) if pp_rank == 0 else nn.Linear(16, 5)


def _pp_by_dp():
    """A 2 x 2 ("pp", "dp") mesh: it, this rank's coordinates, its pipeline group."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh.get_coordinate()
    return mesh, pp_rank, dp_rank, mesh["pp"].get_group()


def _pipeline(submod: nn.Module, pp_rank: int, pp_group, loss_fn, scale_grads: bool = True,
              pipeline: str = "ScheduleGPipe"):
    """torch.distributed.pipelining's ``pipeline`` schedule class over ``submod``, this
    rank's stage of two, MICROBATCHES microbatches."""
    from torch.distributed import pipelining
    stage = pipelining.PipelineStage(submod, pp_rank, 2, torch.device("cpu"), group=pp_group)
    return getattr(pipelining, pipeline)(stage, MICROBATCHES, loss_fn=loss_fn,
                                         scale_grads=scale_grads)


def _run_schedule(schedule, pp_rank: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """One step of the schedule: the first stage takes the inputs, the last the targets."""
    if pp_rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y)


def _scheduled_steps(system: str, mesh, max_norm: Optional[float], steps: int = 3,
                     recipe: bool = True, pipeline: str = "ScheduleGPipe") -> list:
    """torch.distributed.pipelining's ``pipeline`` schedule class (GPipe, 1F1B; 4
    microbatches) over mesh["pp"], data parallel over mesh["dp"]: ``system`` "by
    hand" (each gradient averaged over the data-parallel group after the schedule,
    the pipeline's scale_grads dividing by the microbatches, clipped by Megatron's
    norm over the stages, AdamW), or an fgpsdp schedule with the recipe: the schedule
    under ``model.no_sync()``, ``scale_grads=False`` and the loss divided by the
    microbatches, a ShardedOptimizer with ``pipeline_parallel_group`` and
    ``max_grad_norm`` (without ``recipe``, as a loop written for torch DDP runs it:
    neither). The stage's parameters."""
    pp_rank, dp_rank = mesh.get_coordinate()
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
    module = _pipeline_stage_module(pp_rank)
    if system == "by hand":
        opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
        schedule = _pipeline(module, pp_rank, pp_group, nn.functional.mse_loss,
                             pipeline=pipeline)
        sync = contextlib.nullcontext
    else:
        submod = fgp.DistributedDataParallel(module, device_mesh=mesh["dp"], schedule=system)
        opt = fgp.ShardedOptimizer(submod, torch.optim.AdamW, lr=1e-2, max_grad_norm=max_norm,
                                   pipeline_parallel_group=pp_group)
        divisor = MICROBATCHES if recipe else 1
        schedule = _pipeline(submod, pp_rank, pp_group,
                             lambda out, y: nn.functional.mse_loss(out, y) / divisor,
                             scale_grads=not recipe, pipeline=pipeline)
        sync = submod.no_sync if recipe else contextlib.nullcontext
    for step in range(steps):
        x, y = make_batch("mlp", step, 0, dp_rank)
        with sync():
            _run_schedule(schedule, pp_rank, x, y)
        if system == "by hand":
            for p in module.parameters():
                torch.distributed.all_reduce(p.grad, group=dp_group)
                p.grad.div_(dp_group.size())
            _megatron_clip(module, None, max_norm, pp_group)
        opt.step()
        opt.zero_grad()
    if system != "by hand":
        submod.synchronize()
    return [p.detach().clone() for p in module.parameters()]


def pipeline_schedule_beside_data_parallel_by_hand(rank: int, world_size: int,
                                                   schedules: list[str]) -> dict[str, Any]:
    """A 2 x 2 ("pp", "dp") mesh: each of ``schedules`` against the same training with
    data parallelism by hand (torch DDP under pipelining asserts in its reducer on
    CPU): the largest parameter difference after 3 steps, clipping at 0.05 (binding);
    and ("said") the warnings naming the recipe, without it."""
    mesh = _pp_by_dp()[0]
    diffs: dict[str, Any] = {}
    for pipeline in ("ScheduleGPipe", "Schedule1F1B"):
        expected = _scheduled_steps("by hand", mesh, 0.05, pipeline=pipeline)
        for schedule in schedules:
            ours = _scheduled_steps(schedule, mesh, 0.05, pipeline=pipeline)
            diffs[f"{pipeline} {schedule}"] = max(float((a - b).abs().max())
                                                  for a, b in zip(ours, expected))
    # Without the recipe and without a clip of ours (one would say nothing: it reads
    # the slices), the read of param.grad by the schedule's scale_grads is noticed.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _scheduled_steps("two_stage", mesh, None, recipe=False)
    diffs["said"] = [str(w.message) for w in caught if "scale_grads=False" in str(w.message)]
    return diffs


def loss_scaled_pipeline_with_an_inf(rank: int, world_size: int,
                                     with_group: bool) -> list[tuple[bool, float]]:
    """The recipe under float16-style loss scaling (a ShardedGradScaler per rank, the
    last stage scaling the loss in loss_fn, the first setting its scale with
    ``scaler.scale(torch.zeros(()))``); at step 1 rank 2 (stage 1) holds an inf in
    its local gradient. Per step: (skipped, the scale after update())."""
    mesh, pp_rank, dp_rank, pp_group = _pp_by_dp()
    module = _pipeline_stage_module(pp_rank)
    model = fgp.DistributedDataParallel(module, device_mesh=mesh["dp"], schedule="two_stage")
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2, max_grad_norm=0.05,
                               pipeline_parallel_group=pp_group if with_group else None)
    scaler = fgp.ShardedGradScaler("cpu", init_scale=1024.0)
    schedule = _pipeline(model, pp_rank, pp_group, lambda out, y: scaler.scale(
        nn.functional.mse_loss(out, y) / MICROBATCHES), scale_grads=False)
    steps = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the skip's warning
        for step in range(3):
            x, y = make_batch("mlp", step, 0, dp_rank)
            with model.no_sync():
                if pp_rank == 0:
                    scaler.scale(torch.zeros(()))
                _run_schedule(schedule, pp_rank, x, y)
            if step == 1 and rank == 2:
                next(iter(module.parameters())).grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            steps.append((opt.last_step_skipped, scaler.get_scale()))
    return steps


def loss_scaled_pipeline_with_an_inf_both(rank: int, world_size: int) -> dict[bool, list]:
    return {g: loss_scaled_pipeline_with_an_inf(rank, world_size, g) for g in (True, False)}

