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
before. Except a shared-memory barrier: it polls (see [Note: a failed barrier]
in shared_memory.py), so a worker left in one takes the GIL back (gloo's
barrier every 100 ms, the counts barrier when its wait ends) and would abort
the process (seen every time a rank raised after backward while a peer ran
more than the timeout behind, with gloo's barrier). Its waits are cut short
(``abort_waits``): the barrier fails, as a dying rank's does, which its peers
see, and the threads get ``EXIT_ABORT_JOIN_TIMEOUT_S`` more. A worker blocked
in a gloo wait (the inter-node exchange) cannot be cut short and is left to
the interpreter as above.

A ``DistributedDataParallel`` that is garbage-collected earlier stops
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
# After EXIT_JOIN_TIMEOUT_S, the waits that can be cut short (the shared-memory
# barriers, which poll) are, and the threads get this much more to end.
EXIT_ABORT_JOIN_TIMEOUT_S = 1.0


class StoppableThread(Protocol):
    def request_stop(self) -> None:
        """Ask the thread to finish its current task and end (non-blocking)."""

    def join(self, timeout: Optional[float]) -> None:
        ...


_live: "weakref.WeakSet[StoppableThread]" = weakref.WeakSet()
_abortable: weakref.WeakSet = weakref.WeakSet()  # objects with abort_waits()
_lock = threading.Lock()


def register(owner: StoppableThread) -> None:
    with _lock:
        _live.add(owner)


def register_abortable(transport) -> None:
    """``transport.abort_waits()`` is called at exit if the threads did not end in
    time: its waits raise instead of going on (a shared-memory barrier polls, so
    a worker left in one would take the GIL back during finalization and abort
    the process with "terminate called without an active exception")."""
    with _lock:
        _abortable.add(transport)


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


def stop_all(timeout_s: float = EXIT_JOIN_TIMEOUT_S,
             abort_timeout_s: float = EXIT_ABORT_JOIN_TIMEOUT_S) -> None:
    """Every registered thread (at exit). Those still in a wait that can be cut
    short after ``timeout_s`` are, and waited for ``abort_timeout_s`` more."""
    with _lock:
        owners = list(_live)
    stop_and_join(owners, timeout_s)
    if not any(_alive(owner) for owner in owners):
        return
    with _lock:
        transports = list(_abortable)
    if not transports:
        return
    for transport in transports:
        transport.abort_waits()
    deadline = time.monotonic() + abort_timeout_s
    for owner in owners:
        owner.join(max(0.0, deadline - time.monotonic()))


def _alive(owner) -> bool:
    is_alive = getattr(owner, "is_alive", None)
    return True if is_alive is None else is_alive()


atexit.register(stop_all)
