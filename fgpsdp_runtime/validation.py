"""Set-up checks that every rank agrees on, so bad input fails everywhere at once.

A check that fails on one rank only would leave the others waiting in their
next collective until the process-group timeout. Each rank therefore makes
its local checks, then one all_gather_object shares every rank's findings and
model description, and every rank raises the same exception.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .buckets import memory_dim_order
from .object_collectives import all_gather_objects

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class ParamDescription:
    name: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool
    # Memory order of a trainable one's dims (buckets.memory_dim_order): every
    # rank's buckets must hold the same element at the same place.
    dim_order: Optional[tuple[int, ...]] = None

    def text(self, with_layout: bool) -> str:
        layout = ""
        if with_layout:
            layout = " row-major" if self.dim_order is None else \
                f" stored in dim order {list(self.dim_order)}"
        return (f"'{self.name}' {list(self.shape)} {self.dtype}{layout} "
                f"requires_grad={self.requires_grad}")


@dataclass(frozen=True)
class BufferDescription:
    """A buffer the wrapper broadcasts from rank 0 (at construction or forward)."""
    name: str
    shape: tuple[int, ...]
    dtype: str

    def text(self) -> str:
        return f"'{self.name}' {list(self.shape)} {self.dtype}"


def describe_buffers(named_buffers: Sequence[tuple[str, torch.Tensor]]
                     ) -> list[BufferDescription]:
    return [BufferDescription(name, tuple(b.shape), str(b.dtype).replace("torch.", ""))
            for name, b in named_buffers]


def first_buffer_difference(reference: Sequence[BufferDescription],
                            other: Sequence[BufferDescription]) -> Optional[str]:
    """Broadcast as one flat tensor per dtype, buffers that differ in shape or dtype
    would be filled with another rank's bytes (or wait for a broadcast no peer sends)."""
    for ref, oth in zip(reference, other):
        if ref != oth:
            return f"buffer {ref.text()} on rank 0 vs {oth.text()}"
    return _count_difference(reference, other, "synced buffers",
                             lambda extra: f"buffer {extra.text()}")


def _count_difference(reference: Sequence, other: Sequence, kind: str,
                      name: Callable[[Any], str]) -> Optional[str]:
    """After equal leading items: the counts differ, naming the first unmatched one."""
    if len(reference) == len(other):
        return None
    longer = reference if len(reference) > len(other) else other
    extra = longer[min(len(reference), len(other))]
    return (f"{len(reference)} {kind} on rank 0 vs {len(other)}; first unmatched "
            f"{name(extra)}")


def describe(named_params: Sequence[tuple[str, torch.nn.Parameter]]) -> list[ParamDescription]:
    return [ParamDescription(name, tuple(p.shape), str(p.dtype).replace("torch.", ""),
                             bool(p.requires_grad),
                             memory_dim_order(p) if p.requires_grad else None)
            for name, p in named_params]


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # (torch before 2.5 keeps it in torch.distributed._tensor)
        try:
            from torch.distributed._tensor import DTensor
        except ImportError:
            return False
    return isinstance(tensor, DTensor)


