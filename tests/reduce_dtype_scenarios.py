"""Gradients reduced in another dtype than the parameters': fgpsdp's ``reduce_dtype``
beside torch DDP with the communication hook that does the same.

Imported by the spawned ranks (module-level functions only).
"""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch import nn

import fgpsdp_runtime as fgp

from .scenarios import MLP, make_batch, reference_clip_


def _reduce_in(dtype: torch.dtype):
    """A torch DDP comm hook: cast the bucket to ``dtype``, divide by the world
    size there, all-reduce, cast back (torch's bf16_compress_hook for bfloat16)."""
    def hook(state, bucket):
        world_size = dist.get_world_size()
        buffer = bucket.buffer()
        wire = buffer.to(dtype).div_(world_size)

        def back(fut):
            buffer.copy_(fut.value()[0])
            return buffer
        return dist.all_reduce(wire, async_op=True).get_future().then(back)
    return hook


def _scaled_then_reduced_in(dtype: torch.dtype):
    """A torch DDP comm hook that rounds as fgpsdp's ``reduce_dtype`` does: each rank's
    bucket times 1/N in its own dtype, cast to ``dtype``, the ranks' values added left
    to right in float32 and rounded once to ``dtype``, cast back."""
    def hook(state, bucket):
        world_size = dist.get_world_size()
        buffer = bucket.buffer()
        wire = (buffer * (1.0 / world_size)).to(dtype)
        parts = [torch.empty_like(wire) for _ in range(world_size)]
        dist.all_gather(parts, wire)
        total = parts[0].float()
        for part in parts[1:]:
            total.add_(part)
        buffer.copy_(total.to(dtype))
        done = torch.futures.Future()
        done.set_result(buffer)
        return done
    return hook


def _trained_apart(ours: fgp.DistributedDataParallel, ref: nn.Module, rank: int, case: dict,
                   param_dtype: torch.dtype) -> float:
    """5 AdamW steps of both, ``case["micro"]`` micro-batches each ("accumulate":
    "no_sync", all but the last under no_sync(); "synced", every one reduced),
    torch DDP clipped by ``case["clip"]`` as ours is; the largest parameter
    difference after them."""
    micro = case.get("micro", 1)
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2, max_grad_norm=case.get("clip"))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(5):
        for m in range(micro):
            x, y = make_batch("mlp", step, m, rank)
            synced = m == micro - 1 or case.get("accumulate") == "synced"
            for model in (ours, ref):
                context = model.no_sync() if not synced else contextlib.nullcontext()
                with context:
                    loss = nn.functional.mse_loss(model(x.to(param_dtype)).float(), y) / micro
                    loss.backward()
        if case.get("clip") is not None:
            reference_clip_(list(ref.parameters()), case["clip"])
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    ours.synchronize()
    return max(float((a.detach().double() - b.detach().double()).abs().max())
               for a, b in zip(ours.module.parameters(), ref.module.parameters()))


def reduced_side_by_side(rank: int, world_size: int, case: dict) -> dict:
    """case: ``reduce_dtype`` and ``param_dtype`` (names of torch dtypes),
    ``schedule``, ``plan`` (two_stage's overlap_plan, "layout" unless given),
    ``local_size`` (hierarchical), ``hook`` ("scaled first": torch DDP's hook rounds as
    fgpsdp does, see _scaled_then_reduced_in) and ``accumulate``: micro-batches
    per step ("no_sync": all but the last under no_sync(); "synced": every one
    reduced)."""
    reduce_dtype = getattr(torch, case["reduce_dtype"])
    param_dtype = getattr(torch, case.get("param_dtype", "float32"))
    schedule = case.get("schedule", "two_stage")
    torch.manual_seed(0)
    base = MLP().to(param_dtype)
    reference = copy.deepcopy(base)
    kw = {"overlap_plan": case.get("plan", "layout")} if schedule == "two_stage" else {}
    if "local_size" in case:
        kw["topology"] = fgp.Topology(local_size=case["local_size"])
    ours = fgp.DistributedDataParallel(base, schedule=schedule, bucket_cap_mb=0.0001,
                                       reduce_dtype=reduce_dtype, **kw)
    ref = nn.parallel.DistributedDataParallel(reference)
    hook = _scaled_then_reduced_in if case.get("hook") == "scaled first" else _reduce_in
    ref.register_comm_hook(None, hook(reduce_dtype))
    diff = _trained_apart(ours, ref, rank, case, param_dtype)
    return {"diff_to_ddp": diff, "comm_stats": ours.comm_stats(),
            "plan_source": ours.plan.source if ours.plan is not None else None,
            "send_dtypes": sorted({str(s.reduce_dtype) for s in ours.buckets}),
            "grad_dtypes": sorted({str(s.grad_shard.dtype) for s in ours.buckets})}


def reduced_many(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    return [reduced_side_by_side(rank, world_size, case) for case in cases]


def _torch_hook(name: str):
    """One of torch's own hooks, by name ("fp16_compress_wrapper(allreduce_hook)"
    wraps)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    if "(" in name:
        wrapper, inner = name.rstrip(")").split("(")
        return getattr(default_hooks, wrapper)(getattr(default_hooks, inner))
    return getattr(default_hooks, name)


def hooked_side_by_side(rank: int, world_size: int, case: dict) -> dict:
    """torch's own hook ``case["hook"]`` registered on both sides: fgpsdp's wrapper
    (built without reduce_dtype) and torch DDP; AdamW, 5 steps. case: ``hook``,
    ``schedule``, ``param_dtype``, ``state`` ("group": the wrapper's process group,
    else None), ``clip``, ``reference`` ("scaled first": torch DDP's hook rounds as
    fgpsdp's reduction does)."""
    param_dtype = getattr(torch, case.get("param_dtype", "float32"))
    schedule = case.get("schedule", "two_stage")
    torch.manual_seed(0)
    base = MLP().to(param_dtype)
    reference = copy.deepcopy(base)
    kw = {"overlap_plan": "layout"} if schedule == "two_stage" else {}
    ours = fgp.DistributedDataParallel(base, schedule=schedule, bucket_cap_mb=0.0001, **kw)
    ref = nn.parallel.DistributedDataParallel(reference)
    state = ours.process_group if case.get("state") == "group" else None
    ours.register_comm_hook(state, _torch_hook(case["hook"]))
    # torch DDP takes its bfloat16 hooks on NCCL only: on gloo the same arithmetic
    # (cast, divide, all-reduce, cast back) by a hook of this file's.
    # "scaled first": a hook rounding as fgpsdp does (see _scaled_then_reduced_in).
    if case.get("reference") == "scaled first":
        ref_hook = _scaled_then_reduced_in(ours.reduce_dtype)
    elif "bf16" in case["hook"]:
        ref_hook = _reduce_in(torch.bfloat16)
    else:
        ref_hook = _torch_hook(case["hook"])
    ref.register_comm_hook(state, ref_hook)
    diff = _trained_apart(ours, ref, rank, case, param_dtype)
    return {"diff_to_ddp": diff, "comm_stats": ours.comm_stats(),
            "send_dtypes": sorted({str(s.reduce_dtype) for s in ours.buckets}),
            "reduce_dtype": str(ours.reduce_dtype)}


def hooked_many(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    return [hooked_side_by_side(rank, world_size, case) for case in cases]
