"""A warning when a collective the user calls waits long for the other ranks.

``opt.full_state_dict()`` is a collective. Called on rank 0 alone, as a save
often is (``if rank == 0: torch.save(opt.full_state_dict(), path)``), it waits
for the other ranks until the process-group timeout (30 minutes for gloo by
default), and then fails with a message about a timed-out collective that names
neither the call nor the cause. So, if the call has not returned after
``FGPSDP_COLLECTIVE_WARN_S`` seconds (default 60), a warning says what it waits
for. It does not end the wait: a rank may be legitimately late (evaluating,
saving elsewhere), and the other ranks may still arrive.
"""
from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Iterator


def warn_after_s() -> float:
    value = float(os.environ.get("FGPSDP_COLLECTIVE_WARN_S", "60"))
    if value <= 0:
        raise ValueError(f"FGPSDP_COLLECTIVE_WARN_S must be > 0, got {value}")
    return value


@contextlib.contextmanager
def warn_if_the_others_are_late(call: str, world_size: int, hint: str = "") -> Iterator[None]:
    """Around a collective named ``call`` (as the user wrote it): warn once from a
    timer thread if it has not finished after ``warn_after_s()``; ``hint`` ends
    the warning."""
    if world_size <= 1:
        yield
        return
    after_s = warn_after_s()

    def warn() -> None:
        warnings.warn(
            f"fgpsdp: {call} has waited {after_s:g} s for the other ranks. It is a "
            "collective: every rank must call it; called on one rank alone (a save on "
            f"rank 0, say) it waits until the process-group timeout and then fails.{hint}",
            RuntimeWarning, stacklevel=1)
    timer = threading.Timer(after_s, warn)
    timer.daemon = True
    timer.name = "fgpsdp-collective-watch"
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