def local_problems(module: torch.nn.Module,
                   trainable: Sequence[tuple[str, torch.nn.Parameter]]) -> list[str]:
    """What this rank finds wrong with its module, as sentences."""
    problems = []
    if torch.is_inference_mode_enabled():
        # Tensors made here could never join an autograd graph (torch DDP fails too,
        # on its first in-place broadcast).
        problems.append("the wrapper was built under torch.inference_mode(); build it "
                        "outside (torch.no_grad() is fine)")
    if not trainable:
        # torch DDP refuses it too: there would be nothing to reduce or step, and
        # a loop that wraps such a module by mistake (all of it frozen before the
        # layers to fine-tune were unfrozen) is better told than left running
        # steps that change nothing.
        problems.append("the module has no parameter that requires a gradient (none at "
                        "all, or all frozen): nothing to train in data parallel; unfreeze "
                        "the parameters to train before wrapping")
    devices = {p.device for _, p in trainable}
    if len(devices) > 1:
        listing = ", ".join(f"{n} on {p.device}" for n, p in trainable[:8])
        problems.append(f"trainable parameters are on several devices ({listing}); "
                        "a module must live on one device")
    sync_bn = next((name for name, m in module.named_modules()
                    if isinstance(m, torch.nn.SyncBatchNorm)), None)
    if sync_bn is not None and devices and all(d.type == "cpu" for d in devices):
        # As torch DDP, at construction: its forward would raise on every rank (it
        # takes GPU inputs only), while an eval forward would run.
        problems.append(f"SyncBatchNorm layers only work with GPU modules (layer '{sync_bn}' "
                        "of a module on the CPU, which torch DDP refuses too): keep "
                        "nn.BatchNorm layers for CPU ranks, or move the module to its GPU "
                        "first")
    for name, param in trainable:
        if _is_dtensor(param):
            # Its local shard is what the buckets would hold; torch DDP first turns a
            # 2-D mesh's DTensors into local tensors with hooks of its own.
            problems.append(f"parameter '{name}' is a DTensor (torch.distributed.tensor): "
                            "not supported; tensor-parallel layers of plain tensors "
                            "(Megatron's style) train beside the wrapper over the "
                            "data-parallel group (process_group=, or "
                            "device_mesh=mesh['dp'])")
            break
        if param.device.type == "meta":
            problems.append(f"parameter '{name}' is on the meta device; materialise it first")
            break
        if param.is_inference():
            problems.append(f"parameter '{name}' is an inference tensor (made under "
                            "torch.inference_mode()) and cannot be trained; create the "
                            "module outside inference mode, or replace it with "
                            "nn.Parameter(t.clone()) outside it")
            break
        if param.dtype not in SUPPORTED_DTYPES:
            problems.append(f"parameter '{name}' has dtype {param.dtype}; supported: "
                            + ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES))
            break
        if any(stride == 0 and size > 1 for size, stride in zip(param.shape, param.stride())):
            # Its span in a bucket would be dense: the elements that share memory
            # would train apart. torch DDP and torch's optimizers refuse it too.
            problems.append(f"parameter '{name}' has elements that share memory (stride 0, "
                            f"an expand(): strides {tuple(param.stride())}); make it "
                            "nn.Parameter(t.clone()) or keep the smaller tensor as the parameter")
            break
    trainable_ids = {id(p) for _, p in trainable}  # (not those the wrapper leaves alone)
    for mod_name, mod in module.named_modules():
        if getattr(mod, "sparse", False) is True and any(
                id(p) in trainable_ids for p in mod.parameters(recurse=False)):
            problems.append(f"module '{mod_name or type(mod).__name__}' produces sparse "
                            "gradients (sparse=True); sparse gradients are not supported")
    return problems


