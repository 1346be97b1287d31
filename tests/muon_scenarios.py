"""MuonWithAdamW under the wrapper beside torch DDP with torch.optim.Muon + AdamW.

Imported by the spawned ranks (module-level functions only).
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch
from torch import nn

import fgpsdp_runtime as fgp

from .scenarios import reference_clip_


class MuonNet(nn.Module):
    """Matrices of both orientations, one stored transposed (its bucket keeps its
    strides), beside an embedding, biases and a norm for AdamW."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 12)
        self.up = nn.Linear(12, 40)
        self.norm = nn.LayerNorm(40)
        self.down = nn.Linear(40, 12, bias=False)
        self.mix = nn.Parameter(torch.randn(40, 12).t())  # (12, 40), column-major
        self.head = nn.Linear(12, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens).mean(1)
        h = h + self.down(nn.functional.gelu(self.norm(self.up(h))))
        h = h + 0.1 * torch.tanh(h @ self.mix) @ self.up.weight
        return self.head(h)


def _groups(module: MuonNet, muon_flag: bool) -> tuple[list[dict], list[dict]]:
    """(Muon groups, AdamW groups), each a list of param-group dicts; with
    ``muon_flag`` each carries use_muon as MuonWithAdamW takes it."""
    muon = [{"params": [module.up.weight, module.down.weight], "lr": 0.02,
             "momentum": 0.95, "weight_decay": 0.01},
            # Muon's defaults otherwise (weight decay 0.1).
            {"params": [module.mix], "lr": 0.01, "nesterov": False,
             "adjust_lr_fn": "match_rms_adamw"}]
    adamw = [{"params": [module.emb.weight, module.head.weight], "lr": 3e-3,
              "weight_decay": 0.1},
             {"params": [module.up.bias, module.norm.weight, module.norm.bias,
                         module.head.bias], "lr": 3e-3, "weight_decay": 0.0}]
    if muon_flag:
        muon = [{**g, "use_muon": True} for g in muon]
        adamw = [{**g, "use_muon": False} for g in adamw]
    return muon, adamw


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 20, (6, 5), generator=g), torch.randn(6, 5, generator=g)


def _max_diff(a, b) -> float:
    return max(float((x.detach().double() - y.detach().double()).abs().max())
               for x, y in zip(a, b))


def trains_as_torch_ddp(rank: int, world_size: int, schedule: str,
                        max_norm: Optional[float],
                        local_size: Optional[int] = None) -> dict[str, Any]:
    """4 steps of fgpsdp's MuonWithAdamW and of torch DDP's Muon + AdamW (float64
    clip), from the same weights and data; then a checkpoint round trip.
    ``local_size``: ranks per node of a hierarchical topology (None: flat)."""
    layout = {"bucket_cap_mb": 0.0005, "overlap_plan": "layout",
              "topology": fgp.Topology(local_size=local_size) if local_size else None}
    torch.manual_seed(0)
    base = MuonNet()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ref_muon_groups, ref_adamw_groups = _groups(ref.module, muon_flag=False)
    ref_opts = [torch.optim.Muon(ref_muon_groups), torch.optim.AdamW(ref_adamw_groups)]
    # Small buckets: each matrix in a bucket of its own, cut between the ranks.
    model = fgp.DistributedDataParallel(base, schedule=schedule, **layout)
    muon_groups, adamw_groups = _groups(model.module, muon_flag=True)
    opt = fgp.ShardedOptimizer(model, fgp.MuonWithAdamW, max_grad_norm=max_norm,
                               param_groups=muon_groups + adamw_groups)
    totals = []
    for step in range(4):
        x, y = _batch(step, rank)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        if max_norm is not None:
            totals.append(reference_clip_(list(ref.parameters()), max_norm))
        for o in ref_opts:
            o.step()
            o.zero_grad()
    model.synchronize()
    out: dict[str, Any] = {
        "param_diff": _max_diff(model.module.parameters(), ref.module.parameters()),
        "totals": totals,
        "clipped_steps": sum(t > max_norm for t in totals),
        "n_buckets": len(model.buckets),
        "speculation_stopped": (model.scheduler.stopped_because
                                if model.scheduler is not None else None),
        "speculated": (model.scheduler.commits + model.scheduler.rollbacks
                       if model.scheduler is not None else 0)}
    # The whole state, as torch.optim's state dict numbers it (groups in the order
    # given): the momentum of each matrix is torch Muon's, bit for bit.
    full = opt.full_state_dict()
    muon_params = [p for g in ref_muon_groups for p in g["params"]]
    out["momentum_diff"] = max(
        float((full["state"][i]["momentum_buffer"] - ref_opts[0].state[p]["momentum_buffer"])
              .abs().max()) for i, p in enumerate(muon_params))
    # Resumed from it in a wrapper of a copy of the module: two more steps alike.
    resumed_model = fgp.DistributedDataParallel(copy.deepcopy(model.module), schedule=schedule,
                                                **layout)
    muon_groups, adamw_groups = _groups(resumed_model.module, muon_flag=True)
    resumed = fgp.ShardedOptimizer(resumed_model, fgp.MuonWithAdamW, max_grad_norm=max_norm,
                                   param_groups=muon_groups + adamw_groups)
    resumed.load_state_dict(full)
    for step in range(4, 6):
        x, y = _batch(step, rank)
        for m, o in ((model, opt), (resumed_model, resumed)):
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    model.synchronize()
    resumed_model.synchronize()
    out["resumed_diff"] = _max_diff(model.module.parameters(),
                                    resumed_model.module.parameters())
    return out


