"""The wrapper's constructor keywords: torch DDP's and what each means here, and
the checks of this library's own.

The wrapper takes torch DDP's keywords (torch 2.15's, in its positional
order), so that a loop written for torch DDP runs unchanged. Each one either
means here what it means there, is accepted and has nothing to do here (said
where it is taken), or is refused with a sentence saying what to use instead.
"""
from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from .plan import OverlapPlan
from .validation import SUPPORTED_DTYPES

SCHEDULES = ("serial", "overlap_backward", "next_forward", "two_stage")


@dataclass(frozen=True)
class BufferSync:
    """When rank 0's buffers are broadcast."""

    at_init: bool  # with the parameters, at construction (unless init_sync=False)
    at_forward: bool  # at every forward (the ``broadcast_buffers`` attribute)


def buffer_sync(broadcast_buffers: Optional[bool],
                forward_sync_buffers: Optional[bool]) -> BufferSync:
    """torch's rule: ``forward_sync_buffers`` (torch 2.13) sets the forward's sync
    only and buffers are synced at init; the older ``broadcast_buffers=False``
    also keeps rank-local buffers out of the init sync; both default to syncing.
    Unlike torch 2.13 this does not warn about ``broadcast_buffers``: loops
    written for older torch pass it, and here it keeps its meaning."""
    if forward_sync_buffers is not None:
        return BufferSync(at_init=True, at_forward=bool(forward_sync_buffers))
    sync = True if broadcast_buffers is None else bool(broadcast_buffers)
    return BufferSync(at_init=sync, at_forward=sync)


def named_device(device_id: Any) -> torch.device:
    """The device ``device_ids[0]`` names: an index (an int, a numpy int, a 0-dim
    integer tensor) is a GPU's; otherwise a device or its name."""
    try:
        index = operator.index(device_id)
    except TypeError:
        return torch.device(device_id)
    return torch.device("cuda", index)


def device_ids_problem(device_ids: Sequence[Any], module: nn.Module) -> Optional[str]:
    """torch DDP's rule: ``device_ids`` only for a GPU module, naming its device
    (else the forward would move the inputs to a device the module is not on)."""
    try:
        wanted = named_device(device_ids[0])
    except (RuntimeError, TypeError) as error:
        return f"device_ids={list(device_ids)!r}: not a device ({error})"
    on = {p.device for p in module.parameters()}
    if any(d.type != wanted.type or (wanted.index is not None and d.index is not None
                                     and d.index != wanted.index) for d in on):
        return (f"device_ids={list(device_ids)} names {wanted}, but the module's parameters "
                f"are on {sorted(str(d) for d in on)}; give device_ids=None for a CPU "
                "module, or the module's own GPU")
    return None


def process_group_of(process_group: Optional[dist.ProcessGroup],
                     device_mesh: Any) -> Optional[dist.ProcessGroup]:
    """The group to train over: ``process_group``, or a 1-D ``device_mesh``'s: the
    whole mesh, or one dimension sliced from a larger one (``mesh["dp"]``, data
    parallel beside tensor-parallel layers of plain tensors; DTensor parameters,
    which torch DDP turns into local ones first, are refused in validation.py)."""
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh.ndim != 1:
        raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
    return device_mesh.get_group(mesh_dim=0)


def refuse_unsupported(*, mixed_precision: Any, delay_all_reduce_named_params: Any,
                       param_to_hook_all_reduce: Any) -> None:
    if mixed_precision is not None:
        raise NotImplementedError(
            "fgpsdp: DistributedDataParallel(mixed_precision=...) (torch's experimental "
            "_MixedPrecision) is not supported: keep the parameters in their dtype, run the "
            "forward under torch.autocast, and set reduce_dtype= for the gradients' dtype "
            "on the wire")
    if delay_all_reduce_named_params is not None or param_to_hook_all_reduce is not None:
        raise NotImplementedError(
            "fgpsdp: delay_all_reduce_named_params / param_to_hook_all_reduce are not "
            "supported: every trainable parameter is reduced in its bucket")


def bucket_caps_bytes(bucket_cap_mb_list: Optional[Sequence[float]]
                      ) -> Optional[tuple[int, ...]]:
    """torch's ``bucket_cap_mb_list``: the k-th bucket that backward fills closes at
    its k-th entry, the last entry standing for all later buckets. As in torch, an
    entry under one byte is 0 bytes: that bucket closes after its first parameter."""
    if not bucket_cap_mb_list:
        return None
    if not all(mb >= 0 for mb in bucket_cap_mb_list):  # (NaN too)
        raise ValueError(f"bucket_cap_mb_list entries must be >= 0, got {list(bucket_cap_mb_list)}")
    return tuple(int(mb * 1024 * 1024) for mb in bucket_cap_mb_list)


