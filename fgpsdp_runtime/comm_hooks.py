"""torch DDP's communication hooks that this wrapper's reduction can stand for.

Gradients here are reduce-scattered bucket by bucket, not all-reduced, so a
hook (a function handed each bucket to all-reduce) has nothing to run on. But
the hooks loops register most (torch's ``fp16_compress_hook`` and
``bf16_compress_hook``, through Lightning's ``ddp_comm_hook`` or Accelerate's
``comm_hook``) only choose the dtype the gradients travel in, which is what
``reduce_dtype`` does: cast, divide by the world size, sum, cast back. Those,
``allreduce_hook`` (torch DDP's default reduction) and the compress wrappers
around ``allreduce_hook`` are read as a reduce dtype; any other hook (PowerSGD,
a loop's own) is refused, naming these.

Pure: no communication (the wrapper has the ranks agree on the result).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class HookReduction:
    """What a recognised hook asks of the reduction."""

    name: str  # for messages: "fp16_compress_hook", "fp16_compress_wrapper(allreduce_hook)"
    reduce_dtype: Optional[torch.dtype]  # None: each bucket in its parameters' dtype


def _default_hooks() -> Any:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    return default_hooks


def _wrapped_hook(hook: Any, wrapper: Any) -> Any:
    """The hook ``wrapper`` (torch's fp16/bf16_compress_wrapper) was given, if
    ``hook`` is what that wrapper returns; else None. The wrapper returns a new
    closure each call, so it is told by its code and its closed-over ``hook``."""
    made = getattr(wrapper(_default_hooks().allreduce_hook), "__code__", None)
    if made is None or getattr(hook, "__code__", None) is not made:
        return None
    return inspect.getclosurevars(hook).nonlocals.get("hook")


def hook_reduction(hook: Any) -> HookReduction:
    """The reduction ``hook`` stands for; NotImplementedError for any other hook."""
    hooks = _default_hooks()
    known = {hooks.allreduce_hook: HookReduction("allreduce_hook", None),
             hooks.fp16_compress_hook: HookReduction("fp16_compress_hook", torch.float16),
             hooks.bf16_compress_hook: HookReduction("bf16_compress_hook", torch.bfloat16)}
    for candidate, reduction in known.items():
        if hook is candidate:  # (a callable object may not hash)
            return reduction
    for wrapper, dtype in ((hooks.fp16_compress_wrapper, torch.float16),
                           (hooks.bf16_compress_wrapper, torch.bfloat16)):
        inner = _wrapped_hook(hook, wrapper)
        if inner is hooks.allreduce_hook:
            return HookReduction(f"{wrapper.__name__}(allreduce_hook)", dtype)
    # The same text on every rank (the ranks compare it): no repr, which holds an address.
    name = getattr(hook, "__qualname__", None) or f"a {type(hook).__qualname__} object"
    raise NotImplementedError(
        f"fgpsdp: register_comm_hook({name}) is not supported: gradients are "
        "reduce-scattered bucket by bucket (inside a node, then across nodes), not "
        "all-reduced, so a hook has no all-reduce to replace. torch's allreduce_hook, "
        "fp16_compress_hook and bf16_compress_hook (and fp16/bf16_compress_wrapper("
        "allreduce_hook)) are accepted: they set the dtype gradients travel in, as "
        "DistributedDataParallel(..., reduce_dtype=torch.float16 / torch.bfloat16) does")


def hook_state_problem(state: object, group: dist.ProcessGroup,
                       group_is_world: bool) -> Optional[str]:
    """torch's default hooks take a process group as state (None: the default
    group) and reduce over it: it must hold the wrapper's ranks."""
    if state is None:
        if group_is_world:
            return None
        return ("register_comm_hook(None, ...): torch's hook would reduce over the default "
                "group, not this wrapper's process_group; pass state=model.process_group")
    if isinstance(state, dist.ProcessGroup):
        if state is group or dist.get_process_group_ranks(state) \
                == dist.get_process_group_ranks(group):
            return None
        return ("register_comm_hook: the state names a process group over ranks "
                f"{dist.get_process_group_ranks(state)}, but this wrapper reduces over "
                f"ranks {dist.get_process_group_ranks(group)}")
    return ("register_comm_hook: the state of torch's default hooks is a process group "
            f"(or None), got {type(state).__name__}")


def reduce_dtype_problem(reduction: HookReduction, given: Optional[torch.dtype],
                         param_dtypes: list[torch.dtype]) -> Optional[str]:
    """A hook that would reduce in another dtype than ``reduce_dtype=`` given at
    wrapping: which one the loop meant is not ours to guess."""
    if given is None:
        return None
    wanted = {reduction.reduce_dtype} if reduction.reduce_dtype is not None \
        else set(param_dtypes)
    if wanted == {given}:
        return None
    return (f"register_comm_hook({reduction.name}) would reduce gradients in "
            f"{', '.join(sorted(str(d) for d in wanted))}, but the wrapper was built with "
            f"reduce_dtype={given}: give one of the two")