def trains_as_torch_ddp_by_case(rank: int, world_size: int,
                                cases: list[tuple]) -> dict:
    return {case: trains_as_torch_ddp(rank, world_size, *case) for case in cases}


def refusals(rank: int, world_size: int) -> dict[str, str]:
    """What a wrong MuonWithAdamW setup raises, on every rank."""
    model = fgp.DistributedDataParallel(MuonNet())
    module = model.module
    out = {}
    for name, groups in {
        "vector_in_muon_group": [{"params": [module.up.weight, module.up.bias],
                                  "use_muon": True},
                                 {"params": [p for n, p in module.named_parameters()
                                             if n not in ("up.weight", "up.bias")],
                                  "use_muon": False}],
        "no_flag": [{"params": list(module.parameters())}],
        "flag_not_a_bool": [{"params": [module.up.weight], "use_muon": 1},
                            {"params": [p for n, p in module.named_parameters()
                                        if n != "up.weight"], "use_muon": False}],
        "adamw_setting_in_muon_group": [{"params": [module.up.weight], "use_muon": True,
                                         "betas": (0.9, 0.95)},
                                        {"params": [p for n, p in module.named_parameters()
                                                    if n != "up.weight"],
                                         "use_muon": False}],
    }.items():
        try:
            fgp.ShardedOptimizer(model, fgp.MuonWithAdamW, param_groups=groups)
            out[name] = "accepted"
        except (TypeError, ValueError) as error:
            out[name] = f"{type(error).__name__}: {error}"
    return out


def master_weights_as_torch_ddp(rank: int, world_size: int, schedule: str) -> float:
    """A bfloat16 model stepped through float32 master weights (master_weights=True)
    against torch DDP over the bfloat16 model with Muon + AdamW over float32 copies,
    rounded back after each step: the largest parameter difference after 4 steps."""
    torch.manual_seed(0)
    base = MuonNet().to(torch.bfloat16)
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    masters = {p: p.detach().float().clone() for p in ref.parameters()}
    muon_groups, adamw_groups = _groups(ref.module, muon_flag=False)
    for g in muon_groups + adamw_groups:
        g["params"] = [masters[p] for p in g["params"]]
    ref_opts = [torch.optim.Muon(muon_groups), torch.optim.AdamW(adamw_groups)]
    model = fgp.DistributedDataParallel(base, schedule=schedule, bucket_cap_mb=0.0005,
                                        overlap_plan="layout")
    muon_groups, adamw_groups = _groups(model.module, muon_flag=True)
    opt = fgp.ShardedOptimizer(model, fgp.MuonWithAdamW, master_weights=True,
                               param_groups=muon_groups + adamw_groups)
    for step in range(4):
        x, y = _batch(step, rank)
        nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
        nn.functional.mse_loss(ref(x).float(), y).backward()
        for p, m in masters.items():
            m.grad = p.grad.float()
            p.grad = None
        for o in ref_opts:
            o.step()
            o.zero_grad()
        with torch.no_grad():
            for p, m in masters.items():
                p.copy_(m)
    model.synchronize()
    return _max_diff(model.module.parameters(), ref.module.parameters())