def ignored_names(module: torch.nn.Module) -> frozenset[str]:
    """Names torch DDP leaves alone: set by
    ``torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``
    (rank-local buffers and parameters, which no broadcast overwrites)."""
    return frozenset(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


@dataclass(frozen=True)
class CheckedArguments:
    """The keywords whose values the wrapper checks itself, each invalid one
    replaced by a valid value, and what was wrong with them. The problems are not
    raised here: the wrapper says them on every rank (``agree_or_raise``), as one
    given on one rank only would leave the others waiting in a collective."""

    schedule: str
    overlap_plan: Union[str, OverlapPlan]
    reduce_dtype: Optional[torch.dtype]
    speculation_memory_mb: Optional[float]
    bucket_cap_mb: Optional[float]
    bucket_caps: Optional[tuple[int, ...]]  # bucket_cap_mb_list in bytes
    device_ids: Optional[Sequence[Any]]
    problems: list[str]


def checked_arguments(module: nn.Module, *, schedule: str,
                      overlap_plan: Union[str, OverlapPlan],
                      reduce_dtype: Optional[torch.dtype],
                      speculation_memory_mb: Optional[float], bucket_cap_mb: Optional[float],
                      bucket_cap_mb_list: Optional[Sequence[float]],
                      device_ids: Optional[Sequence[Any]]) -> CheckedArguments:
    """The constructor's own keywords checked (see CheckedArguments); warns, at the
    wrapper's caller, of a speculation budget the plan will not use."""
    problems = []
    try:
        bucket_caps = bucket_caps_bytes(bucket_cap_mb_list)
    except ValueError as error:
        problems.append(str(error))
        bucket_caps = None
    if reduce_dtype is not None and reduce_dtype not in SUPPORTED_DTYPES:
        problems.append("reduce_dtype must be a floating dtype (" + ", ".join(
            str(d) for d in SUPPORTED_DTYPES) + f") or None, got {reduce_dtype!r}")
        reduce_dtype = None
    if schedule not in SCHEDULES:
        problems.append(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        schedule = "serial"
    if not (isinstance(overlap_plan, OverlapPlan) or overlap_plan in ("auto", "layout")):
        problems.append("overlap_plan must be 'auto', 'layout' or an OverlapPlan, "
                        f"got {overlap_plan!r}")
        overlap_plan = "layout"
    if speculation_memory_mb is not None and not (
            isinstance(speculation_memory_mb, (int, float))
            and not isinstance(speculation_memory_mb, bool) and speculation_memory_mb >= 0):
        problems.append("speculation_memory_mb must be a number >= 0 or None, "
                        f"got {speculation_memory_mb!r}")
        speculation_memory_mb = None
    elif speculation_memory_mb is not None and (schedule != "two_stage"
                                                or overlap_plan != "auto"):
        # A plan given (or the layout's) is run as it is; other schedules do not
        # speculate. stacklevel: the wrapper's caller.
        warnings.warn("fgpsdp: speculation_memory_mb bounds the plan two_stage derives with "
                      f"overlap_plan='auto' only; ignored here (schedule={schedule!r}, "
                      "overlap_plan=" + (repr(overlap_plan) if isinstance(overlap_plan, str)
                                         else "an OverlapPlan") + ")", UserWarning,
                      stacklevel=3)
    # As in torch DDP, a cap under one byte (0 too) puts each parameter in a bucket
    # of its own.
    if bucket_cap_mb is not None and not bucket_cap_mb >= 0 and bucket_caps is None:
        problems.append(f"bucket_cap_mb must be >= 0 (or None: automatic), got {bucket_cap_mb}")
        bucket_cap_mb = None
    if device_ids is not None and len(device_ids) != 1:
        problems.append("device_ids must name exactly one device (single-device modules)")
        device_ids = None
    misplaced = device_ids_problem(device_ids, module) if device_ids is not None else None
    if misplaced:
        problems.append(misplaced)
        device_ids = None
    return CheckedArguments(schedule, overlap_plan, reduce_dtype, speculation_memory_mb,
                            bucket_cap_mb, bucket_caps, device_ids, problems)
