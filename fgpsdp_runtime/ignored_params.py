"""Trainable parameters the wrapper leaves to the user: those named in torch's
``_ddp_params_and_buffers_to_ignore`` (an expert-parallel model's experts, each rank's
own). No bucket holds them, as torch DDP reduces none of them; the user reduces them,
if at all, and steps them with an optimizer of their own.
"""
from __future__ import annotations

import operator
import weakref
from typing import Any, Optional, Sequence

import torch

from .module_guards import plain_parameter
from .user_warnings import warn_at_user_code


def ignored_places(module: torch.nn.Module, names: frozenset) -> list[tuple[str, str, str]]:
    """(name, its module's path, its name there) of each parameter ``names`` holds, in
    ``module.named_parameters()`` order (tied ones once); buffers are not wanted.
    The module and the parameter are looked up at each use: either may be replaced."""
    return [(name, *name.rpartition(".")[::2]) for name, _ in module.named_parameters()
            if name in names]


def parameters_at(module: torch.nn.Module, places: Sequence[tuple[str, str, str]]
                  ) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters at ``places`` now (a place no longer there is left out)."""
    found = []
    for name, path, leaf in places:
        try:
            owner = module.get_submodule(path)
        except AttributeError:
            continue
        param = plain_parameter(owner, leaf)
        if param is not None:
            found.append((name, param))
    return found


# The ShardedOptimizer steps after which parameters never written count as unstepped:
# a few, as a loop's first steps may be skipped (a loss scaler's infs).
STEPS_BEFORE_THE_CHECK = 3


class UnsteppedIgnoredParameters:
    """Warns once if, after ``STEPS_BEFORE_THE_CHECK`` of a ShardedOptimizer's
    steps, an ignored trainable parameter holding a gradient was never written
    since the optimizer was built. Under torch DDP one ``AdamW(model.parameters())``
    stepped them; a loop moved to ``ShardedOptimizer(model, ...)`` would leave them
    untrained, silently, without this. Written means its version counter moved (an
    optimizer's in-place step moves it) or its values' sum did (a fused step, or a
    write through ``.data``, moves no version counter)."""

    def __init__(self, named: Sequence[tuple[str, torch.nn.Parameter]]):
        # The sums stay on the parameters' device until the check: no host sync here.
        self._watched = [(name, param, param._version, _fingerprint(param))
                         for name, param in named]
        self._steps = 0

    def after_step(self) -> None:
        if not self._watched:
            return
        self._steps += 1
        if self._steps < STEPS_BEFORE_THE_CHECK:
            return
        unstepped = [name for name, param, version, fingerprint in self._watched
                     if param.grad is not None and _unchanged(param, version, fingerprint)]
        self._watched = []  # once
        if unstepped:
            shown = ", ".join(repr(n) for n in unstepped[:3]) + (", ..." if len(unstepped) > 3
                                                                  else "")
            warn_at_user_code(
                f"fgpsdp: {len(unstepped)} trainable parameter(s) named in "
                f"_ddp_params_and_buffers_to_ignore ({shown}) have gradients and have not "
                f"changed in {self._steps} steps: no bucket holds them, so this "
                "ShardedOptimizer does not step them. Step them with an optimizer of their "
                "own (torch.optim.AdamW(those parameters)), as the wrapper leaves them to you")


def _unchanged(param: torch.Tensor, version: int, fingerprint: torch.Tensor) -> bool:
    """Neither written in place nor of other values since the fingerprint; a
    parameter moved to another device, or on no real device (meta), counts as
    changed: a warning only where it surely holds."""
    if param._version != version:
        return False
    try:
        now = _fingerprint(param)
        return now.device == fingerprint.device and torch.equal(now, fingerprint)
    except (RuntimeError, NotImplementedError):
        return False


@torch.no_grad()
def _fingerprint(param: torch.Tensor) -> torch.Tensor:
    values = param.detach()
    if values.is_complex():  # (left to the user, a parameter may be complex)
        values = torch.view_as_real(values)
    return values.sum(dtype=torch.float64)


def ignored_gradients(named: Sequence[tuple[str, torch.nn.Parameter]]) -> list[torch.Tensor]:
    """The gradients a ShardedOptimizer's clip covers with ``clip_ignored_parameters``:
    those of ``named`` that hold one (sparse ones too: a rank-local embedding table)."""
    return [param.grad for _, param in named if param.grad is not None]


def check_ignored_parameter_replicas(replicas: object, clip_ignored_parameters: bool) -> None:
    """``ignored_parameter_replicas``: how many ranks hold each parameter left to the
    user (an expert on r ranks of an expert-data-parallel group), so that the norm
    counts it once; it means something only to ``clip_ignored_parameters``."""
    try:  # (a numpy int too; not a bool, nor a float)
        count = None if isinstance(replicas, bool) else operator.index(replicas)
    except TypeError:
        count = None
    if count is None or count < 1:
        raise ValueError(f"ignored_parameter_replicas must be an int >= 1, got {replicas!r}")
    if replicas != 1 and not clip_ignored_parameters:
        raise ValueError("ignored_parameter_replicas counts the parameters left to the user "
                         "in the norm: it needs clip_ignored_parameters=True")


def squares_of(grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """What holds each gradient's elements once: a sparse one's coalesced values
    (an uncoalesced index may repeat)."""
    return [g.coalesce().values() if g.is_sparse else g for g in grads]


# The live wrappers that leave trainable parameters to the user, in the order they were
# built (every rank builds them alike, and they agree that every rank leaves some):
# while one lives, ShardedGradScaler keeps every rank's loss scale the same.
_WRAPPERS_LEAVING_PARAMETERS: list[weakref.ref] = []


def note_wrapper_leaving_parameters(wrapper: Any) -> None:
    _WRAPPERS_LEAVING_PARAMETERS.append(weakref.ref(wrapper))


def latest_wrapper_leaving_parameters() -> Optional[Any]:
    """The last built of the live wrappers that leave trainable parameters to the user."""
    _WRAPPERS_LEAVING_PARAMETERS[:] = [ref for ref in _WRAPPERS_LEAVING_PARAMETERS
                                       if ref() is not None]
    return _WRAPPERS_LEAVING_PARAMETERS[-1]() if _WRAPPERS_LEAVING_PARAMETERS else None
