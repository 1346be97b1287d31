"""Optimizer checkpoints in torch's format: saved at one world size, resumed at another.

Imported by the spawned ranks (module-level functions only).
"""
from __future__ import annotations

import os
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

import fgpsdp_runtime as fgp

from .scenarios import (MODELS, StepCountingSGD, loss_fn, make_batch, reference_clip_,
                        wrapped_for)


class TemperatureNet(nn.Module):
    """A 0-dim parameter (a learnable temperature, as CLIP's logit_scale)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(13, 5)
        self.temperature = nn.Parameter(torch.tensor(0.7))

    def forward(self, x):
        return self.body(x) * self.temperature


CHECKPOINT_MODELS = {**MODELS, "temperature": TemperatureNet}


class CountingSGD(torch.optim.Optimizer):
    """A user's element-wise optimizer with a Python number in its state."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["count"] = 0
                    state["trace"] = torch.zeros_like(p)
                state["count"] += 1
                state["trace"].mul_(0.5).add_(p.grad)
                p.add_(state["trace"], alpha=-group["lr"] / state["count"])


class CountingSGDLrRequired(CountingSGD):
    """As many users' optimizers: no default for the learning rate."""

    def __init__(self, params, lr):
        super().__init__(params, lr)


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}),
    "adamw_amsgrad": (torch.optim.AdamW, {"lr": 1e-2, "amsgrad": True}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "sgd": (torch.optim.SGD, {"lr": 0.05}),  # no momentum: no state at all
    "counting_sgd": (CountingSGD, {"lr": 0.05}),
    "counting_sgd_lr_required": (CountingSGDLrRequired, {"lr": 0.05}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.05}),  # state made at construction
    # ... from a constructor argument that no param group entry passes on.
    "adagrad_initial_sum": (torch.optim.Adagrad, {"lr": 0.05, "initial_accumulator_value": 0.1}),
    "nadam": (torch.optim.NAdam, {"lr": 1e-2}),  # scalar state besides step: mu_product
    # Step counts in its param groups and in an optimizer-wide state entry.
    "step_counters": (StepCountingSGD, {"lr": 0.05}),
}


def _groups(module: nn.Module, how: str):
    """torch.optim groups; "default" means ShardedOptimizer's param_groups=None."""
    if how == "default":
        return list(module.parameters())  # frozen ones too, as AdamW(model.parameters())
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if how == "named":  # (name, parameter) pairs: torch.optim keeps "param_names"
        return [{"params": [(n, p) for n, p in named if p.ndim >= 2]},
                {"params": [(n, p) for n, p in named if p.ndim < 2], "weight_decay": 0.0}]
    return [{"params": [p for n, p in named if p.ndim >= 2]},
            {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0, "lr": 3e-3}]


def _build(rank: int, cfg: dict[str, Any], module_state=None):
    torch.manual_seed(1234 + rank)  # differs per rank: the broadcast must fix it
    base = CHECKPOINT_MODELS[cfg["model"]]()
    if module_state is not None:
        base.load_state_dict(module_state)
    ref_module = type(base)()
    ref_module.load_state_dict(base.state_dict())
    if cfg.get("row_major"):  # resumed in another layout than it was saved in
        for module in (base, ref_module):
            module.to(memory_format=torch.contiguous_format)
    if cfg["model"] == "bn_frozen":
        ref_module.frozen.requires_grad_(False)
    ref = nn.parallel.DistributedDataParallel(ref_module)
    topology = fgp.Topology(local_size=cfg["local_size"]) if "local_size" in cfg else None
    ours = fgp.DistributedDataParallel(base, bucket_cap_mb=cfg.get("bucket_cap_mb"),
                                       schedule=cfg.get("schedule", "two_stage"),
                                       topology=topology)
    cls, defaults = OPTIMIZERS[cfg["optimizer"]]
    groups = cfg.get("groups", "split")
    ref_opt = cls(_groups(ref.module, groups), **defaults)
    opt = fgp.ShardedOptimizer(ours, cls, max_grad_norm=cfg.get("max_grad_norm"),
                               param_groups=None if groups == "default"
                               else _groups(ours.module, groups), **defaults)
    return ours, opt, ref, ref_opt


