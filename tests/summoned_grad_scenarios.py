"""opt.summon_full_grads(): a loop's edits of p.grad between backward and step, beside
torch DDP making the same edits to its p.grad.

Imported by the spawned ranks (module-level functions only).
"""
from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

import fgpsdp_runtime as fgp
from .grad_read_scenarios import adamw_beside_torch_ddp, backward_both, bits
from .scenarios import MODELS, reference_clip_


def edit_grads(module: nn.Module, step: int) -> list[str]:
    """What a loop might do to p.grad between backward and step, the same on every rank:
    zero a third of the elements (a mask, as for rows kept fixed), add a small fixed
    noise, and replace the last gradient by a new tensor (``p.grad = p.grad * 2``).
    Returns the names of the parameters that held a gradient."""
    named = [(n, p) for n, p in module.named_parameters() if p.grad is not None]
    for number, (name, param) in enumerate(named):
        g = torch.Generator().manual_seed(1000 * step + number)
        keep = (torch.rand(param.shape, generator=g) > 1 / 3).to(param.grad.dtype)
        param.grad.mul_(keep)
        param.grad.add_(torch.randn(param.shape, generator=g) * 1e-3)
    if named:
        last = named[-1][1]
        last.grad = last.grad * 2
    return [n for n, _ in named]


def edits_beside_torch_ddp(rank: int, world_size: int, schedule: str, model_name: str,
                           clip: str = "none", local_size: int = 0) -> dict:
    """Three steps of AdamW beside torch DDP. After each backward both edit p.grad alike
    (fgpsdp's inside opt.summon_full_grads()); ``clip``: then "ours" clips by the norm
    (opt.clip_grad_norm_ beside torch's rule with the float64 total), "torch_inside"
    runs torch.nn.utils.clip_grad_norm_ over model.parameters() inside the block (as
    torch DDP's loop runs it over its p.grad). The second step accumulates two
    micro-batches, the first under no_sync().

    Returns {"mismatches": [...], "differences": bits differing per step, "largest":
    the largest parameter difference, "grads_inside_bits": gradients seen in the block
    that differ from torch DDP's p.grad in any bit, "after": whether any p.grad was set
    after the block, "warnings": fgpsdp's, "rollbacks": two_stage's}."""
    torch.manual_seed(1234)
    base = MODELS[model_name]()
    ours, opt, ref, ref_opt = adamw_beside_torch_ddp(base, model_name, schedule, local_size)
    held = list(base.parameters())  # (read before any backward: no clip warning)
    found: list[str] = []
    differences, largest, inside_bits, after = [], 0.0, 0, False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            backward_both(ours, ref, model_name, step, rank)
            with opt.summon_full_grads():
                ref_named = dict(ref.module.named_parameters())
                for name, param in ours.module.named_parameters():
                    mine, theirs = param.grad, ref_named[name].grad
                    if (mine is None) != (theirs is None):
                        found.append(f"step {step}: {name}: p.grad "
                                     f"{'None' if mine is None else 'set'} in the block, "
                                     f"torch DDP's {'None' if theirs is None else 'set'}")
                    elif mine is not None:
                        inside_bits += mine.stride() != theirs.stride() or \
                            not torch.equal(bits(mine), bits(theirs))
                edited = edit_grads(ours.module, step)
                if clip == "torch_inside":
                    torch.nn.utils.clip_grad_norm_(ours.parameters(), 1e-3)
            if edited != edit_grads(ref.module, step):
                found.append(f"step {step}: edited {edited}, torch DDP's side other ones")
            if clip == "torch_inside":
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
            elif clip == "ours":
                opt.clip_grad_norm_(1e-3)
                reference_clip_(ref.parameters(), 1e-3)
            after |= any(p.grad is not None for p in held)
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            ours.synchronize()
            pairs = list(zip(ours.module.parameters(), ref.module.parameters()))
            differences.append(sum(not torch.equal(bits(a), bits(b)) for a, b in pairs))
            largest = max([largest] + [float((a - b).abs().max()) for a, b in pairs
                                       if a.numel()])
    scheduler = ours.scheduler
    return {"mismatches": found, "differences": differences, "largest": largest,
            "grads_inside_bits": inside_bits, "after": after,
            "warnings": [str(w.message) for w in caught if "fgpsdp" in str(w.message)],
            "rollbacks": scheduler.rollbacks if scheduler is not None else 0}


