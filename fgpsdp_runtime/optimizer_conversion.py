"""What ``ShardedOptimizer.from_optimizer`` needs of a torch.optim optimizer that a
trainer or a framework built over the wrapped module's parameters (Lightning
Fabric's ``fabric.setup(model, optimizer)``, a transformers Trainer's
``create_optimizer``): its class, its param groups as torch.optim takes them, the
constructor arguments among its defaults, and what a conversion would lose silently,
which is refused instead.

Pure: no communication (the caller makes every rank agree before raising).
"""
from __future__ import annotations

import gc
import inspect
from typing import Any, Optional

import torch

# torch.optim.Optimizer's per-instance hook registries (their handles' remove() acts
# on these dicts, so they cannot be moved to another optimizer).
_HOOK_REGISTRIES = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                    "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                    "_optimizer_load_state_dict_pre_hooks",
                    "_optimizer_load_state_dict_post_hooks")


def conversion_problem(optimizer: Any) -> Optional[tuple[type, str]]:
    """(exception type, message) when ``optimizer`` cannot become a ShardedOptimizer
    without losing something silently; None when it can."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return TypeError, ("from_optimizer takes a torch.optim.Optimizer, got "
                           f"{type(optimizer).__name__}")
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
        # Lightning's, Fabric's and accelerate's wrappers: the loop would go on
        # stepping the wrapper, which holds the optimizer given, not the result.
        return TypeError, (f"{type(optimizer).__name__} wraps another optimizer "
                           f"({type(inner).__name__}): convert that one before the "
                           "framework wraps it, and give the result to the framework")
    if hasattr(optimizer, "consolidate_state_dict"):
        return TypeError, (f"{type(optimizer).__name__} shards its state already "
                           "(ZeroRedundancyOptimizer's kind): build the ShardedOptimizer "
                           "from the optimizer class it runs")
    schedulers = schedulers_holding(optimizer)
    if schedulers:
        # It would go on setting the learning rate of the optimizer given, which no
        # longer steps anything.
        return ValueError, (f"an lr scheduler ({', '.join(schedulers)}) was built on this "
                            "optimizer: it would schedule the optimizer given, not the "
                            "ShardedOptimizer. Build the scheduler on the optimizer "
                            "from_optimizer returns (under Lightning Fabric: on the one "
                            "fabric.setup returns)")
    hooked = [name.strip("_").replace("optimizer_", "") for name in _HOOK_REGISTRIES
              if getattr(optimizer, name, None)]
    if hooked:
        return ValueError, ("this optimizer has hooks registered on it ("
                            + ", ".join(hooked) + "): register them on the optimizer "
                            "from_optimizer returns instead")
    lost = settings_outside_defaults(optimizer)
    if lost:
        return ValueError, (
            f"{type(optimizer).__name__} keeps settings outside its defaults, which a "
            f"{type(optimizer).__name__} built from its defaults and param groups would not "
            "have (" + "; ".join(lost) + "): build the ShardedOptimizer with "
            f"fgp.ShardedOptimizer(model, {type(optimizer).__name__}, param_groups=..., "
            "...) and those arguments")
    return None


def schedulers_holding(optimizer: torch.optim.Optimizer) -> list[str]:
    """Type names of the lr schedulers whose ``optimizer`` is ``optimizer``.

    Found among the objects that refer to it: not every scheduler leaves a mark on
    the optimizer (torch's ReduceLROnPlateau does not, timm's leave ``initial_lr``
    in the groups, torch's other ones also wrap its ``step``)."""
    found = []
    for referrer in gc.get_referrers(optimizer):
        # Python < 3.11 hands out an instance's __dict__, later ones the instance.
        owners = ([o for o in gc.get_referrers(referrer)
                   if getattr(o, "__dict__", None) is referrer]
                  if isinstance(referrer, dict) else [referrer])
        for owner in owners:
            if getattr(owner, "optimizer", None) is optimizer and _is_scheduler(owner):
                found.append(type(owner).__name__)
    if not found and (getattr(optimizer.step, "_wrapped_by_lr_sched", False)
                      or any("initial_lr" in group for group in optimizer.param_groups)):
        found.append("one not found, which left its mark: initial_lr in the param groups "
                     "or its wrapper on step")
    return sorted(set(found))


def _is_scheduler(owner: Any) -> bool:
    if isinstance(owner, _TORCH_SCHEDULERS):
        return True
    # Others (timm's, a loop's own): a step() and a schedule's position or bases.
    return callable(getattr(owner, "step", None)) and any(
        hasattr(owner, name) for name in ("last_epoch", "base_lrs", "base_values"))


_TORCH_SCHEDULERS = tuple(getattr(torch.optim.lr_scheduler, name)
                          for name in ("LRScheduler", "_LRScheduler", "ReduceLROnPlateau")
                          if hasattr(torch.optim.lr_scheduler, name))
_SIMPLE = (bool, int, float, str, type(None))


def settings_outside_defaults(optimizer: torch.optim.Optimizer) -> list[str]:
    """"name: value" for the plain settings ``optimizer`` holds as attributes (apex's
    FusedAdam its ``adam_w_mode``, a subclass a step count) that one of its class,
    built from its defaults and its groups' entries, has not, or has other values of.
    Empty where no such optimizer can be built here to compare with."""
    base = {"defaults", "state", "param_groups", "_zero_grad_profile_name",
            "_warned_capturable_if_run_uncaptured"}
    given = {name: value for name, value in vars(optimizer).items()
             if name not in base and not name.startswith("_optimizer_")
             and _is_simple(value)}
    if not given:
        return []
    first = next((p for g in optimizer.param_groups for p in g["params"]), None)
    like = {} if first is None else {"device": first.device, "dtype": first.dtype}
    try:
        probe = type(optimizer)(
            [{**{k: v for k, v in g.items() if k not in ("params", "param_names")},
              "params": [torch.zeros(1, requires_grad=True, **like)]}
             for g in optimizer.param_groups],
            **constructor_defaults(type(optimizer), optimizer.defaults))
    except Exception:  # noqa: BLE001 (a class that cannot be built so: nothing to compare)
        return []
    built = vars(probe)
    return [f"{name}={value!r}, built: "
            + (repr(built[name]) if name in built else "none")
            for name, value in given.items()
            if name not in built or built[name] != value]


def _is_simple(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_is_simple(v) for v in value)
    return isinstance(value, _SIMPLE)


def param_groups_to_give(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's groups as torch.optim takes them: every entry, and named
    parameters as (name, parameter) pairs where the group has ``param_names``."""
    groups = []
    for group in optimizer.param_groups:
        given = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        names = group.get("param_names")
        given["params"] = (list(zip(names, group["params"])) if names is not None
                           else list(group["params"]))
        groups.append(given)
    return groups


def constructor_defaults(optimizer_class: type, defaults: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``defaults`` that ``optimizer_class``'s constructor takes.

    ``defaults`` can hold more than its constructor's arguments (torch's AdamW is an
    Adam with ``decoupled_weight_decay=True``, which AdamW's constructor does not
    take); every group holds those entries anyway, so the groups keep them. A
    constructor that takes ``**kwargs`` is read with those of the classes it
    inherits, up to one that takes none (where its ``**kwargs`` go, as a rule)."""
    accepted: set[str] = set()
    for cls in optimizer_class.__mro__:
        if "__init__" not in vars(cls):
            continue
        try:
            parameters = inspect.signature(vars(cls)["__init__"]).parameters
        except (TypeError, ValueError):  # no signature to read: give them all
            return dict(defaults)
        accepted.update(name for name, p in parameters.items()
                        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
        if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            break
    else:  # every constructor up to object's takes **kwargs
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in accepted and k not in ("self", "params")}