def _train(rank, cfg, ours, opt, ref, ref_opt, first_step: int, steps: int) -> None:
    model_name = "mlp" if cfg["model"] == "temperature" else cfg["model"]
    for step in range(first_step, first_step + steps):
        x, y = make_batch(model_name, step, 0, rank)
        loss_fn(model_name, ours(x), y).backward()
        loss_fn(model_name, ref(x), y).backward()
        if cfg.get("max_grad_norm") is not None:
            reference_clip_(ref.parameters(), cfg["max_grad_norm"])
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    ours.synchronize()


def compare_state_dicts(ours: dict, theirs: dict, strides: bool = True) -> dict[str, Any]:
    """How far a torch-format optimizer state dict is from another (``strides``:
    tensors must be laid out alike too)."""
    same_groups = ours["param_groups"] == theirs["param_groups"]
    # Entries not keyed by a parameter number (an optimizer-wide step count) as they are.
    wide_keys = [i for i in theirs["state"] if not isinstance(i, int)]
    same_layout = set(ours["state"]) == set(theirs["state"]) and all(
        list(ours["state"][i]) == list(theirs["state"][i]) for i in theirs["state"]
        if i not in wide_keys)
    worst, mismatched = 0.0, []
    if same_layout:
        mismatched = [i for i in wide_keys
                      if not _same_entry(ours["state"][i], theirs["state"][i])]
        for i, entry in theirs["state"].items():
            if i in wide_keys:
                continue
            for key, value in entry.items():
                mine = ours["state"][i][key]
                if torch.is_tensor(value):
                    # Laid out as torch's (as their parameter: channels_last kept).
                    if not (torch.is_tensor(mine) and mine.shape == value.shape
                            and mine.dtype == value.dtype
                            and (not strides or value.numel() <= 1
                                 or mine.stride() == value.stride())):
                        mismatched.append((i, key))
                        continue
                    worst = max(worst, float((mine.double() - value.double()).abs().max())
                                if value.numel() else 0.0)
                elif mine != value:
                    mismatched.append((i, key))
    return {"same_groups": same_groups, "same_layout": same_layout, "mismatched": mismatched,
            "max_diff": worst, "bitwise": same_groups and same_layout and not mismatched
            and _bitwise(ours["state"], theirs["state"])}