def blocks_that_change_nothing(rank: int, world_size: int, block: str) -> dict:
    """Four steps of SGD with momentum under two_stage, no clipping (its speculative
    steps commit), with after each backward ``block``: "none", "read" (a block that
    reads p.grad: a logged norm), "unwritten" (a block that edits, with
    writeback=False). Returns the parameters, and the speculative steps committed and
    rolled back."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                           nn.Linear(32, 4))
    model = fgp.DistributedDataParallel(module, schedule="two_stage", bucket_cap_mb=0.002,
                                        overlap_plan="layout")
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    norms = []
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + rank)
        model(torch.randn(5, 8, generator=g)).pow(2).mean().backward()
        if block == "read":
            with opt.summon_full_grads():
                norms.append(float(module[0].weight.grad.norm()))
        elif block == "unwritten":
            with opt.summon_full_grads(writeback=False):
                for p in module.parameters():
                    p.grad.mul_(3.0)
        opt.step()
        opt.zero_grad()
    model.synchronize()
    return {"params": [p.detach().clone() for p in module.parameters()],
            "commits": model.scheduler.commits, "rollbacks": model.scheduler.rollbacks,
            "norms": norms}


def some_parameters(rank: int, world_size: int) -> dict:
    """summon_full_grads(params=[...]): only those get p.grad in the block (the others
    stay None), an edit of them reaches the step, and a frozen parameter named there
    keeps p.grad None. Beside torch DDP editing the same one."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    module[0].bias.requires_grad_(False)
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(module))
    model = fgp.DistributedDataParallel(module, schedule="next_forward", bucket_cap_mb=0.0001)
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(4, 6, generator=g)
    for m in (model, ref):
        m(x).pow(2).sum().backward()
    with opt.summon_full_grads([module[2].weight, module[0].bias]):
        held = [p.grad is not None for p in module.parameters()]
        module[2].weight.grad[0].zero_()
    ref.module[2].weight.grad[0].zero_()
    opt.step()
    ref_opt.step()
    model.synchronize()
    return {"held": held, "equal": [torch.equal(a, b) for a, b in
                                    zip(module.parameters(), ref.module.parameters())]}


