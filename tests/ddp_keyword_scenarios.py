"""torch DDP's constructor keywords, given alike to torch DDP and to fgpsdp.

Imported by the spawned ranks (module-level functions only).
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fgpsdp_runtime as fgp

from .model_parallel_scenarios import TensorParallelMLP
from .scenarios import BatchNormNet, loss_fn, make_batch, train_both


def _state(module: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return ([p.detach().clone() for p in module.parameters()],
            [b.detach().clone() for b in module.buffers()])


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _max_diff(a, b) -> float:
    return max(float((x.detach().double() - y.detach().double()).abs().max())
               for x, y in zip(a, b))


def train_with_keywords(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Build both wrappers with ``cfg["kw"]``; report what the construction synced
    and how far 4 AdamW steps end from torch DDP's, per rank."""
    kw = dict(cfg["kw"])
    if kw.pop("device_mesh", False):
        kw["device_mesh"] = init_device_mesh("cpu", (world_size,))
    # Rank-local starting values (parameters alike when nothing syncs them, as
    # init_sync=False demands), BatchNorm statistics rank-local as well.
    torch.manual_seed(1234 if kw.get("init_sync") is False else 1234 + rank)
    base = BatchNormNet()
    with torch.no_grad():
        base.bn.running_mean.fill_(0.1 * rank)
        base.bn.running_var.fill_(1.0 + rank)
    if cfg.get("ignore"):  # torch's hook for rank-local buffers and parameters
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            base, cfg["ignore"])
    before = _state(base)
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), **kw)
    ours = fgp.DistributedDataParallel(base, **kw, **cfg.get("ours_kw", {}))
    if cfg.get("late_static_graph"):  # as trainers' strategies do after wrapping
        ours._set_static_graph()
        ref._set_static_graph()
    result = {
        "own_params_kept": (_equal(_state(ours.module)[0], before[0]),
                            _equal(_state(ref.module)[0], before[0])),
        "own_buffers_kept": (_equal(_state(ours.module)[1], before[1]),
                             _equal(_state(ref.module)[1], before[1])),
        "broadcast_buffers": (ours.broadcast_buffers, ref.broadcast_buffers),
        "n_buckets": len(ours.bucket_layouts), "bucket_cap_mb": ours.bucket_cap_mb,
        # Attributes torch DDP keeps, read back by user code.
        "attributes": [(name, getattr(ours, name), getattr(ref, name)) for name in (
            "device", "dim", "static_graph", "gradient_as_bucket_view", "find_unused_parameters",
            "require_forward_param_sync", "require_backward_grad_sync", "mixed_precision",
            "forward_sync_buffers")] + [
            ("will_sync_module_buffers()", ours.will_sync_module_buffers(),
             ref.will_sync_module_buffers()),
            # torch 2.15's; on an older torch, what the wrapper was given.
            ("lazy_bucket_allocation", ours.lazy_bucket_allocation,
             getattr(ref, "lazy_bucket_allocation",
                     {**kw, **cfg.get("ours_kw", {})}.get("lazy_bucket_allocation", False)))],
        # The group object itself, never None (code calls model.process_group.size()).
        "same_process_group": ours.process_group is ref.process_group,
    }
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for step in range(4):
        x, y = make_batch("bn_frozen", step, 0, rank)
        loss_fn("bn_frozen", ours(x), y).backward()
        loss_fn("bn_frozen", ref(x), y).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    ours.synchronize()
    result["param_diff"] = _max_diff(ours.module.parameters(), ref.module.parameters())
    result["buffer_diff"] = _max_diff(ours.module.buffers(), ref.module.buffers())
    return result


def train_many_with_keywords(rank: int, world_size: int,
                             cfgs: dict[str, dict]) -> dict[str, dict]:
    return {name: train_with_keywords(rank, world_size, cfg) for name, cfg in cfgs.items()}


def _torch_ddp_and_ours(schedule: str) -> tuple[nn.Module, fgp.DistributedDataParallel]:
    """BatchNormNet (seed 1234) wrapped by torch DDP and by fgpsdp under ``schedule``;
    under two_stage with tiny buckets and the layout's plan, so that it speculates."""
    torch.manual_seed(1234)
    base = BatchNormNet()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    speculate = {"overlap_plan": "layout", "bucket_cap_mb": 0.0001} \
        if schedule == "two_stage" else {}
    return ref, fgp.DistributedDataParallel(base, schedule=schedule, **speculate)


def _raised(call) -> Any:
    try:
        call()
    except RuntimeError as error:
        return str(error)
    return None


