"""The threads that run one link's collectives in order, and the handle of a submitted one.

[Note: one thread per link class and phase]
Each link class (``flat``, or ``intra`` and ``inter``) has, per phase
(reduce-scatter, all-gather), a process group of its own and a worker thread
that issues every collective of that group, one after another, in the order
they were submitted (a point-to-point call is issued before the previous one
has landed: see ``calls_in_flight``). Collectives on one group thus have
the same order on every rank, while links and phases work at the same time:
bucket b's inter-node phase runs while bucket b+1's intra-node phase does, and an early
all-gather (two-stage schedule) runs beside later reduce-scatters. Reduce-
scatters are submitted in bucket order and all-gathers in plan order on every
rank; how the two interleave depends on timing, which is why they never share
a group. The second phase of a bucket waits, inside its worker, for the
first; both are submitted together, so every wait points at a task submitted
earlier and the workers cannot deadlock. The collectives the wrapper issues
itself (broadcasts, the norm all-reduce) use the wrapper's own group.

Timeline of two buckets under the hierarchy (reduce-scatter)::

    intra worker : [RS_intra b0][RS_intra b1]
    inter worker :              [RS_inter b0][RS_inter b1]
    main thread  : backward ... submit b0 ... submit b1 ... wait b0, b1 (step)
"""
from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional

import torch

from . import shutdown


class PendingOp:
    """A submitted bucket operation and what must happen once it has landed."""

    def __init__(self, future: Optional[Future], done_event=None,
                 on_done: Optional[Callable[[], None]] = None,
                 device: Optional[torch.device] = None):
        self.future = future
        # CUDA: the GPU whose streams wait, named (the waiting thread's current
        # device may be another one).
        self.device = device
        # CUDA: recorded on the link's stream right after the collective, before
        # the future resolves; a second phase waits on it (it is never replaced).
        self.done_event = done_event
        self._done_event = done_event  # what a waiting stream waits on
        self.on_done = on_done
        self._finished = False
        # The main thread and the scheduler thread may both wait for one
        # reduce-scatter: on_done must run once, and before either returns.
        self._lock = threading.Lock()

    @property
    def waits_per_stream(self) -> bool:
        """CUDA: a wait orders only the waiting thread's current stream after the
        work; another stream must wait too. (On the CPU a wait is the host's.)"""
        return self._done_event is not None

    def done(self) -> bool:
        """True once the work has landed (waiting would not block)."""
        if self._finished or self.future is None:
            return True
        if not self.future.done():
            return False
        return self._done_event is None or self._done_event.query()

    def wait(self) -> None:
        """Block until landed; on CUDA, order the caller's current stream after it."""
        with self._lock:
            if not self._finished:
                if self.future is not None:
                    self.future.result()  # re-raises what failed in the worker
                if self._done_event is not None:
                    torch.cuda.current_stream(self.device).wait_event(self._done_event)
                if self.on_done is not None:
                    self.on_done()
                    if self._done_event is not None:
                        # on_done's kernels went to this stream: later waiters follow them.
                        self._done_event = torch.cuda.Event()
                        self._done_event.record(torch.cuda.current_stream(self.device))
                self._finished = True
                return
        if self._done_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._done_event)


def calls_in_flight() -> int:
    """How many calls a link worker may have posted and not yet finished.

    [Note: calls in flight]
    A bucket-sized call on one rail leaves the link idle while its last piece
    lands and the next call is posted (about 6 ms per call on the emulated
    1 Gbit/s link: 0.67 Gbit/s for 2 MiB calls against 0.85 for 12.5 MiB,
    docs/benchmarks/2026-11-30-rail-collectives-cpu.md). So a worker posts a
    call's messages, hands the wait to its completion thread and posts the
    next one. Only point-to-point calls on gloo can be split so; the others
    (shared memory, NCCL, gloo's collectives) run whole on the worker.
    ``FGPSDP_CALLS_IN_FLIGHT=1`` runs one call at a time.
    """
    value = int(os.environ.get("FGPSDP_CALLS_IN_FLIGHT", "2"))
    if value < 1:
        raise ValueError(f"FGPSDP_CALLS_IN_FLIGHT must be >= 1, got {value}")
    return value


