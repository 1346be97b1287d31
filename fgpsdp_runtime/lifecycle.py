"""What a wrapper claims from the process and gives back when it is dropped.

A module may outlive its wrapper (wrapped again to unfreeze layers, a
hyperparameter sweep in one process). The wrapper's gradient hooks live in
C++ on the parameters, where the garbage collector cannot see them, and its
forward hooks on the module, which the loop keeps: both reach the wrapper
only weakly, so a dropped wrapper is freed, and its ``__del__`` removes the
hooks, stops the threads and destroys the process groups it created. While a
wrapper lives, its parameters are claimed: a second wrapper of them would
take their gradients too, and is refused.
"""
from __future__ import annotations

import functools
import gc
import weakref
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .backends import backend_of

if TYPE_CHECKING:  # pragma: no cover
    from .ddp import DistributedDataParallel

# id(parameter) -> (the parameter, the wrapper whose buckets hold it), both weakly.
_WRAPPER_OF_PARAM: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def wrapper_of(param: torch.Tensor) -> Optional["DistributedDataParallel"]:
    """The live wrapper whose buckets hold ``param``, if any."""
    entry = _WRAPPER_OF_PARAM.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def wrapped_elsewhere(trainable: Sequence[tuple[str, nn.Parameter]]) -> list[str]:
    """Parameters a live wrapper holds in its buckets: both would take their
    gradients. A wrapper the loop dropped may wait in a reference cycle for
    the garbage collector: collected first."""
    if not any(wrapper_of(p) is not None for _, p in trainable):
        return []
    gc.collect()
    taken = [n for n, p in trainable if wrapper_of(p) is not None]
    if not taken:
        return []
    # Two cases: the module wrapped again, or two models sharing a module (an
    # embedding, a backbone), each wrapped (torch DDP reduces the shared one twice).
    return [f"parameter '{taken[0]}' is held by another fgpsdp DistributedDataParallel that is "
            "still alive, and a parameter lives in one wrapper's buckets only. Wrapping a "
            "module again: drop every reference to the old wrapper (and to its "
            "ShardedOptimizer and lr scheduler) first. Two models sharing parameters (a "
            "backbone, an embedding): wrap one module holding both, whose forward runs "
            "either (model(x, which)); parameters a step does not use need no flag here"]


def claim(trainable: Sequence[tuple[str, nn.Parameter]],
          wrapper: "DistributedDataParallel") -> None:
    """``wrapper`` holds these parameters while it lives (see wrapped_elsewhere)."""
    for stale in [k for k, (p, w) in _WRAPPER_OF_PARAM.items() if p() is None or w() is None]:
        del _WRAPPER_OF_PARAM[stale]
    wrapper_ref = weakref.ref(wrapper)
    for _, param in trainable:
        _WRAPPER_OF_PARAM[id(param)] = (weakref.ref(param), wrapper_ref)


# [Note: the last step's all-gathers and destroy_process_group()]
# Under next_forward and two_stage a step ends with its all-gathers running on
# the link workers, to land during the next forward. A loop that ended there
# and destroyed the process group on one rank (the usual last line, or a Ctrl-C
# handler's) closed the connections while that rank's sends were in flight, and
# a peer still reading its parameters (rank 0 saving) got "Connection closed by
# peer" instead of the values; torch DDP's step leaves nothing in flight. torch
# has no hook on that call, so the first wrapper puts two in front of it: the
# live wrappers on the destroyed group (every wrapper, for the default group)
# first let their submitted collectives run and stop their threads, bounded as
# at exit (shutdown.py).
# - torch.distributed's destroy_process_group is replaced, which every torch
#   version calls, but only a script that looks it up after the first wrapper
#   is built gets the replacement;
# - ProcessGroup.shutdown (torch 2.13, 2.14), or c10d._shutdown_backend (torch
#   2.4): the destroy shuts every group down through it before it forgets any,
#   so this one also catches a script that bound the function before (``from
#   torch.distributed import destroy_process_group`` at the top, as nanoGPT's
#   train.py has).
_LIVE_WRAPPERS: "weakref.WeakSet[DistributedDataParallel]" = weakref.WeakSet()