def master_weights_by_schedule(rank: int, world_size: int, schedules: list[str]) -> dict:
    return {s: master_weights_as_torch_ddp(rank, world_size, s) for s in schedules}


def newton_schulz_raises_then_retried(rank: int, world_size: int, schedule: str,
                                      in_momentum: bool = False) -> dict[str, Any]:
    """At the third step Newton-Schulz (or, ``in_momentum``, the momentum's update,
    before any exchange) raises on rank 0 (an out of memory, say): every rank must
    raise, none wait; the loop calls opt.step() again and training goes on bit for
    bit as torch DDP's without the error. Also a conversion of a MuonWithAdamW built
    over the module's parameters."""
    import torch.optim._muon as torch_muon
    torch.manual_seed(0)
    base = MuonNet()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ref_muon_groups, ref_adamw_groups = _groups(ref.module, muon_flag=False)
    ref_opts = [torch.optim.Muon(ref_muon_groups), torch.optim.AdamW(ref_adamw_groups)]
    model = fgp.DistributedDataParallel(base, schedule=schedule, bucket_cap_mb=0.0005,
                                        overlap_plan="layout")
    muon_groups, adamw_groups = _groups(model.module, muon_flag=True)
    # (A loop's own optimizer over the module, converted: as Lightning Fabric does.)
    opt = fgp.ShardedOptimizer.from_optimizer(
        model, fgp.MuonWithAdamW(muon_groups + adamw_groups), max_grad_norm=1.0)
    real = torch_muon._zeropower_via_newtonschulz
    out: dict[str, Any] = {"converted": type(opt.optim).__name__}
    for step in range(5):
        x, y = _batch(step, rank)
        nn.functional.mse_loss(model(x), y).backward()
        if step == 2 and rank == 0 and not in_momentum:
            def fails(*args, **kwargs):
                torch_muon._zeropower_via_newtonschulz = real  # once
                raise MemoryError("out of memory (a stand-in)")
            torch_muon._zeropower_via_newtonschulz = fails
        if step == 2 and rank == 0 and in_momentum:
            def lerp_fails(*args, **kwargs):
                del opt.optim._momentum_step  # once: the class's again
                raise MemoryError("out of memory (a stand-in)")
            opt.optim._momentum_step = lerp_fails
        if step == 2:
            try:
                opt.step()
                out["raised"] = None
            except (MemoryError, RuntimeError) as error:
                out["raised"] = f"{type(error).__name__}: {error}"
            torch_muon._zeropower_via_newtonschulz = real
        opt.step()
        opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        reference_clip_(list(ref.parameters()), 1.0)
        for o in ref_opts:
            o.step()
            o.zero_grad()
    model.synchronize()
    out["param_diff"] = _max_diff(model.module.parameters(), ref.module.parameters())
    return out


def newton_schulz_raises_by_schedule(rank: int, world_size: int, schedules: list[str],
                                     in_momentum: bool = False) -> dict[str, dict]:
    return {s: newton_schulz_raises_then_retried(rank, world_size, s, in_momentum)
            for s in schedules}


def settings_that_differ(rank: int, world_size: int) -> dict[str, str]:
    """use_muon differing across ranks, and Newton-Schulz settings it refuses."""
    out = {}
    for name, change in {"use_muon_on_one_rank": {"use_muon": rank == 0},
                         "ns_steps_100": {"ns_steps": 100},
                         "two_coefficients": {"ns_coefficients": (3.4, -4.7)}}.items():
        model = fgp.DistributedDataParallel(MuonNet())
        muon_groups, adamw_groups = _groups(model.module, muon_flag=True)
        muon_groups[1].update(change)  # the group of the transposed matrix
        try:
            fgp.ShardedOptimizer(model, fgp.MuonWithAdamW,
                                 param_groups=muon_groups + adamw_groups)
            out[name] = "accepted"
        except (TypeError, ValueError) as error:
            out[name] = f"{type(error).__name__}: {error}"
        del model
    return out