def _same_entry(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype \
            and torch.equal(a, b)
    return a == b


def _bitwise(a: dict, b: dict) -> bool:
    return all(_same_entry(a[i], entry) if not isinstance(i, int) else
               all(_same_entry(a[i][k], v) for k, v in entry.items())
               for i, entry in b.items())


def train_and_save(rank: int, world_size: int, cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """Train side by side with torch DDP; compare full_state_dict() with torch's state_dict()."""
    ours, opt, ref, ref_opt = _build(rank, cfg)
    _train(rank, cfg, ours, opt, ref, ref_opt, 0, cfg.get("steps", 3))
    full = opt.full_state_dict(rank0_only=cfg.get("rank0_only", False))
    result: dict[str, Any] = {"empty": full == {}}
    if full:
        result.update(compare_state_dicts(full, ref_opt.state_dict()))
        values = [v for e in full["state"].values()
                  for v in (e.values() if isinstance(e, dict) else [e])]
        result["on_cpu"] = all(v.device.type == "cpu" for v in values if torch.is_tensor(v))
    if rank == 0:
        torch.save({"ours_module": ours.module.state_dict(), "ours_opt": full,
                    "torch_module": ref.module.state_dict(), "torch_opt": ref_opt.state_dict()},
                   path)
    return result


def consolidate_and_save(rank: int, world_size: int, cfg: dict[str, Any], path: str,
                         to: int) -> dict[str, Any]:
    """Train side by side with torch DDP, then save as a trainer saves a sharded
    optimizer from one rank (PyTorch Lightning's Strategy.optimizer_state, for torch's
    ZeroRedundancyOptimizer): consolidate_state_dict(to) on every rank, state_dict() on
    rank ``to`` into the file. What each rank's state_dict() was, then and after a step."""
    ours, opt, ref, ref_opt = _build(rank, cfg)
    _train(rank, cfg, ours, opt, ref, ref_opt, 0, 3)
    full = opt.full_state_dict()
    opt.consolidate_state_dict(to=to)
    saved = opt.state_dict()
    result: dict[str, Any] = {"shard": "shard" in saved}
    if rank == to:
        result["as_full_state_dict"] = compare_state_dicts(saved, full)["bitwise"]
        result["to_torch"] = compare_state_dicts(saved, ref_opt.state_dict())
        # An lr set since (a scheduler's step): the groups as they are now, in a new
        # dict each time (as torch's ZeRO), the state as consolidated.
        lr = opt.param_groups[0]["lr"]
        opt.param_groups[0]["lr"] = 0.125
        again = opt.state_dict()
        opt.param_groups[0]["lr"] = lr
        result["lr_now"] = again["param_groups"][0]["lr"]
        result["new_dict_same_state"] = again is not saved and again["state"] is saved["state"]
        torch.save({"ours_module": ours.module.state_dict(), "ours_opt": saved,
                    "torch_module": ref.module.state_dict(), "torch_opt": ref_opt.state_dict()},
                   path)
    _train(rank, cfg, ours, opt, ref, ref_opt, 3, 1)
    result["shard_after_a_step"] = "shard" in opt.state_dict()
    return result


def train_and_save_many(rank: int, world_size: int, cfgs: dict[str, dict],
                        directory: str) -> dict[str, dict]:
    return {name: train_and_save(rank, world_size, cfg, f"{directory}/{name}.pt")
            for name, cfg in cfgs.items()}


def resume_many(rank: int, world_size: int, cfgs: dict[str, dict], directory: str,
                which: str) -> dict[str, dict]:
    return {name: resume(rank, world_size, cfg, f"{directory}/{name}.pt", which)
            for name, cfg in cfgs.items()}


def resume(rank: int, world_size: int, cfg: dict[str, Any], path: str,
           which: str) -> dict[str, Any]:
    """Load a torch-format optimizer dict (``which``: "ours" or "torch"'s) at this world
    size and bucket size, into fgpsdp and into torch DDP alike; train on side by side."""
    saved = torch.load(path, weights_only=True)
    ours, opt, ref, ref_opt = _build(rank, cfg, module_state=saved[f"{which}_module"])
    opt.load_state_dict(saved[f"{which}_opt"])
    ref_opt.load_state_dict(saved[f"{which}_opt"])
    round_trip = compare_state_dicts(opt.full_state_dict(), saved[f"{which}_opt"],
                                     strides=not cfg.get("row_major"))
    _train(rank, cfg, ours, opt, ref, ref_opt, 100, cfg.get("steps", 3))
    param_diff = max(float((a.detach() - b.detach()).abs().max())
                     for a, b in zip(ours.module.parameters(), ref.module.parameters()))
    return {"round_trip": round_trip, "param_diff": param_diff,
            "after": compare_state_dicts(opt.full_state_dict(), ref_opt.state_dict(),
                                         strides=not cfg.get("row_major"))}


def look_up_model_params_in_state(rank: int, world_size: int) -> dict[str, Any]:
    """Code written for torch.optim reads ``opt.state[param]`` (logging Adam's
    moments), then saves the optimizer: before, the lookup inserted an entry no
    param group holds and ``opt.state_dict()`` raised a KeyError."""
    import warnings
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(MODELS["mlp"]())
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)

    def step(k: int) -> None:
        x, y = make_batch("mlp", k, 0, rank)
        loss_fn("mlp", model(x), y).backward()
        opt.step()
        opt.zero_grad()

    step(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = [dict(opt.state[p]) for p in model.module.parameters()]
        opt.load_state_dict(opt.state_dict())
        found += [dict(opt.state[p]) for p in model.module.parameters()]  # after a load too
        opt.load_state_dict(opt.state_dict())
    try:  # a layer's state reset the torch.optim way: refused, not kept
        opt.state[model.module.net[0].weight] = {}
        assignment = "kept"
    except KeyError as error:
        assignment = str(error)
    step(1)
    copied = opt.state.copy()  # a plain defaultdict, as torch's state copies to
    copied[model.module.net[0].weight]["x"] = 1
    return {"entries_found": sum(map(len, found)), "assignment": assignment,
            "warnings": [str(w.message) for w in caught],
            "state_keys": len(opt.state),
            "pieces": sum(len(g["params"]) for g in opt.param_groups)}


def reset_state_the_torch_ways(rank: int, world_size: int) -> dict[str, Any]:
    """Two AdamW steps, every moment reset by ``opt.state = defaultdict(dict)``, two more
    steps, under torch DDP and fgpsdp (before, the assignment replaced an attribute no
    step read: the moments went on). Then the lookups of a model parameter that
    torch.optim loops write to reset one layer (``pop``, ``in`` then ``del``) and to
    read its moments (``get``): on fgpsdp they warn once in all, ``del`` and an
    assignment over a model parameter raise, and the state is left as it was."""
    import warnings
    from collections import defaultdict
    params = {}
    for system in ("torch", "fgpsdp"):
        torch.manual_seed(0)
        model, opt = wrapped_for(MODELS["mlp"](), system == "torch", torch.optim.AdamW, 1e-2)
        for k in range(4):
            if k == 2:
                opt.state = defaultdict(dict)
            x, y = make_batch("mlp", k, 0, rank)
            loss_fn("mlp", model(x), y).backward()
            opt.step()
            opt.zero_grad()
        if system == "fgpsdp":
            model.synchronize()
        params[system] = [p.detach().clone() for p in model.module.parameters()]
    weight = model.module.net[0].weight
    entries = len(opt.state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        answers = [opt.state.pop(weight, None), weight in opt.state, opt.state.get(weight)]
    refused = []
    for write in (lambda: opt.state.__delitem__(weight),
                  lambda: setattr(opt, "state", {weight: {}})):
        try:
            write()
            refused.append("nothing")
        except KeyError as error:
            refused.append(str(error))
    return {"bitwise": all(map(torch.equal, params["torch"], params["fgpsdp"])),
            "answers": answers, "warnings": [str(w.message) for w in caught],
            "refused": refused, "entries": (entries, len(opt.state))}


def _mlp_stepped_once(rank: int):
    """The MLP wrapped, with AdamW, after one step (and its zero_grad()): (model, opt)."""
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(MODELS["mlp"]())
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    x, y = make_batch("mlp", 0, 0, rank)
    loss_fn("mlp", model(x), y).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def state_dict_hooks(rank: int, world_size: int) -> dict[str, Any]:
    """torch.optim's state-dict hooks registered on the ShardedOptimizer (checkpoint
    tagging and migration): they run around full_state_dict(), state_dict() and
    load_state_dict(), on the torch.optim-format dict, as torch's optimizer runs them.
    Before, none ran and a migrating load hook was silently skipped."""
    model, opt = _mlp_stepped_once(rank)
    calls = []

    def tag(optimizer, state_dict):
        calls.append("save")
        return dict(state_dict, tag="written by a hook")

    def migrate(optimizer, state_dict):
        calls.append("load")
        for group in state_dict["param_groups"]:
            group["lr"] = 0.123

    opt.register_state_dict_pre_hook(lambda optimizer: calls.append("before save"))
    opt.register_state_dict_post_hook(tag)
    opt.register_load_state_dict_pre_hook(migrate)
    opt.register_load_state_dict_post_hook(lambda optimizer: calls.append("loaded"))
    full, shard = opt.full_state_dict(), opt.state_dict()
    tags = [full.get("tag"), shard["shard"].get("tag")]
    lrs = []
    for saved in (full, shard):
        for group in opt.param_groups:
            group["lr"] = 1e-2
        opt.load_state_dict(saved)
        lrs.append([group["lr"] for group in opt.param_groups])
    return {"calls": calls, "tags": tags, "lrs": lrs}


def shard_under_another_topology(rank: int, world_size: int) -> Optional[str]:
    """A ``state_dict()`` shard saved on 2 nodes x 2, loaded on one node of 4 (a job
    resumed on another machine): ranks 1 and 2 own each other's slice there. Before,
    they loaded each other's Adam moments without a word. Returns the error, if any."""
    def build(topology):
        torch.manual_seed(0)
        model = fgp.DistributedDataParallel(MODELS["mlp"](), topology=topology)
        return model, fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)

    model, opt = build(fgp.Topology(local_size=2))
    x, y = make_batch("mlp", 0, 0, rank)
    loss_fn("mlp", model(x), y).backward()
    opt.step()
    shard = opt.state_dict()
    _, resumed = build("flat")
    try:
        resumed.load_state_dict(shard)
    except ValueError as error:
        return str(error)
    return None


def consolidate_to(rank: int, world_size: int, to: Any) -> Optional[str]:
    """consolidate_state_dict(to=to) after a step: the error, if any."""
    _, opt = _mlp_stepped_once(rank)
    try:
        opt.consolidate_state_dict(to=to)
    except ValueError as error:
        return str(error)
    return None


def rank0_shard_loaded_everywhere(rank: int, world_size: int) -> Optional[str]:
    """The checkpoint of a loop that saves on rank 0 alone (timm's saver): rank 0's
    ``state_dict()`` shard, loaded on every rank. Returns the error, if any."""
    _, opt = _mlp_stepped_once(rank)
    shard = [opt.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(shard, src=0)  # as torch.load of rank 0's file
    try:
        opt.load_state_dict(shard[0])
    except ValueError as error:
        return str(error)
    return None


def distributed_checkpoint_round_trip(rank: int, world_size: int, directory: str
                                      ) -> dict[str, Any]:
    """``torch.distributed.checkpoint`` saves ``opt.full_state_dict()`` (replicated on
    every rank: written once) and loads it in place into a later one's tensors, which
    ``opt.load_state_dict`` then takes: the optimizer holds what was saved, bit for bit."""
    import copy

    import torch.distributed.checkpoint as dcp
    ours, opt, ref, ref_opt = _build(rank, {"model": "mlp", "optimizer": "adamw",
                                            "max_grad_norm": 1.0})
    _train(rank, {"model": "mlp", "max_grad_norm": 1.0}, ours, opt, ref, ref_opt, 0, 2)
    saved = opt.full_state_dict()
    dcp.save({"optim": saved}, checkpoint_id=directory)
    kept = copy.deepcopy(saved)
    _train(rank, {"model": "mlp", "max_grad_norm": 1.0}, ours, opt, ref, ref_opt, 2, 1)
    target = {"optim": opt.full_state_dict()}  # the moments of one more step, overwritten
    changed = not compare_state_dicts(target["optim"], kept)["bitwise"]
    dcp.load(target, checkpoint_id=directory)
    opt.load_state_dict(target["optim"])
    return {"changed_before_load": changed,
            "after_load": compare_state_dicts(opt.full_state_dict(), kept)}


def distributed_checkpoint_save(rank: int, world_size: int, directory: str,
                                optimizer: str) -> None:
    """Two steps, then ``dcp.save`` of ``opt.full_state_dict()``; rank 0 also keeps it
    with ``torch.save`` for the comparison."""
    import torch.distributed.checkpoint as dcp
    cfg = {"model": "mlp", "optimizer": optimizer, "max_grad_norm": 1.0}
    ours, opt, ref, ref_opt = _build(rank, cfg)
    _train(rank, cfg, ours, opt, ref, ref_opt, 0, 2)
    saved = opt.full_state_dict()
    dcp.save({"optim": saved}, checkpoint_id=directory)
    if rank == 0:
        torch.save(saved, directory + ".pt")


def distributed_checkpoint_into_fresh_optimizer(rank: int, world_size: int, directory: str,
                                                optimizer: str) -> dict[str, Any]:
    """A resume in new processes: the template for ``dcp.load`` comes from an optimizer
    that has not stepped, so ``full_state_dict(init_state=True)`` gives it entries."""
    import torch.distributed.checkpoint as dcp
    cfg = {"model": "mlp", "optimizer": optimizer, "max_grad_norm": 1.0}
    ours, opt, _, _ = _build(rank, cfg)
    plain = opt.full_state_dict()
    template = {"optim": opt.full_state_dict(init_state=True)}
    after_template = opt.full_state_dict()
    dcp.load(template, checkpoint_id=directory)
    opt.load_state_dict(template["optim"])
    kept = torch.load(directory + ".pt", weights_only=False)
    return {"plain_template_entries": len(plain["state"]),
            "template_entries": len(template["optim"]["state"]),
            "left_as_it_was": compare_state_dicts(after_template, plain, strides=False)["bitwise"],
            "after_load": compare_state_dicts(opt.full_state_dict(), kept, strides=False)}


def torchs_checkpoint_helpers(rank: int, world_size: int) -> dict[str, Any]:
    """torch.distributed.checkpoint.state_dict's optimizer helpers, before the first
    step and after two: what each raises. Then the model trains on as torch DDP does."""
    from torch.distributed.checkpoint import state_dict as helpers
    cfg = {"model": "mlp", "optimizer": "adamw", "max_grad_norm": 1.0}
    ours, opt, ref, ref_opt = _build(rank, cfg)
    calls = {
        "get_state_dict": lambda: helpers.get_state_dict(ours, opt),
        "get_optimizer_state_dict": lambda: helpers.get_optimizer_state_dict(ours.module, opt),
        "set_optimizer_state_dict": lambda: helpers.set_optimizer_state_dict(
            ours.module, opt, optim_state_dict=opt.full_state_dict()),
    }
    said = {}
    for when in ("before_any_step", "after_two_steps"):
        if when == "after_two_steps":
            _train(rank, cfg, ours, opt, ref, ref_opt, 0, 2)
        for name, call in calls.items():
            try:
                call()
                said[f"{when}:{name}"] = None
            except Exception as error:  # noqa: BLE001 - what the user sees
                said[f"{when}:{name}"] = f"{type(error).__name__}: {error}"
    _train(rank, cfg, ours, opt, ref, ref_opt, 2, 2)
    ours.synchronize()
    return {"said": said,
            "params_equal": all(torch.equal(a, b) for a, b in
                                zip(ours.module.parameters(), ref.module.parameters()))}


def template_leaves_training_unchanged(rank: int, world_size: int,
                                       optimizer: str) -> dict[str, Any]:
    """``full_state_dict(init_state=True)`` before the first step changes nothing the
    training sees: the same parameters as a run without it, bit for bit."""
    cfg = {"model": "mlp", "optimizer": optimizer, "max_grad_norm": 1.0}
    finals = []
    for make_template in (False, True):
        ours, opt, ref, ref_opt = _build(rank, cfg)
        if make_template:
            opt.full_state_dict(init_state=True)
        _train(rank, cfg, ours, opt, ref, ref_opt, 0, 2)
        finals.append([p.detach().clone() for p in ours.module.parameters()])
    return {"bitwise": all(torch.equal(a, b) for a, b in zip(*finals))}


class FourLayers(nn.Module):
    """Two inner layers of one shape: freezing one or the other gives buckets of the
    same sizes holding other parameters."""

    def __init__(self):
        super().__init__()
        self.first, self.a, self.b, self.head = (nn.Linear(8, 32), nn.Linear(32, 32),
                                                 nn.Linear(32, 32), nn.Linear(32, 4))

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(torch.tanh(self.first(x)))))))


