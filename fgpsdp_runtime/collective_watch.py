"""A warning when a collective the user calls waits long for the other ranks.

``opt.full_state_dict()`` is a collective. Called on rank 0 alone, as a save
often is (``if rank == 0: torch.save(opt.full_state_dict(), path)``), it waits
for the other ranks until the process-group timeout (30 minutes for gloo by
default), and then fails with a message about a timed-out collective that names
neither the call nor the cause. So, if the call has not returned after
``FGPSDP_COLLECTIVE_WARN_S`` seconds (default 60; ``inf`` turns it off), a
warning says what it waits for, at the caller's line, every time. It does not
end the wait: a rank may be legitimately late (evaluating, saving elsewhere),
and the other ranks may still arrive.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
import warnings
from typing import Iterator, Optional

_DEFAULT_S = 60.0
_LONGEST_TIMER_S = 1e7  # threading.Timer's wait overflows time_t further out


def warn_after_s() -> Optional[float]:
    """The setting in seconds, None for off. A diagnostic must not break the call
    it watches: a value that is not a positive number of seconds is named in a
    warning and the default used."""
    raw = os.environ.get("FGPSDP_COLLECTIVE_WARN_S")
    if raw is None:
        return _DEFAULT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if value > _LONGEST_TIMER_S:  # inf included: off
        return None
    if not value > 0:  # nan included
        warnings.warn(f"fgpsdp: FGPSDP_COLLECTIVE_WARN_S={raw!r} is not a positive number "
                      f"of seconds (or inf for off); using {_DEFAULT_S:g}", RuntimeWarning)
        return _DEFAULT_S
    return value


@contextlib.contextmanager
def warn_if_the_others_are_late(call: str, world_size: int, caller: tuple[str, int],
                                hint: str = "") -> Iterator[None]:
    """Around a collective named ``call`` (as the user wrote it), called from
    ``caller`` (file, line): warn from a timer thread if it has not finished after
    ``warn_after_s()``; ``hint`` ends the warning."""
    after_s = warn_after_s() if world_size > 1 else None
    if after_s is None:
        yield
        return

    def warn() -> None:
        # Explicit, at the caller's line, with no registry: every late call says
        # so (a warning from this thread would name this file, and show once).
        warnings.warn_explicit(
            f"fgpsdp: {call} has waited {after_s:g} s for the other ranks. It is a "
            "collective: every rank must call it; called on one rank alone (a save on "
            f"rank 0, say) it waits until the process-group timeout and then fails.{hint}",
            RuntimeWarning, caller[0], caller[1])
    timer = threading.Timer(after_s, warn)
    timer.daemon = True
    timer.name = "fgpsdp-collective-watch"
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