class ManyMatrices(nn.Module):
    """Small matrices of several shapes in one bucket: most lie in one rank's slice,
    some across two, so a matrix's owner may hold none of it."""

    def __init__(self):
        super().__init__()
        widths = [12, 8, 16, 8, 24, 8, 12]
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=False)
                                    for a, b in zip(widths, widths[1:]))
        self.head = nn.Linear(12, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = nn.functional.one_hot(tokens, 12).float().mean(1)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def many_matrices_as_torch_ddp(rank: int, world_size: int, schedule: str) -> dict[str, Any]:
    """4 steps beside torch DDP's Muon + AdamW, and what the exchanges did: how many
    matrices were orthogonalised by a rank holding none of them, and the bytes each
    rank sent in each exchange over the 4 steps."""
    from fgpsdp_runtime import whole_matrices

    torch.manual_seed(0)
    base = ManyMatrices()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    matrices = lambda m: [layer.weight for layer in m.layers]  # noqa: E731
    rest = lambda m: [m.head.weight, m.head.bias]  # noqa: E731
    ref_opts = [torch.optim.Muon(matrices(ref.module), lr=0.02),
                torch.optim.AdamW(rest(ref.module), lr=3e-3)]
    model = fgp.DistributedDataParallel(base, schedule=schedule)
    opt = fgp.ShardedOptimizer(model, fgp.MuonWithAdamW, param_groups=[
        {"params": matrices(model.module), "use_muon": True, "lr": 0.02},
        {"params": rest(model.module), "use_muon": False, "lr": 3e-3}])
    seen = {"owner_holds_none": 0, "held_by_one_rank": 0, "matrices": 0}
    sent: dict[str, int] = {}
    exchanges = opt._whole_matrices
    real_owners, real_exchange = exchanges.owners, whole_matrices.exchange_bytes

    def spied_owners(found):
        owner = real_owners(found)
        for matrix, o in zip(found, owner):
            held = exchanges.holders(matrix.handle)
            seen["owner_holds_none"] += o not in held
            seen["held_by_one_rank"] += len(held) == 1
            seen["matrices"] += 1
        return owner

    def spied_exchange(group, sends, recvs, site, **kw):
        sent[site] = sent.get(site, 0) + sum(
            t.numel() for j, t in enumerate(sends) if j != rank)
        return real_exchange(group, sends, recvs, site, **kw)

    exchanges.owners = spied_owners
    whole_matrices.exchange_bytes = spied_exchange
    try:
        for step in range(4):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randint(0, 12, (6, 5), generator=g), torch.randn(6, 5, generator=g)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            nn.functional.mse_loss(ref(x), y).backward()
            for o in ref_opts:
                o.step()
                o.zero_grad()
    finally:
        whole_matrices.exchange_bytes = real_exchange
    model.synchronize()
    return {"param_diff": _max_diff(model.module.parameters(), ref.module.parameters()),
            "n_buckets": len(model.buckets), "seen": seen, "sent": sent,
            "matrix_elements": sum(p.numel() for p in matrices(base))}


def trains_as_torch_ddp_on_subgroups(rank: int, world_size: int, schedule: str) -> float:
    """4 ranks in two data-parallel groups of 2, [0, 2] and [1, 3] (as beside tensor
    parallelism), each from its own weights: each group's 4 steps against torch DDP's
    Muon + AdamW on the same group. The exchanges address peers by their rank in the
    job, not in the group."""
    import torch.distributed as dist

    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]
    torch.manual_seed(rank % 2)
    base = MuonNet()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), process_group=group)
    ref_muon_groups, ref_adamw_groups = _groups(ref.module, muon_flag=False)
    ref_opts = [torch.optim.Muon(ref_muon_groups), torch.optim.AdamW(ref_adamw_groups)]
    model = fgp.DistributedDataParallel(base, schedule=schedule, process_group=group,
                                        bucket_cap_mb=0.0005, overlap_plan="layout")
    muon_groups, adamw_groups = _groups(model.module, muon_flag=True)
    opt = fgp.ShardedOptimizer(model, fgp.MuonWithAdamW,
                               param_groups=muon_groups + adamw_groups)
    for step in range(4):
        x, y = _batch(step, rank)
        for m, opts in ((model, [opt]), (ref, ref_opts)):
            nn.functional.mse_loss(m(x), y).backward()
            for o in opts:
                o.step()
                o.zero_grad()
    model.synchronize()
    return _max_diff(model.module.parameters(), ref.module.parameters())