def finish_before_destroy(wrapper: "DistributedDataParallel") -> None:
    """``wrapper`` finishes its communication before its group is destroyed."""
    _LIVE_WRAPPERS.add(wrapper)
    c10d = dist.distributed_c10d
    torch_destroy = c10d.destroy_process_group
    if getattr(torch_destroy, "_fgpsdp_torch_destroy", None) is not None:
        return  # already in front

    @functools.wraps(torch_destroy)
    def destroy_process_group(group=None):
        _finish_wrappers_on(group, everything=group is None or group is dist.GroupMember.WORLD)
        return torch_destroy(group)

    destroy_process_group._fgpsdp_torch_destroy = torch_destroy
    c10d.destroy_process_group = destroy_process_group
    if dist.destroy_process_group is torch_destroy:
        dist.destroy_process_group = destroy_process_group
    _finish_before_group_shutdown()


def _finish_before_group_shutdown() -> None:
    """Before a group shuts down, the live wrappers communicating over it finish:
    in front of ``ProcessGroup.shutdown`` (torch 2.13, 2.14), or of the module
    function older destroys call for each group (torch 2.4's
    ``_shutdown_backend``, looked up by name when called)."""
    process_group_class = getattr(dist, "ProcessGroup", None)
    if getattr(process_group_class, "shutdown", None) is not None:
        _put_in_front(process_group_class, "shutdown")
    c10d = dist.distributed_c10d
    if getattr(c10d, "_shutdown_backend", None) is not None:
        _put_in_front(c10d, "_shutdown_backend")


def _put_in_front(owner, name: str) -> None:
    torch_call = getattr(owner, name)
    if getattr(torch_call, "_fgpsdp_torch_call", None) is not None:
        return  # already in front

    @functools.wraps(torch_call)
    def finish_then_call(group, *args, **kwargs):
        _finish_wrappers_on(group)
        return torch_call(group, *args, **kwargs)

    finish_then_call._fgpsdp_torch_call = torch_call
    setattr(owner, name, finish_then_call)


def _finish_wrappers_on(group, everything: bool = False) -> None:
    """The live wrappers communicating over ``group`` (all of them: ``everything``)
    let their submitted collectives run and stop their threads."""
    for live in list(_LIVE_WRAPPERS):
        if everything or _communicates_over(live, group):
            live._finish_communication()


def _communicates_over(wrapper: "DistributedDataParallel", group) -> bool:
    """The wrapper's process group (None: the default one) or one of its own."""
    state = wrapper.__dict__
    its_group = state.get("process_group")
    if its_group is None:
        its_group = dist.GroupMember.WORLD
    return group is its_group or any(group is own for own in state.get("_own_groups", ()))


def destroy_gloo_group(group) -> None:
    """Free a group's sockets and threads (a wrapper rebuilt many times in one
    process would run out of file descriptors). Only gloo's: destroying is
    local there, while NCCL's abort was a collective in some versions, which a
    finalizer on one rank cannot run."""
    try:
        if (group is None or group == dist.GroupMember.NON_GROUP_MEMBER
                or not dist.is_initialized()
                or backend_of(group, torch.device("cpu")) != "gloo"
                or backend_of(group, torch.device("cuda")) not in (None, "gloo")):
            return
        dist.destroy_process_group(group)
    except (ValueError, RuntimeError):
        pass  # already gone with the default group (destroy_process_group() at exit)


def weak_call(method):
    """``method`` called while its object lives (a no-op after)."""
    method_ref = weakref.WeakMethod(method)

    def call(*args):
        bound = method_ref()
        return bound(*args) if bound is not None else None
    return call


class HookHandles:
    """Hook handles whose removal also works from a finalizer the garbage
    collector runs: it clears the weak references a torch ``RemovableHandle``
    holds to its hook dicts before it runs finalizers, so ``handle.remove()``
    there does nothing. These keep the dicts (the module's or tensor's own)."""

    def __init__(self):
        self._entries: list[tuple[int, list[dict]]] = []
        self._attributes: list[tuple[dict, str, object]] = []

    def add(self, handle) -> None:
        refs = [handle.hooks_dict_ref, *getattr(handle, "extra_dict_ref", ())]
        self._entries.append((handle.id, [d for d in (r() for r in refs) if d is not None]))

    def add_instance_attribute(self, obj, name: str, value) -> None:
        """Set ``obj.name = value`` in its ``__dict__`` (no ``__setattr__`` of its
        class runs); removed with the hooks, if it is still ours then."""
        obj.__dict__[name] = value
        self._attributes.append((obj.__dict__, name, value))

    def remove(self) -> None:
        for hook_id, dicts in self._entries:
            for hooks in dicts:
                hooks.pop(hook_id, None)
        self._entries.clear()
        for attributes, name, value in self._attributes:
            if attributes.get(name) is value:
                del attributes[name]
        self._attributes.clear()
