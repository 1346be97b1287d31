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
import types
from typing import Any, Optional

import torch

from .optimizer_kinds import refuse_unsliceable, refuse_unsliceable_settings

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
    try:
        # Before the other checks: a class that cannot run on slices says so itself
        # (torch-optimi's StableAdamW also registers hooks on itself).
        refuse_unsliceable(type(optimizer))
        refuse_unsliceable_settings(optimizer)
    except TypeError as error:
        return TypeError, str(error)
    schedulers = schedulers_holding(optimizer)
    if schedulers:
        # It would go on setting the learning rate of the optimizer given, which no
        # longer steps anything.
        return ValueError, (f"an lr scheduler ({', '.join(schedulers)}) was built on this "
                            "optimizer: it would schedule the optimizer given, not the "
                            "ShardedOptimizer. Build the scheduler on the optimizer "
                            "from_optimizer returns (under Lightning Fabric: on the one "
                            "fabric.setup returns)")
    # Every hook, the class's own too: which ones a constructor registered cannot be
    # told from the loop's without building a second instance (see
    # settings_outside_defaults), and one of the loop's would be dropped silently.
    hooked = [name.strip("_").replace("optimizer_", "") for name in _HOOK_REGISTRIES
              if getattr(optimizer, name, None)]
    if hooked:
        return ValueError, ("this optimizer has hooks registered on it ("
                            + ", ".join(hooked) + "): register them on the optimizer "
                            "from_optimizer returns instead (where its class registers "
                            "them itself, build fgp.ShardedOptimizer(model, "
                            f"{type(optimizer).__name__}, ...) directly)")
    lost = settings_outside_defaults(optimizer)
    if lost:
        name = type(optimizer).__name__
        return ValueError, (
            f"{name} was built with arguments it keeps outside its defaults ("
            + "; ".join(lost) + "), which one built from its defaults and param groups "
            f"would not have: build it as fgp.ShardedOptimizer(model, {name}, "
            "param_groups=..., ...) with those arguments")
    return None


def schedulers_holding(optimizer: torch.optim.Optimizer) -> list[str]:
    """Type names of the live lr schedulers whose ``optimizer`` is ``optimizer``.

    Found among the objects that refer to it, since not every scheduler leaves a
    mark on the optimizer (torch's ReduceLROnPlateau does not). A scheduler dropped
    already schedules nothing: the marks one may leave (``initial_lr`` in the
    groups, as after loading a checkpoint of a run that had one) are no refusal."""
    gc.collect()  # a dropped scheduler in a reference cycle: gone on every rank alike
    found = []
    for referrer in gc.get_referrers(optimizer):
        # An instance, or its __dict__ (Python < 3.11, or once the dict was read:
        # torch's LRScheduler.state_dict() reads self.__dict__).
        owners = ([o for o in gc.get_referrers(referrer) if _attributes(o) is referrer]
                  if isinstance(referrer, dict) else [referrer])
        found += [type(owner).__name__ for owner in owners if _schedules(owner, optimizer)]
    return sorted(set(found))


def _attributes(owner: Any) -> Optional[dict]:
    """``owner.__dict__``, or None (an object's ``__getattr__`` may raise anything)."""
    try:
        attributes = getattr(owner, "__dict__", None)
    except Exception:  # noqa: BLE001
        return None
    return attributes if isinstance(attributes, dict) else None


def _schedules(owner: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``owner`` is an lr scheduler of ``optimizer``: torch's, or another's (a
    ``step()`` and a schedule's position or bases: timm's, a loop's own)."""
    attributes = _attributes(owner)
    if (attributes is None or attributes.get("optimizer") is not optimizer
            or isinstance(owner, types.ModuleType)):  # (a script's global `optimizer`)
        return False
    try:  # (an object's properties may raise anything: not a scheduler, then)
        return isinstance(owner, _TORCH_SCHEDULERS) or (
            callable(getattr(owner, "step", None))
            and any(hasattr(owner, name) for name in ("last_epoch", "base_lrs", "base_values")))
    except Exception:  # noqa: BLE001
        return False


_TORCH_SCHEDULERS = tuple(getattr(torch.optim.lr_scheduler, name)
                          for name in ("LRScheduler", "_LRScheduler", "ReduceLROnPlateau")
                          if hasattr(torch.optim.lr_scheduler, name))
_SIMPLE = (bool, int, float, str, type(None))


def settings_outside_defaults(optimizer: torch.optim.Optimizer) -> list[str]:
    """"name=value, default: ..." for each constructor argument of ``optimizer``'s
    class that its ``defaults`` lack, which it holds as a plain attribute of the same
    name with another value than the argument's default (apex's FusedAdam keeps
    ``adam_w_mode`` so): one built from its defaults would get the default.

    (Read from the constructor's signature, not from a second instance: a constructor
    may register the instance somewhere, as DeepSpeed's CPU Adam does.)"""
    found = []
    for name, parameter in (constructor_parameters(type(optimizer)) or {}).items():
        if name in optimizer.defaults or parameter.default is inspect.Parameter.empty:
            continue
        value = vars(optimizer).get(name, parameter.default)
        if _is_simple(value) and value != parameter.default:
            found.append(f"{name}={value!r}, default: {parameter.default!r}")
    return found


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


def constructor_parameters(optimizer_class: type) -> Optional[dict[str, inspect.Parameter]]:
    """The named arguments ``optimizer_class``'s constructor takes: its own, and where
    it takes ``**kwargs``, those of the classes it inherits, up to one that takes
    none (where its ``**kwargs`` go, as a rule). None where it takes any (its
    ``**kwargs`` reach torch.optim.Optimizer's ``defaults``), or one has no signature
    to read."""
    found: dict[str, inspect.Parameter] = {}
    for cls in optimizer_class.__mro__:
        if "__init__" not in vars(cls):
            continue
        if cls is torch.optim.Optimizer:  # reached through **kwargs: its defaults
            return None
        try:
            parameters = inspect.signature(vars(cls)["__init__"]).parameters
        except (TypeError, ValueError):
            return None
        for name, p in parameters.items():
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and name not in ("self", "params"):
                found.setdefault(name, p)
        if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            return found
    return None


def constructor_defaults(optimizer_class: type, defaults: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``defaults`` that ``optimizer_class``'s constructor takes, to
    build one like it: all of them where it takes any.

    ``defaults`` can hold more than its constructor's arguments (torch's AdamW is an
    Adam with ``decoupled_weight_decay=True``, which AdamW's constructor does not
    take); every group holds those entries anyway, so the groups keep them."""
    accepted = constructor_parameters(optimizer_class)
    if accepted is None:
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in accepted}