def refusals(rank: int, world_size: int, case: str) -> str:
    """What summon_full_grads() says in ``case``; every rank's message."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model = fgp.DistributedDataParallel(module, schedule="two_stage")
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    x = torch.randn(3, 4)
    try:
        if case == "join":
            with model.join():
                model(x).sum().backward()
                with opt.summon_full_grads():
                    pass
        model(x).sum().backward()
        if case == "set_to_none":
            with opt.summon_full_grads():
                module[1].bias.grad = None
        elif case == "stranger":
            with opt.summon_full_grads([torch.zeros(4) if rank == 0 else module[0].weight]):
                pass
        elif case == "different":
            with opt.summon_full_grads([module[rank % 2].weight]):
                pass
        return "no error"
    except (RuntimeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    finally:
        # Each case raised at a point every rank reached alike: the wrapper goes on.
        leftover = [p.grad is not None for p in module.parameters()]
        assert not any(leftover), leftover


def error_in_the_block(rank: int, world_size: int) -> dict:
    """An exception raised in the block (every rank's loop alike) propagates, leaves
    p.grad None and the slices unedited: the step then takes the gradient as it was,
    as a run without the block does."""
    results = {}
    for raise_in_block in (False, True):
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        model = fgp.DistributedDataParallel(module, schedule="two_stage")
        opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
        g = torch.Generator().manual_seed(rank)
        model(torch.randn(3, 4, generator=g)).sum().backward()
        said = None
        if raise_in_block:
            try:
                with opt.summon_full_grads():
                    for p in module.parameters():
                        p.grad.zero_()
                    raise KeyError("the loop's own error")
            except KeyError as error:
                said = str(error)
        after = [p.grad is not None for p in module.parameters()]
        opt.step()
        model.synchronize()
        results[raise_in_block] = {"said": said, "after": after,
                                   "params": [p.detach().clone() for p in module.parameters()]}
        del opt, model
    return results


def masters_partly_edited(rank: int, world_size: int) -> dict:
    """Under master_weights (a bfloat16 MLP): after a clip the float32 slices hold values
    bfloat16 cannot; the block sees them rounded, zeroes some elements of one weight, and
    leaves the rest. Returns whether p.grad was bfloat16 in the block, whether the
    zeroed elements are 0 after it, and whether every other element kept its float32
    value bit for bit (opt.full_grad before and after)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(torch.bfloat16)
    model = fgp.DistributedDataParallel(module, schedule="two_stage", bucket_cap_mb=0.0001,
                                        overlap_plan="layout")
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2, master_weights=True)
    g = torch.Generator().manual_seed(rank)
    model(torch.randn(5, 8, generator=g).to(torch.bfloat16)).float().pow(2).sum().backward()
    opt.clip_grad_norm_(1e-3)
    before = [opt.full_grad(p) for p in module.parameters()]
    representable = all(torch.equal(b, b.to(torch.bfloat16).float()) for b in before)
    mask = torch.rand(module[0].weight.shape, generator=torch.Generator().manual_seed(7)) < 0.3
    with opt.summon_full_grads():
        dtypes = {str(p.grad.dtype) for p in module.parameters()}
        module[0].weight.grad[mask] = 0.0
    after = [opt.full_grad(p) for p in module.parameters()]
    opt.step()
    model.synchronize()
    zeroed = bool((after[0][mask] == 0).all())
    kept = torch.equal(bits(after[0][~mask]), bits(before[0][~mask])) and all(
        torch.equal(bits(a), bits(b)) for a, b in zip(after[1:], before[1:]))
    return {"dtypes": sorted(dtypes), "representable_before": representable,
            "zeroed": zeroed, "kept": kept, "grad_dtype": str(after[0].dtype)}


