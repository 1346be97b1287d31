"""The ``param_groups=`` a ShardedOptimizer is built with, read as torch.optim
reads an optimizer's parameters: the groups to slice, and how torch.optim would
number the parameters in a state dict (full_state_dict() writes that format).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from .module_guards import plain_named_parameters
from .user_warnings import warn_at_user_code


@dataclass(frozen=True)
class GroupsAsGiven:
    # Per group its entries, "params" holding the trainable parameters (frozen ones
    # dropped, as torch.optim never steps them) and no "param_names".
    groups: list[dict[str, Any]]
    # Every group's parameters as torch.optim would number them in a state dict
    # (frozen ones included); by default those of AdamW(model.parameters()).
    numbered_params: list[list[torch.Tensor]]
    numbered_names: list[Optional[list[str]]]  # "param_names", as torch's; None: unnamed
    default: bool  # no param_groups= given: one group of every trainable parameter


def read_param_groups(model: Any, param_groups: Any) -> GroupsAsGiven:
    """``param_groups`` (None, a dict, a list of dicts, or parameters as torch.optim
    takes them) over the wrapper ``model``'s parameters. TypeError or ValueError
    where torch.optim would refuse it, or a tensor is no trainable parameter of
    the wrapped module; warns of trainable parameters in no group."""
    named_trainable = model.named_trainable_parameters()
    trainable = [p for _, p in named_trainable]
    ignored = {id(p): n for n, p in model.named_ignored_parameters()}
    if param_groups is None:
        return GroupsAsGiven(groups=[{"params": trainable}],
                             numbered_params=[[p for _, p in plain_named_parameters(model.module)]],
                             numbered_names=[None], default=True)
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    param_groups = list(param_groups)
    if param_groups and isinstance(param_groups[0], (torch.Tensor, tuple)):
        param_groups = [{"params": param_groups}]  # parameters, as torch.optim takes them
    groups, seen = [], set()
    numbered_params: list[list[torch.Tensor]] = []
    numbered_names: list[Optional[list[str]]] = []
    for i, group in enumerate(param_groups):
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(f"param_groups[{i}] must be a dict with a 'params' entry")
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        # Named parameters, (name, parameter) pairs as torch.optim accepts them.
        names = [p[0] for p in params if isinstance(p, tuple)]
        if names:
            if len(names) != len(params) or not all(len(p) == 2 for p in params):
                raise ValueError(f"param_groups[{i}]: give every parameter with a name "
                                 "((name, parameter) pairs) or none")
            params = [p[1] for p in params]
        if i > 0 and bool(names) != (numbered_names[0] is not None):
            raise ValueError("fgpsdp: all optimizer param groups should be with/without "
                             "names (as torch.optim requires)")
        numbered_params.append(params)
        numbered_names.append(names or None)
        kept = []
        for p in params:
            if id(p) in seen:
                raise ValueError(f"param_groups[{i}]: a parameter appears in two groups")
            seen.add(id(p))
            if model.param_index(p) is None:
                if isinstance(p, torch.nn.Parameter) and not p.requires_grad:
                    continue  # frozen: never stepped, as with torch.optim
                if id(p) in ignored:
                    raise ValueError(
                        f"param_groups[{i}]: parameter {ignored[id(p)]!r} is named in "
                        "_ddp_params_and_buffers_to_ignore: no bucket holds it, so a "
                        "ShardedOptimizer cannot step it. Step it with an optimizer of its "
                        "own (torch.optim.AdamW(those parameters)), and leave it out of "
                        "this one's groups")
                raise ValueError(f"param_groups[{i}]: a tensor of shape {tuple(p.shape)} "
                                 "is not a trainable parameter of the wrapped module (was "
                                 "it frozen when the module was wrapped?)")
            kept.append(p)
        groups.append({**{k: v for k, v in group.items() if k != "param_names"},
                       "params": kept})
    # (Not those frozen since wrapping: they get no gradient, nothing to step.)
    left_out = [name for name, p in named_trainable if id(p) not in seen and p.requires_grad]
    if left_out:
        # Under torch DDP a second torch.optim optimizer over these would train
        # them; here it sees no gradient (found by an audit: silently untrained).
        shown = ", ".join(repr(n) for n in left_out[:3]) + (", ..." if len(left_out) > 3 else "")
        warn_at_user_code(
            f"fgpsdp: {len(left_out)} trainable parameter(s) of the wrapped module are in "
            f"no param group of this ShardedOptimizer ({shown}): their gradients are "
            "reduced and they are never stepped. A torch.optim optimizer over them would "
            "not train them either: the reduced gradients live in this rank's bucket "
            "slices, never in param.grad. Put them in a param group here (lr=0 holds them "
            "still), or freeze them (requires_grad_(False))")
    return GroupsAsGiven(groups=groups, numbered_params=numbered_params,
                         numbered_names=numbered_names, default=False)
