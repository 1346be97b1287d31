"""Undo records for speculative optimizer steps.

A stage-1 step runs before the global gradient norm is known. Before it, the
bucket's parameter slice and the optimizer state of its slice tensors are
copied, and it reads a copy of the gradient slice; if the norm later asks for
clipping (or is not finite, or a parameter of the bucket turns out to be
unused on every rank), the copies are put back bit for bit and the step is
redone with the true gradient.

A speculative step also ran with the hyperparameters (learning rate, weight
decay, ...) of that moment. A training loop may set them between backward
and ``step()`` (a warm-up written just before the step); the record keeps
what the step ran with, so that the step can tell and redo it.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Optional, Sequence

import torch

from .step_wide_state import IMMUTABLE, copy_value, same_value, tensor_versions
from .thread_settings import flushes_denormals

# [Note: speculative steps during a torch.compile session]
# torch.compiler.is_compiling() is one flag for the whole process, True for as
# long as any thread compiles, and torch's optimizers read it: Adam then
# counts steps and corrects bias by another path, which rounds otherwise
# (AdamW parameters 2.5e-7 off torch DDP's after 4 steps). The main thread may
# compile while the scheduler thread steps (a backward compiled lazily, after a
# graph break whose later graph has already handed over gradients; a forward
# recompiled while the last speculative steps still run). So a speculative
# step waits for any session to end, then steps holding dynamo's compile lock,
# which every dynamo compile holds for its whole session: none can begin
# inside the step. (Checking the flag before and after the step alone missed
# a session that began and ended in between: a test's flake in CI.) The flag
# is still checked after the step, and the step redone, for what sets it
# without that lock (torch.export's non-strict tracing). Skipping the step
# instead is no way out: every rank must speculate the same buckets, in the
# same order, for the all-gathers to pair.
compile_session_active = getattr(torch.compiler, "is_compiling", None) or torch._utils.is_compiling


def wait_out_compile_session(poll_s: float = 0.001) -> None:
    while compile_session_active():
        time.sleep(poll_s)


def _dynamos_compile_lock():
    try:
        from torch._dynamo.convert_frame import compile_lock
    except ImportError:  # a torch without dynamo: nothing compiles
        return contextlib.nullcontext()
    return compile_lock


# ``with no_compile_session_begins:`` holds dynamo's compile lock: no torch.compile
# session begins in any thread until the block ends (one under way is not waited
# for: see the note). Looked up at import (the package imports dynamo anyway).
no_compile_session_begins = _dynamos_compile_lock()


class Hyperparameters:
    """A copy of what an optimizer step reads besides the tensors it updates: each
    group's entries but "params", then torch's default dtype, in which torch's
    optimizers create state (NAdam's, RMSprop's, Adagrad's step counts), and, for
    CPU arithmetic, the calling thread's flush-to-zero mode: a loop that changes
    either between backward and step has the speculative steps redone.

    (The scheduler thread adopts the flush mode the loop's thread had at the
    forward, thread_settings.py; one set after the forward reaches it only at the
    next one. A GPU's arithmetic ignores the mode, and the scheduler thread does
    not adopt it there.)

    Beside each copied tensor entry it keeps the loop's object and its version
    counters (step_wide_state.tensor_versions): two records of the same untouched
    tensor are equal without reading a GPU tensor's value."""

    def __init__(self, param_groups: Sequence[dict], *, cpu_arithmetic: bool):
        process_wide = {"torch default dtype": torch.get_default_dtype()}
        if cpu_arithmetic:
            process_wide["flushes subnormals"] = flushes_denormals()
        self.groups: list[dict[str, Any]] = []
        self.sources: list[dict[str, tuple]] = []  # per group: key -> (object, versions)
        for group in param_groups:
            # dict(group) first: one copy under the GIL, even while another thread
            # writes an entry (the speculative steps run on the scheduler thread).
            entries = {k: v for k, v in dict(group).items() if k != "params"}
            # Counters read before the copies: unmoved later, the copy holds the value.
            self.sources.append({k: (v, tensor_versions(v)) for k, v in entries.items()
                                 if not isinstance(v, IMMUTABLE)})
            # copy_value: a tensor inside a tuple (Adam's betas) filled in place by a
            # momentum schedule must not change the record too.
            self.groups.append({k: copy_value(v) for k, v in entries.items()})
        self.groups.append(process_wide)
        self.sources.append({})

    def same_as(self, other: "Hyperparameters") -> bool:
        """False when any group or entry differs."""
        if len(self.groups) != len(other.groups):
            return False
        for x, y, x_sources, y_sources in zip(self.groups, other.groups,
                                              self.sources, other.sources):
            if x.keys() != y.keys():
                return False
            for key, u in x.items():
                if key in x_sources and key in y_sources:
                    (x_source, x_versions), (y_source, y_versions) = x_sources[key], y_sources[key]
                    if x_source is y_source and x_versions is not None \
                            and x_versions == y_versions:
                        continue  # the same object, unwritten between the two records
                if not same_value(u, y[key]):
                    return False
        return True


def hyperparameters(param_groups: Sequence[dict], *, cpu_arithmetic: bool) -> Hyperparameters:
    """What a step on this thread would run with now (Hyperparameters)."""
    return Hyperparameters(param_groups, cpu_arithmetic=cpu_arithmetic)


def same_hyperparameters(a: Optional[Hyperparameters], b: Optional[Hyperparameters]) -> bool:
    """False when either is unknown (None) or any group or entry differs."""
    return a is not None and b is not None and a.same_as(b)


class PackedCopies:
    """Bit-for-bit copies of tensors, packed: per device and dtype, the 1-D ones in
    one ``torch.cat`` and the 0-dim ones (step counts) in one ``torch.stack``; any
    other is cloned apiece. A speculative step copies every optimizer-state tensor
    of its bucket's pieces (three per piece for Adam) and nearly always keeps the
    copies unread: one clone each cost an allocation and a copy (a kernel launch on
    a GPU) apiece. ``unpacked()``, for an undo, gives views in the tensors' order."""

    @torch.no_grad()
    def __init__(self, tensors: Sequence[torch.Tensor]):
        self._count = len(tensors)
        groups: dict[tuple, list[int]] = {}
        self._loose: dict[int, torch.Tensor] = {}
        for i, t in enumerate(tensors):
            # Plain tensors only: torch.cat would make plain ones a subclass's type.
            if t.dim() <= 1 and t.layout == torch.strided and type(t) is torch.Tensor:
                groups.setdefault((t.device, t.dtype, t.dim()), []).append(i)
            else:
                self._loose[i] = t.clone()
        self._packed = []  # (indices, packed tensor, sizes: None for 0-dim ones)
        for (_, _, dim), indices in groups.items():
            members = [tensors[i] for i in indices]
            if dim == 1:
                self._packed.append((indices, torch.cat(members), [t.numel() for t in members]))
            else:
                self._packed.append((indices, torch.stack(members), None))

    def unpacked(self) -> list[torch.Tensor]:
        copies: list[Optional[torch.Tensor]] = [None] * self._count
        for i, t in self._loose.items():
            copies[i] = t
        for indices, packed, sizes in self._packed:
            for i, view in zip(indices, packed.unbind() if sizes is None else packed.split(sizes)):
                copies[i] = view
        return copies


_PACKED = object()  # a SliceBackup entry whose tensor is copied in its PackedCopies


class SliceBackup:
    def __init__(self, param_shard: torch.Tensor, grad_shard: torch.Tensor,
                 pieces: Sequence[torch.Tensor], state: dict[Any, dict],
                 master: Optional[torch.Tensor] = None):
        # What the speculative step ran with; None if they changed while it ran.
        self.hyperparameters: Optional[Hyperparameters] = None
        self.param_shard = param_shard.clone()
        # The slice's float32 master weights, where the pieces are views of them
        # (see [Note: master weights] in slice_pieces.py).
        self.master = master.clone() if master is not None else None
        # The gradient the speculative step reads, a copy: an optimizer may write
        # its gradient in place (torch's foreach SGD with nesterov adds momentum *
        # buf into it), and the reduced gradient must stay as it is for the clip,
        # a redone step and a later accumulation. See keep_written_gradient.
        self.grad = grad_shard.clone()
        self._grad_version = self.grad._version
        self.had_state = {id(p): p in state for p in pieces}
        # Per piece with state, its entries in their order, a tensor's as _PACKED:
        # its copy is the next one in self._tensors.
        self._entries = {id(p): {k: (_PACKED if isinstance(v, torch.Tensor) else v)
                                 for k, v in state[p].items()}
                         for p in pieces if p in state}
        self._tensors = PackedCopies([v for p in pieces if p in state
                                      for v in state[p].values() if isinstance(v, torch.Tensor)])

    def reset_gradient(self, grad_shard: torch.Tensor) -> None:
        """Before a step is run again (after restore): its gradient as reduced."""
        self.grad.copy_(grad_shard)
        self._grad_version = self.grad._version

    def keep_written_gradient(self, grad_shard: torch.Tensor) -> None:
        """A committed step: what it wrote into its gradient is what torch's step
        leaves in ``param.grad``."""
        if self.grad._version != self._grad_version:
            grad_shard.copy_(self.grad)

    def restore(self, param_shard: torch.Tensor, pieces: Sequence[torch.Tensor],
                state: dict[Any, dict], master: Optional[torch.Tensor] = None) -> None:
        param_shard.copy_(self.param_shard)
        if master is not None:
            master.copy_(self.master)
        copies = iter(self._tensors.unpacked())
        # Copied back in one call per device and dtype: _foreach_copy_ copies a mixed
        # list tensor by tensor (Adam's CPU step counts beside CUDA moments).
        pairs: dict[tuple, tuple[list, list]] = {}
        for p in pieces:
            if not self.had_state[id(p)]:
                state.pop(p, None)  # the speculative step created it
                continue
            saved = self._entries[id(p)]
            current = state[p]
            for k, v in saved.items():
                if v is _PACKED:
                    v = next(copies)
                    target = current.get(k)
                    if isinstance(target, torch.Tensor):
                        targets, sources = pairs.setdefault(
                            (target.device, target.dtype, v.device, v.dtype), ([], []))
                        targets.append(target)
                        sources.append(v)
                        continue
                    v = v.clone()  # not a view that keeps every copy alive
                current[k] = v
            for k in [k for k in current if k not in saved]:
                del current[k]
        for targets, sources in pairs.values():
            torch._foreach_copy_(targets, sources)