def _four_layers(frozen: str):
    torch.manual_seed(0)
    module = FourLayers()
    getattr(module, frozen).requires_grad_(False)
    model = fgp.DistributedDataParallel(module, bucket_cap_mb=0.001)
    return model, fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)


def shard_save_with_frozen(rank: int, world_size: int, path: str, frozen: str) -> None:
    model, opt = _four_layers(frozen)
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    torch.save(opt.state_dict(), f"{path}.{rank}")


def shard_load_with_frozen(rank: int, world_size: int, path: str, frozen: str) -> None:
    _, opt = _four_layers(frozen)
    opt.load_state_dict(torch.load(f"{path}.{rank}", weights_only=True))


def full_state_dict_on_rank_0_alone(rank: int, world_size: int) -> dict:
    """``if rank == 0: opt.full_state_dict()``: rank 0 waits in the collective until
    the process-group timeout; before it fails, a warning says what it waits for.
    (FGPSDP_COLLECTIVE_WARN_S and the timeout are set short by the test.)"""
    import warnings
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(nn.Linear(8, 8))
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    model.synchronize()
    if rank != 0:
        time.sleep(12)  # past rank 0's timeout, in no collective
        return {"warnings": [], "error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            opt.full_state_dict()
            error = None
        except Exception as e:  # noqa: BLE001 - the timed-out collective's, whatever its type
            error = type(e).__name__
    return {"warnings": [(str(w.message), os.path.basename(w.filename)) for w in caught
                         if "has waited" in str(w.message)], "error": error}


def load_dict_lacking_an_entry(rank: int, world_size: int, optimizer: str,
                               entry: str) -> dict[int, Optional[str]]:
    """A whole-model dict in which one parameter's state lacks an entry the others of
    its group hold (``entry``, removed here from the first parameter, then from the
    last). Before, it loaded; at the step the rank holding that parameter's elements
    raised a KeyError alone, and the others saw their exchange fail. Returns, per
    parameter edited, the error each load raised (None if it loaded)."""
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(MODELS["mlp"](), bucket_cap_mb=0.0001)
    optimizer_class, arguments = OPTIMIZERS[optimizer]
    opt = fgp.ShardedOptimizer(model, optimizer_class, **arguments)
    x, y = make_batch("mlp", 0, 0, rank)
    loss_fn("mlp", model(x), y).backward()
    opt.step()
    opt.zero_grad()
    full = opt.full_state_dict()
    errors = {}
    for edited in (min(full["state"]), max(full["state"])):
        broken = {"state": {i: dict(entry) for i, entry in full["state"].items()},
                  "param_groups": full["param_groups"]}
        del broken["state"][edited][entry]
        try:
            opt.load_state_dict(broken)
            errors[edited] = None
        except ValueError as error:
            errors[edited] = str(error)
    opt.load_state_dict(full)  # the dict as saved still loads, and trains
    loss_fn("mlp", model(x), y).backward()
    opt.step()
    return errors


def load_dict_whose_parameters_started_under_other_settings(
        rank: int, world_size: int) -> dict[str, Optional[str]]:
    """torch's own dict where a parameter's first step came after a setting that
    decides which entries a first step creates was turned off (RMSprop's momentum,
    Adam's amsgrad): it holds fewer entries than the others of its group, and torch
    loads and steps it. Returns, per optimizer, the error its load and step raised
    (None if both ran)."""
    cases = {"rmsprop_momentum_off": (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.9},
                                      "momentum", 0.0),
             "adam_amsgrad_off": (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True},
                                  "amsgrad", False)}

    def two_layers():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))

    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    errors = {}
    for name, (cls, kwargs, setting, off) in cases.items():
        net = two_layers()
        opt = cls(net.parameters(), **kwargs)
        net(x).square().mean().backward()
        for p in net[1].parameters():  # the second layer's first step comes later
            p.grad = None
        opt.step()
        opt.zero_grad()
        for group in opt.param_groups:
            group[setting] = off
        net(x).square().mean().backward()
        opt.step()
        saved = opt.state_dict()
        assert len(saved["state"][0]) != len(saved["state"][2])  # the case at hand
        model = fgp.DistributedDataParallel(two_layers(), bucket_cap_mb=0.0001)
        sharded = fgp.ShardedOptimizer(model, cls, **{**kwargs, setting: off})
        try:
            sharded.load_state_dict(saved)
            model(x).square().mean().backward()
            sharded.step()
            errors[name] = None
        except ValueError as error:
            errors[name] = str(error)
    return errors
