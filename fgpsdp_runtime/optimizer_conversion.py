"""What ``ShardedOptimizer.from_optimizer`` needs of a torch.optim optimizer that a
trainer or a framework built over the wrapped module's parameters (Lightning
Fabric's ``fabric.setup(model, optimizer)``, a transformers Trainer's
``create_optimizer``): its class, its param groups as torch.optim takes them, the
constructor arguments among its defaults, and what a conversion would lose silently,
which is refused instead.

Pure: no communication (the caller makes every rank agree before raising).
"""
from __future__ import annotations

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
    if getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        # The scheduler would go on setting the learning rate of the optimizer
        # given, which no longer steps anything.
        return ValueError, ("an lr scheduler was built on this optimizer: it would "
                            "schedule the optimizer given, not the ShardedOptimizer. "
                            "Build the scheduler on the optimizer from_optimizer returns "
                            "(under Lightning Fabric: on the one fabric.setup returns)")
    hooked = [name.strip("_").replace("optimizer_", "") for name in _HOOK_REGISTRIES
              if getattr(optimizer, name, None)]
    if hooked:
        return ValueError, ("this optimizer has hooks registered on it ("
                            + ", ".join(hooked) + "): register them on the optimizer "
                            "from_optimizer returns instead")
    return None


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
    take); every group holds those entries anyway, so the groups keep them."""
    try:
        parameters = inspect.signature(optimizer_class.__init__).parameters
    except (TypeError, ValueError):  # no signature to read: give them all
        return dict(defaults)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in parameters and k not in ("self", "params")}