def manual_backward_finalization(rank: int, world_size: int, schedule: str) -> dict[str, Any]:
    """torch 2.15 DDP's ``require_manual_backward_finalization`` loop: 4 AdamW steps of
    two micro-batches (the first under no_sync()), ``finalize_backward()`` after the
    synchronized backward; torch DDP runs the same loop where its torch has the
    API, else without it. Also the misuse torch refuses: the call without the flag,
    and inside no_sync()."""
    ref, ours = _torch_ddp_and_ours(schedule)
    models = [ours] + ([ref] if hasattr(ref, "finalize_backward") else [])
    out: dict[str, Any] = {"torch_has_it": len(models) == 2,
                           "unrequested": [_raised(m.finalize_backward) for m in models]}
    for model in models:
        model.require_manual_backward_finalization = True
    out["required"] = ours.require_manual_backward_finalization
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    # Per wrapper, ours first: what each call raised (None: nothing).
    out["inside_no_sync"] = [[] for _ in models]
    out["after_backward"] = [[] for _ in models]
    for step in range(4):
        for model, optimizer in ((ours, opt), (ref, ref_opt)):
            x, y = make_batch("bn_frozen", step, 0, rank)
            with model.no_sync():
                loss_fn("bn_frozen", model(x), y).backward()
                if model in models:
                    out["inside_no_sync"][models.index(model)].append(
                        _raised(model.finalize_backward))
            x, y = make_batch("bn_frozen", step, 1, rank)
            loss_fn("bn_frozen", model(x), y).backward()
            if model in models:
                out["after_backward"][models.index(model)].append(
                    (model.should_finalize_after_backward, _raised(model.finalize_backward)))
            optimizer.step()
            optimizer.zero_grad()
    ours.synchronize()
    out["speculated"] = ours.scheduler.commits + ours.scheduler.rollbacks \
        if ours.scheduler is not None else 0
    out["param_diff"] = _max_diff(ours.module.parameters(), ref.module.parameters())
    return out


def manual_backward_finalization_by_schedule(rank: int, world_size: int,
                                             schedules: list[str]) -> dict[str, dict]:
    return {s: manual_backward_finalization(rank, world_size, s) for s in schedules}



def data_parallel_slice_of_a_mesh(rank: int, world_size: int, schedule: str) -> dict[str, Any]:
    """``device_mesh=mesh["dp"]`` of a 2 x 2 ("dp", "tp") mesh, beside
    tensor-parallel layers of plain tensors over ``mesh["tp"]``, alike to torch DDP:
    4 AdamW steps, each data-parallel rank's data its own (the same within a
    tensor-parallel pair)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh.get_coordinate()
    base = TensorParallelMLP(tp_rank, mesh["tp"].get_group())
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_mesh=mesh["dp"])
    speculate = {"overlap_plan": "layout", "bucket_cap_mb": 0.0001} \
        if schedule == "two_stage" else {}
    ours = fgp.DistributedDataParallel(base, device_mesh=mesh["dp"], schedule=schedule,
                                       **speculate)
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    train_both(((ours, opt), (ref, ref_opt)), dp_rank, 4)
    ours.synchronize()
    return {"group_ranks": torch.distributed.get_process_group_ranks(ours.process_group),
            "same_process_group": ours.process_group is ref.process_group,
            "speculated": ours.scheduler.commits if ours.scheduler is not None else None,
            "param_diff": _max_diff(ours.module.parameters(), ref.module.parameters())}


def data_parallel_slice_of_a_mesh_by_schedule(rank: int, world_size: int,
                                              schedules: list[str]) -> dict[str, dict]:
    return {s: data_parallel_slice_of_a_mesh(rank, world_size, s) for s in schedules}


def buffers_changed_after_wrapping(rank: int, world_size: int, schedule: str) -> dict[str, Any]:
    """After the first step every rank registers a new buffer (its own value) and
    replaces a BatchNorm statistic with a new tensor (its own value), in both
    wrappers: the forward's broadcast must carry rank 0's of both, as torch DDP's
    (which reads the module's buffers again at every sync) does. 4 AdamW steps."""
    ref, ours = _torch_ddp_and_ours(schedule)
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    pairs = ((ours, opt), (ref, ref_opt))
    train_both(pairs, rank, 1, "bn_frozen")
    for model in (ours, ref):
        model.module.bn.register_buffer("late", torch.full((3,), 1.0 + rank))
        model.module.bn.running_mean = torch.full((23,), 0.5 * rank)
    train_both(pairs, rank, 3, "bn_frozen", start=1)
    ours.synchronize()
    return {"param_diff": _max_diff(ours.module.parameters(), ref.module.parameters()),
            "buffer_diff": _max_diff(ours.module.buffers(), ref.module.buffers()),
            "late": ours.module.bn.late.tolist(),
            "speculated": ours.scheduler.commits if ours.scheduler is not None else None}


def buffers_changed_after_wrapping_by_schedule(rank: int, world_size: int,
                                               schedules: list[str]) -> dict[str, dict]:
    return {s: buffers_changed_after_wrapping(rank, world_size, s) for s in schedules}
