"""Per-thread torch settings that the scheduler thread takes over from the training loop.

A speculative step runs the user's optimizer on the scheduler thread, where torch DDP
runs it on the loop's own thread at ``opt.step()``. These settings are per thread and
change what the optimizer computes or creates there, or how:

- the CPU's flush-to-zero mode (``torch.set_flush_denormal``), a thread's own
  floating-point state: a thread copies its creator's when it starts and never again,
  so flushing turned on after the first step left subnormal values in the speculated
  slices' optimizer state that torch DDP's step flushed;
- torch's default device (``torch.set_default_device``, a per-thread mode): the step
  counts that NAdam, RMSprop, Adagrad and others create without a device would land
  elsewhere than torch DDP's;
- the intra-op thread count (``torch.set_num_threads`` sets the calling thread's; a
  new thread starts with the process default, all cores): a loop that keeps each rank
  to a few threads would have its speculative steps run on all of them, beside the
  other ranks'. (The results do not depend on it: torch's optimizers work element by
  element, and our norm kernel sums in an order fixed by the input alone.)

The loop's thread records them at each forward (``ThreadSettings.of_this_thread``);
the scheduler thread adopts them before each speculative step (``adopt``). Torch's
default dtype is process-wide instead, but read when state is created: the
speculative step's record keeps it (speculation.hyperparameters).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


# Names, not literals: the compiler would fold a product of two literals.
_NORMAL, _SCALE = 1e-300, 1e-10


def _flushes_denormals() -> bool:
    """Whether this thread's CPU arithmetic flushes subnormal results to zero.

    Python's float arithmetic runs on the same floating-point unit and mode as
    torch's CPU kernels, so a product that is subnormal (1e-310) tells, without
    a tensor op (none for a torch function or dispatch mode of the loop to see).
    """
    return _NORMAL * _SCALE == 0.0


def _default_device() -> Optional[torch.device]:
    get = getattr(torch, "get_default_device", None)  # torch >= 2.3
    return get() if get is not None else None


@dataclass(frozen=True)
class ThreadSettings:
    # None: not probed (no parameter on the CPU: a GPU's arithmetic ignores it).
    flush_denormal: Optional[bool]
    default_device: Optional[torch.device]
    num_threads: int

    @classmethod
    def of_this_thread(cls, probe_flush_denormal: bool) -> "ThreadSettings":
        return cls(_flushes_denormals() if probe_flush_denormal else None, _default_device(),
                   torch.get_num_threads())

    def adopt(self) -> None:
        """Make this thread's settings these (each only where it differs; a caller
        that knows what it adopted last calls this only for a change)."""
        if self.flush_denormal is not None and _flushes_denormals() != self.flush_denormal:
            torch.set_flush_denormal(self.flush_denormal)
        if self.default_device is not None and _default_device() != self.default_device:
            torch.set_default_device(self.default_device)
        if torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)
