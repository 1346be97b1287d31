"""Stop the runtime's threads before the interpreter finalizes.

[Note: why daemon threads are joined at exit]
The link workers and the scheduler are daemon threads, so that they never
keep a process alive. But CPython before 3.14 ends a daemon thread that takes
the GIL back during finalization with ``pthread_exit``; if the thread is just
returning from a C++ call (a gloo collective, a torch op) the forced stack
unwinding runs through C++ code that may not be unwound, and the process
aborts with "terminate called without an active exception" after training
has finished. That abort was seen at teardown in benchmark runs (7 of 20
``serial`` / ``overlap_backward`` runs in one report, whose wrappers are freed
as soon as the driver drops them, with worker threads still ending while
``destroy_process_group()`` ran); it stopped once the threads were joined
(docs/benchmarks/2026-11-30-emulated-2x2-teardown.md). The mechanism above is
the likely one, not a proven one.

So every runtime thread registers here, and at exit (``atexit`` runs before
finalization) each is asked to stop and is waited for, for at most
``EXIT_JOIN_TIMEOUT_S`` in all: a thread stuck in a collective whose peer is
gone delays the exit by that much and is then left to the interpreter, as
before. A ``DistributedDataParallel`` that is garbage-collected earlier stops
and joins its threads the same way, so that ``del model`` followed by
``destroy_process_group()`` never races a worker thread that is still ending.
"""
from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Optional, Protocol

EXIT_JOIN_TIMEOUT_S = 5.0


class StoppableThread(Protocol):
    def request_stop(self) -> None:
        """Ask the thread to finish its current task and end (non-blocking)."""

    def join(self, timeout: Optional[float]) -> None:
        ...


_live: "weakref.WeakSet[StoppableThread]" = weakref.WeakSet()
_lock = threading.Lock()


def register(owner: StoppableThread) -> None:
    with _lock:
        _live.add(owner)


def stop_and_join(owners, timeout_s: float = EXIT_JOIN_TIMEOUT_S) -> None:
    """Ask each thread to stop, then wait up to ``timeout_s`` in all.

    A thread never waits for itself (the garbage collector may run a
    finalizer that closes an exchange on one of its own worker threads).
    """
    owners = list(owners)
    for owner in owners:
        owner.request_stop()
    deadline = time.monotonic() + timeout_s
    for owner in owners:
        owner.join(max(0.0, deadline - time.monotonic()))


def stop_all(timeout_s: float = EXIT_JOIN_TIMEOUT_S) -> None:
    """Every registered thread (at exit)."""
    with _lock:
        owners = list(_live)
    stop_and_join(owners, timeout_s)


atexit.register(stop_all)