def beside_tensor_parallel(rank: int, world_size: int) -> dict[str, Any]:
    """A 2 x 2 ("dp", "tp") mesh, Megatron-style layers over "tp" (each rank holds half
    of two matrices), fgpsdp over "dp" with MuonWithAdamW (Muon on the two shards),
    clipped over both groups; torch DDP beside it with torch's Muon + AdamW, clipped
    as Megatron clips. Each shard is orthogonalised alone on both sides (not the whole
    matrix, which Megatron's Muon gathers first)."""
    from .model_parallel_scenarios import (TensorParallelMLP, _megatron_clip, _param_diff,
                                           _two_by_two)
    from .scenarios import loss_fn, make_batch

    mesh, dp_rank, tp_rank, tp_group = _two_by_two()
    base = TensorParallelMLP(tp_rank, tp_group)
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_mesh=mesh["dp"])

    def groups(m):
        matrices = [m.column.weight, m.row.weight]
        rest = [m.column.bias, m.bias, m.norm.weight, m.norm.bias]
        return [{"params": matrices, "lr": 0.02}, {"params": rest, "lr": 1e-2}]
    ref_muon, ref_adamw = groups(ref.module)
    ref_opts = [torch.optim.Muon([ref_muon]), torch.optim.AdamW([ref_adamw])]
    ours = fgp.DistributedDataParallel(base, device_mesh=mesh["dp"], schedule="next_forward")
    muon, adamw = groups(ours.module)
    opt = fgp.ShardedOptimizer(ours, fgp.MuonWithAdamW, max_grad_norm=0.5,
                               model_parallel_group=tp_group,
                               param_groups=[{**muon, "use_muon": True},
                                             {**adamw, "use_muon": False}])
    totals = []
    for step in range(4):
        x, y = make_batch("mlp", step, 0, dp_rank)
        loss_fn("mlp", ours(x), y).backward()
        loss_fn("mlp", ref(x), y).backward()
        totals.append(_megatron_clip(ref.module, tp_group, 0.5))
        opt.step()
        opt.zero_grad()
        for o in ref_opts:
            o.step()
            o.zero_grad()
    ours.synchronize()
    return {"param_diff": _param_diff(ours, ref), "clipped": sum(t > 0.5 for t in totals)}