def calls_inside_the_block(rank: int, world_size: int) -> dict:
    """Each call that reads or changes the reduced slices, made inside the block: refused
    (before, a clip or the scaler's unscale_ there was undone by the block's end, and
    a read said the gradients were unreduced). The block ends without writing back, no
    p.grad stays set, and the loop goes on: the scaler unscales (by 1) and the step after
    the refusals trains as a run without them (torch DDP's parameters)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(module))
    model = fgp.DistributedDataParallel(module, schedule="two_stage", overlap_plan="layout")
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = fgp.ShardedGradScaler("cpu", init_scale=1.0)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    calls = {
        "clip_grad_norm_": lambda: opt.clip_grad_norm_(0.05),
        "clip_grad_value_": lambda: opt.clip_grad_value_(0.01),
        "unscale_": lambda: scaler.unscale_(opt),
        "scaler.step": lambda: scaler.step(opt),
        "step": lambda: opt.step(),
        "zero_grad": lambda: opt.zero_grad(),
        "model.zero_grad": lambda: model.zero_grad(),
        "grad_norms": lambda: opt.grad_norms(),
        "full_grad": lambda: opt.full_grad(module[0].weight),
        "nested": lambda: opt.summon_full_grads().__enter__(),
        "forward": lambda: model(x),
    }
    said = {}
    params = list(module.parameters())  # (read before backward: no clip warning)
    scaler.scale(model(x).pow(2).sum()).backward()  # (a scale of 1: the same gradient)
    ref(x).pow(2).sum().backward()
    for name, call in calls.items():
        try:
            with opt.summon_full_grads():
                for p in module.parameters():
                    p.grad.mul_(0.5)  # (dropped: the block raises)
                call()
            said[name] = "no error"
        except RuntimeError as error:
            said[name] = str(error)
    leftover = any(p.grad is not None for p in params)
    scaler.unscale_(opt)  # (the refused one left the scaler's state as it was)
    opt.step()
    ref_opt.step()
    model.synchronize()
    return {"said": said, "leftover": leftover,
            "equal": all(torch.equal(a, b) for a, b in zip(module.parameters(),
                                                           ref.module.parameters()))}


def ignored_gradients_edited_after_a_read(rank: int, world_size: int, where: str,
                                          schedule: str) -> float:
    """clip_ignored_parameters with max_grad_norm: each rank's own expert (named in
    torch's ignore list) beside replicated layers; after backward the loop makes a call
    that measures the norm (``where``: "after_read", opt.grad_norms(); "after_full_grad";
    "after_clip", opt.clip_grad_norm_ at a bound it stays under; "after_unscale", the
    scaler's unscale_ at a scale of 1; "in_block", a block that edits nothing of the
    slices), then multiplies the expert's gradient by 20 (in the block there), and
    steps. The step must clip by the norm the gradients hold then (before, it clipped
    by the one measured at that call). Returns the largest difference from torch DDP
    clipped by one norm over every rank's gradients."""
    from .expert_scenarios import EXPERT_NAMES, _expert_model, _expert_params, _global_clip
    base = _expert_model(rank)
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ours = fgp.DistributedDataParallel(base, schedule=schedule)
    opt = fgp.ShardedOptimizer(ours, torch.optim.SGD, lr=0.1, clip_ignored_parameters=True,
                               max_grad_norm=0.05)
    expert_opt = torch.optim.SGD(_expert_params(base), lr=0.1)
    shared_ref = [p for n, p in ref.module.named_parameters() if n not in EXPERT_NAMES]
    ref_opt = torch.optim.SGD(list(ref.module.parameters()), lr=0.1)
    scaler = fgp.ShardedGradScaler("cpu", init_scale=1.0) if where == "after_unscale" else None
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        loss = nn.functional.mse_loss(ours(x), y)
        (loss if scaler is None else scaler.scale(loss)).backward()
        nn.functional.mse_loss(ref(x), y).backward()
        if where == "in_block":
            with opt.summon_full_grads():
                base.expert.weight.grad.mul_(20.0)
        else:
            if where == "after_read":
                opt.grad_norms()
            elif where == "after_full_grad":
                opt.full_grad(base.body.weight)
            elif where == "after_clip":
                opt.clip_grad_norm_(1e9)
            elif where == "after_unscale":
                scaler.unscale_(expert_opt)  # (a scale of 1: nothing changes)
                scaler.unscale_(opt)
            base.expert.weight.grad.mul_(20.0)
        ref.module.expert.weight.grad.mul_(20.0)
        _global_clip(shared_ref, _expert_params(ref.module), 0.05)
        if scaler is not None:
            scaler.step(opt)
            scaler.step(expert_opt)
            scaler.update()
        else:
            opt.step()
            expert_opt.step()
        ref_opt.step()
        opt.zero_grad()
        expert_opt.zero_grad()
        ref_opt.zero_grad()
    ours.synchronize()
    return max(float((a - b).abs().max())
               for a, b in zip(base.parameters(), ref.module.parameters()))


def an_expert_frozen_on_one_rank(rank: int, world_size: int, call: str) -> list[float]:
    """clip_ignored_parameters: rank 1 freezes its own expert after wrapping, rank 0
    trains its own; after backward a call that measures the norm (``call``:
    "clip", opt.clip_grad_norm_; "grad_norms"), then the step. Every rank measures the
    norm again alike (before, only rank 0, which still held such parameters, did: its
    step waited in an all-reduce rank 1 never made). Returns the norms clipped by."""
    from .expert_scenarios import _expert_model, _expert_params
    base = _expert_model(rank)
    ours = fgp.DistributedDataParallel(base)
    opt = fgp.ShardedOptimizer(ours, torch.optim.SGD, lr=0.1, clip_ignored_parameters=True,
                               max_grad_norm=1e9)
    if rank == 1:
        for p in _expert_params(base):
            p.requires_grad_(False)
    norms = []
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        nn.functional.mse_loss(ours(x), y).backward()
        if call == "clip":
            norms.append(float(opt.clip_grad_norm_(1e9)))
        else:
            norms.append(sum(float(v) ** 2 for v in opt.grad_norms().values()))
        opt.step()
        opt.zero_grad()
    ours.synchronize()
    return norms
