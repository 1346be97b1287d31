"""Per-thread torch settings that the scheduler thread takes over from the training loop.

A speculative step runs the user's optimizer on the scheduler thread, where torch DDP
runs it on the loop's own thread at ``opt.step()``. These settings are per thread and
change what the optimizer computes there, or how:

- the CPU's flush-to-zero mode (``torch.set_flush_denormal``), a thread's own
  floating-point state: a thread copies its creator's when it starts and never again,
  so flushing turned on after the first step left subnormal values in the speculated
  slices' optimizer state that torch DDP's step flushed;
- the intra-op thread count (``torch.set_num_threads`` sets the calling thread's, and
  the count threads started later begin with): a count the loop changes after the
  scheduler thread started does not reach it. (The results do not depend on it:
  torch's optimizers work element by element, and our norm kernel sums in an order
  fixed by the input alone.)

The loop's thread records them at each forward (``ThreadSettings.of_this_thread``);
the scheduler thread adopts a change before its next speculative step (``adopt``).
A flush mode set between that forward and the step reaches the scheduler thread
only at the next forward: the speculative step's record keeps the mode it ran with,
and the step redoes it (speculation.hyperparameters). Torch's default dtype is
process-wide instead, but read when state is created: the record keeps it too.

Not adopted: torch's default device (``torch.set_default_device``, per thread). Setting
it on the scheduler thread also sets a process-wide value that torch.compile's guards
read (every compiled frame would compile again), and leaves a torch function mode on
every op of the speculative steps. Under a default device the optimizers that create
their step counts without a device (NAdam, RMSprop, Adagrad, ...) create a speculated
slice's on the CPU, where torch DDP's are on the default device (docs/semantics.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

# Names, not literals: the compiler would fold a product of two literals.
_NORMAL, _SCALE = 1e-300, 1e-10


def flushes_denormals() -> bool:
    """Whether this thread's CPU arithmetic flushes subnormal results to zero.

    Python's float arithmetic runs on the same floating-point unit and mode as
    torch's CPU kernels, so a product that is subnormal (1e-310) tells, without
    a tensor op (none for a torch function or dispatch mode of the loop to see).
    """
    return _NORMAL * _SCALE == 0.0


@dataclass(frozen=True)
class ThreadSettings:
    # None: not probed (no parameter on the CPU: a GPU's arithmetic ignores it).
    flush_denormal: Optional[bool]
    num_threads: int

    @classmethod
    def of_this_thread(cls, probe_flush_denormal: bool) -> "ThreadSettings":
        return cls(flushes_denormals() if probe_flush_denormal else None,
                   torch.get_num_threads())

    def adopt(self) -> None:
        """Make this thread's settings these (each only where it differs; a caller
        that knows what it adopted last calls this only for a change)."""
        if self.flush_denormal is not None and flushes_denormals() != self.flush_denormal:
            torch.set_flush_denormal(self.flush_denormal)
        if torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)