def newton_schulz_raises_under_join(rank: int, world_size: int, failing_rank: int,
                                    then: str) -> dict[str, Any]:
    """Under model.join(), rank 1 out of data after 2 steps: in the 3rd step Newton-
    Schulz raises once on ``failing_rank`` (on rank 1, in its stand-in step). Then
    rank 0 calls opt.step() again (``then="again"``), goes on to zero_grad() and its
    next forward ("on"), or leaves its loop there ("end"). Beside torch DDP under
    join() with torch's Muon + AdamW (the step taken once, without the error)."""
    import warnings

    import torch.optim._muon as torch_muon

    torch.manual_seed(0)
    base = MuonNet()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ref_muon_groups, ref_adamw_groups = _groups(ref.module, muon_flag=False)
    ref_opts = [torch.optim.Muon(ref_muon_groups), torch.optim.AdamW(ref_adamw_groups)]
    model = fgp.DistributedDataParallel(base, schedule="next_forward", bucket_cap_mb=0.0005,
                                        overlap_plan="layout")
    muon_groups, adamw_groups = _groups(model.module, muon_flag=True)
    opt = fgp.ShardedOptimizer(model, fgp.MuonWithAdamW, param_groups=muon_groups + adamw_groups)
    batches = [_batch(step, rank) for step in range(4 if rank == 0 else 2)]
    real = torch_muon._zeropower_via_newtonschulz

    def fails_once(*args, **kwargs):
        torch_muon._zeropower_via_newtonschulz = real
        raise MemoryError("out of memory")

    out: dict[str, Any] = {"raised": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with model.join():
            for step, (x, y) in enumerate(batches):
                nn.functional.mse_loss(model(x), y).backward()
                if rank == failing_rank and step == (2 if rank == 0 else 1):
                    if rank == 0:
                        torch_muon._zeropower_via_newtonschulz = fails_once
                    else:  # armed after this step: its loop ends, the stand-in fails
                        opt.step()
                        opt.zero_grad()
                        torch_muon._zeropower_via_newtonschulz = fails_once
                        continue
                try:
                    opt.step()
                except (MemoryError, RuntimeError) as error:
                    out["raised"] = f"{type(error).__name__}: {error}"
                    if then == "again":
                        opt.step()
                    elif then == "end":
                        break
                opt.zero_grad()
    torch_muon._zeropower_via_newtonschulz = real
    out["warnings"] = [str(w.message) for w in caught if "fgpsdp" in str(w.message)]
    with ref.join():
        for x, y in batches:
            nn.functional.mse_loss(ref(x), y).backward()
            for o in ref_opts:
                o.step()
                o.zero_grad()
    model.synchronize()
    out["param_diff"] = _max_diff(model.module.parameters(), ref.module.parameters())
    return out


class MuonNetWithSpare(MuonNet):
    """MuonNet with a matrix its forward never uses: it has no optimizer state."""

    def __init__(self):
        super().__init__()
        self.spare = nn.Linear(12, 12, bias=False)


def _spare_groups(module: MuonNetWithSpare) -> list[dict]:
    muon, adamw = _groups(module, muon_flag=True)
    return muon + [{"params": [module.spare.weight], "use_muon": True}] + adamw


def template_of_the_state(rank: int, world_size: int) -> dict[str, Any]:
    """``full_state_dict(init_state=True)`` (the template torch.distributed.checkpoint
    loads into) before the first step and after two, against torch's
    ``_init_optim_state`` on MuonWithAdamW over whole tensors; and the training it
    leaves unchanged."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    from .checkpoint_scenarios import compare_state_dicts
    torch.manual_seed(0)
    base = MuonNetWithSpare()
    whole = copy.deepcopy(base)
    alone = fgp.MuonWithAdamW(_spare_groups(whole))
    _init_optim_state(alone)
    runs = []
    for make_templates in (False, True):
        model = fgp.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.0005,
                                            find_unused_parameters=True)
        opt = fgp.ShardedOptimizer(model, fgp.MuonWithAdamW, max_grad_norm=1.0,
                                   param_groups=_spare_groups(model.module))
        out: dict[str, Any] = {}
        if make_templates:
            template = opt.full_state_dict(init_state=True)
            out["before_any_step"] = compare_state_dicts(template, alone.state_dict(),
                                                         strides=False)["bitwise"]
            out["left_empty"] = opt.full_state_dict()["state"] == {}
        for step in range(4):
            if make_templates and step == 2:
                live = opt.full_state_dict()
                template = opt.full_state_dict(init_state=True)
                spare = len(_groups(model.module, True)[0][0]["params"]) + 1  # its number
                out["spare_had_no_state"] = spare not in live["state"]
                out["spare_momentum_zero"] = bool(
                    (template["state"][spare]["momentum_buffer"] == 0).all()) and \
                    template["state"][spare]["momentum_buffer"].shape == (12, 12)
                del template["state"][spare]
                out["others_as_live"] = compare_state_dicts(template, live,
                                                            strides=False)["bitwise"]
            x, y = _batch(step, rank)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        model.synchronize()
        runs.append((out, [p.detach().clone() for p in model.module.parameters()]))
    out = runs[1][0]
    out["training_unchanged"] = all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    return out


def vector_turned_muon_after_a_step(rank: int, world_size: int) -> str:
    """A use_muon=False group of 1-D parameters set to use_muon=True after a step:
    what the next step raises."""
    model = fgp.DistributedDataParallel(MuonNet())
    muon, adamw = _groups(model.module, muon_flag=True)
    opt = fgp.ShardedOptimizer(model, fgp.MuonWithAdamW, param_groups=muon + adamw)
    for step in range(2):
        if step == 1:
            opt.param_groups[-1]["use_muon"] = True  # biases and norms
        x, y = _batch(step, rank)
        nn.functional.mse_loss(model(x), y).backward()
        try:
            opt.step()
        except ValueError as error:
            return f"ValueError: {error}"
        opt.zero_grad()
    return "stepped"


def spans_of_a_step(rank: int, world_size: int) -> list[str]:
    """The names of the spans a traced step records on the training thread."""
    model = fgp.DistributedDataParallel(MuonNet(), bucket_cap_mb=0.0005)
    muon, adamw = _groups(model.module, muon_flag=True)
    opt = fgp.ShardedOptimizer(model, fgp.MuonWithAdamW, param_groups=muon + adamw)
    model.timeline.enable()
    x, y = _batch(0, rank)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return [name for lane, name, _, _ in model.timeline.spans() if lane == "compute"]