def shared_memory_problem(trainable: Sequence[tuple[str, torch.nn.Parameter]]
                          ) -> Optional[str]:
    """Trainable parameters made from one tensor (``nn.Parameter(fused[:d])``).

    Wrapping moves each into its own bucket span. Two that overlap would then
    train apart, where torch DDP's steps land in one memory. Views of one tensor
    share one autograd version counter: a step of one bucket would mark the
    others as modified in place, and a backward still holding them (two_stage
    steps during backward) would raise torch's "modified by an inplace
    operation", or our after-step write check would. Both refused; a
    ``.clone()`` per parameter makes them separate tensors. Call it only for
    parameters no live wrapper holds: it bumps version counters.
    """
    by_storage: dict[tuple, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, param in trainable:
        if param.numel() and param.device.type != "meta":
            # Per dtype: an arena of several dtypes is not compared (offsets are
            # in elements).
            key = (param.device, param.dtype, param.untyped_storage().data_ptr())
            by_storage.setdefault(key, []).append((name, param))
    bump = getattr(torch.autograd.graph, "increment_version", None)  # torch >= 2.1
    for group in by_storage.values():
        if len(group) < 2:
            continue
        overlapping = _first_overlap(group)
        if overlapping is not None:
            return (f"parameters '{overlapping[0]}' and '{overlapping[1]}' share memory (one "
                    "is a view of the other, or both of one tensor); wrapped, they would "
                    "train apart. Make them separate tensors (nn.Parameter(t.clone())) or "
                    "one parameter")
        if bump is None:
            continue
        # One bump each (harmless at wrapping: no graph holds them yet): a
        # counter shared by k parameters moves by k.
        before = [p._version for _, p in group]
        for _, param in group:
            bump(param)
        shared = [name for (name, p), v in zip(group, before) if p._version - v > 1]
        if shared:
            return (f"parameters '{shared[0]}' and '{shared[1]}' are views of one tensor "
                    "(they share one autograd version counter): a step of one would count "
                    "as an in-place change of the other. Make them separate tensors "
                    "(nn.Parameter(t.clone()))")
    return None


def _first_overlap(group: Sequence[tuple[str, torch.Tensor]]) -> Optional[tuple[str, str]]:
    """Two tensors of one storage that share an element, sweeping by first element."""
    def extent(t):
        first = t.storage_offset()
        return first, first + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    spans = sorted(((extent(t), name, t) for name, t in group), key=lambda x: x[0])
    (lo, hi), name, t = spans[0]  # of those so far, the one reaching furthest
    for (next_lo, next_hi), next_name, nt in spans[1:]:
        if next_lo <= hi and _share_an_element(t, lo, nt, next_lo, max(hi, next_hi)):
            return name, next_name
        if next_hi > hi:
            (lo, hi), name, t = (next_lo, next_hi), next_name, nt
    return None


def _share_an_element(a: torch.Tensor, a_lo: int, b: torch.Tensor, b_lo: int,
                      hi: int) -> bool:
    # Interleaved views (w[::2], w[1::2]) cross ranges without sharing: mark a's.
    lo = min(a_lo, b_lo)
    mask = torch.zeros(hi - lo + 1, dtype=torch.bool)
    mask.as_strided(a.shape, a.stride(), a_lo - lo).fill_(True)
    return bool(mask.as_strided(b.shape, b.stride(), b_lo - lo).any())


def first_difference(reference: Sequence[ParamDescription],
                     other: Sequence[ParamDescription]) -> Optional[str]:
    for ref, oth in zip(reference, other):
        if ref != oth:
            layouts_differ = ref.dim_order != oth.dim_order
            hint = "; convert the memory format on every rank, or on none, before " \
                "wrapping" if layouts_differ else ""
            return (f"parameter {ref.text(layouts_differ)} on rank 0 vs "
                    f"{oth.text(layouts_differ)}{hint}")
    return _count_difference(reference, other, "parameters",
                             lambda extra: f"parameter '{extra.name}' {list(extra.shape)}")


# Said when a setting differs between ranks: how to make them agree.
_SETTING_HINTS = {
    "topology": "give every rank the same topology= and FGPSDP_SHARED_MEMORY; torchrun the "
                "same --nproc_per_node",
    "buffer sync (at construction, at forward)":
        "give every rank the same broadcast_buffers and forward_sync_buffers",
}


def agree_or_raise(group: Optional[dist.ProcessGroup], problems: list[str],
                   description: list[ParamDescription],
                   settings: Optional[dict[str, Any]] = None,
                   buffers: Optional[list[BufferDescription]] = None) -> None:
    """Share findings, model descriptions and ``settings`` (what every rank must
    resolve alike, by name: the topology, from arguments and the environment, and
    the arguments that shape the collectives); raise the same error on every rank."""
    world = dist.get_world_size(group)
    # Out of inference mode: a wrapper built under it must fail on every rank
    # with the message below, and older torch (2.4) failed the gather itself on
    # that rank alone (its tensors are inference tensors), leaving the others
    # waiting for the process group's timeout.
    with torch.inference_mode(False):
        gathered = all_gather_objects((problems, description, settings, buffers or []),
                                      group, "set-up checks")
    messages = []
    for rank, (rank_problems, _, _, _) in enumerate(gathered):
        messages.extend(f"rank {rank}: {p}" for p in rank_problems)
    reference = gathered[0][1]
    for rank in range(1, world):
        diff = first_difference(reference, gathered[rank][1])
        if diff is None:
            diff = first_buffer_difference(gathered[0][3], gathered[rank][3])
        if diff is not None:
            messages.append(f"rank {rank}: model differs from rank 0: {diff}")

    if not messages:  # settings matter once the ranks hold the same model
        messages = [line for rank in range(1, world)
                    for line in setting_differences(gathered[0][2], gathered[rank][2], rank)]
    if messages:
        raise ValueError("fgpsdp: cannot wrap the module:\n  " + "\n  ".join(messages))


def setting_differences(reference: Optional[dict[str, Any]], other: Optional[dict[str, Any]],
                        rank: int) -> list[str]:
    """What rank ``rank`` set otherwise than rank 0, one line per setting."""
    reference, other = reference or {}, other or {}
    lines = []
    for name in sorted(reference.keys() | other.keys()):
        mine, theirs = other.get(name), reference.get(name)
        if mine != theirs:
            hint = _SETTING_HINTS.get(name, f"give every rank the same {name}")
            if name == "topology":
                lines.append(f"rank {rank}: {mine}, unlike rank 0's {theirs} ({hint})")
            else:
                lines.append(f"rank {rank}: {name}={mine}, unlike rank 0's {theirs} ({hint})")
    return lines


def settings_agree_or_raise(group: Optional[dist.ProcessGroup], settings: dict[str, Any],
                            what: str) -> None:
    """Raise the same error on every rank when any rank's ``settings`` differ from rank 0's."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    gathered = all_gather_objects(settings, group, "settings check")
    messages = [line for rank in range(1, world)
                for line in setting_differences(gathered[0], gathered[rank], rank)]
    if messages:
        raise ValueError(f"fgpsdp: {what}:\n  " + "\n  ".join(messages))