class LinkWorker:
    """Daemon thread(s) that run one link's collectives in submission order.

    A task may return a function that finishes it (waits for the messages it
    posted): with more than one call in flight, a second thread runs those in
    the same order and resolves each task's future, while the worker goes on
    posting. A task that returns nothing is resolved by the worker itself when no
    earlier one is with that thread (one thread wake-up less per collective).
    Futures are resolved in submission order either way.
    """

    def __init__(self, name: str, device: torch.device, in_flight: Optional[int] = None):
        self.name = name
        self.device = device
        # CUDA: the link's own stream, so that its collectives overlap compute
        # and the other link's collectives.
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.in_flight = calls_in_flight() if in_flight is None else in_flight
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        # Once closed, a submitted call would never run and its waiter would wait
        # forever: submit() raises instead (under the lock, so that no call goes
        # into the queue behind the worker's last item).
        self._closed = False
        self._closing_lock = threading.Lock()
        self._finishes: Optional["queue.SimpleQueue"] = None
        self._slots: Optional[threading.Semaphore] = None
        self._finisher: Optional[threading.Thread] = None
        # Calls handed to the finishing thread and not yet resolved; read by the
        # worker (a call that finished whole is resolved on the worker only when
        # none is, so futures still resolve in submission order).
        self._finishing = 0
        self._finishing_lock = threading.Lock()
        if self.in_flight > 1:
            self._finishes = queue.SimpleQueue()
            self._slots = threading.Semaphore(self.in_flight)
            self._finisher = threading.Thread(target=self._finish_in_order,
                                              name=f"fgpsdp-{name}-wait", daemon=True)
            self._finisher.start()
        self._thread = threading.Thread(target=self._run, name=f"fgpsdp-{name}", daemon=True)
        self._thread.start()
        shutdown.register(self)  # stopped and joined at exit: see shutdown.py

    def submit(self, fn: Callable[[], Optional[Callable[[], None]]], ready_event=None) -> Future:
        future: Future = Future()
        with self._closing_lock:
            if self._closed:
                raise RuntimeError(
                    f"fgpsdp: the {self.name} link worker is closed (its wrapper was released, "
                    "its process group destroyed, or the process is exiting): no collective "
                    "can be sent on it")
            self._queue.put((fn, future, ready_event))
        return future

    def _run(self) -> None:
        if self.stream is not None:
            # A new thread's current device is cuda:0: leaving `torch.cuda.stream`
            # would make it current, and CUDA would create a context there (GPU 0's
            # memory, on every rank of the node).
            torch.cuda.set_device(self.device)
        while True:
            item = self._queue.get()
            if item is None:
                if self._finishes is not None:
                    self._finishes.put(None)
                return
            fn, future, ready_event = item
            if not future.set_running_or_notify_cancel():
                continue
            if self._slots is not None:
                self._slots.acquire()  # released once the call has finished
            try:
                if self.stream is not None:
                    with torch.cuda.stream(self.stream):
                        if ready_event is not None:
                            self.stream.wait_event(ready_event)
                        finish = fn()
                else:
                    finish = fn()
            except BaseException as error:  # handed to whoever waits on it
                finish, failure = None, error
            else:
                failure = None
            if self._finishes is not None:
                if finish is None and self._finishing == 0:
                    # Finished whole on this thread (shared memory, NCCL, gloo's
                    # collectives) with no earlier call still finishing: resolve it
                    # here, in order, without a hop to the finishing thread.
                    self._resolve(finish, failure, future)
                    self._slots.release()
                    continue
                with self._finishing_lock:
                    self._finishing += 1
                self._finishes.put((finish, failure, future))
                continue
            self._resolve(finish, failure, future)

    def _finish_in_order(self) -> None:
        while True:
            item = self._finishes.get()
            if item is None:
                return
            self._resolve(*item)
            with self._finishing_lock:
                self._finishing -= 1
            self._slots.release()

    @staticmethod
    def _resolve(finish, failure, future: Future) -> None:
        if failure is None and finish is not None:
            try:
                finish()
            except BaseException as error:
                failure = error
        if failure is not None:
            future.set_exception(failure)
        else:
            future.set_result(None)

    def close(self) -> None:
        """The threads end once the collectives submitted so far have run; later
        submissions raise."""
        with self._closing_lock:
            if not self._closed:
                self._closed = True
                self._queue.put(None)

    request_stop = close

    def is_alive(self) -> bool:
        return any(t is not None and t.is_alive() for t in (self._thread, self._finisher))

    def join(self, timeout: Optional[float] = None) -> None:
        threads = [t for t in (self._thread, self._finisher) if t is not None]
        if threading.current_thread() in threads:
            return  # each of the two waits for the other: never join from inside
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

