"""The all-gathers of updated parameters: which are in flight, which wait to start.

A step queues its updated buckets in forward order. Under ``serial`` and
``overlap_backward`` the step waits for all of them at its end; under
``next_forward`` and ``two_stage`` the next forward's pre-hooks wait for each
bucket just before its first use, and at most ``lookahead`` all-gathers run ahead
of forward (the plan's). The stage-1 all-gathers of ``two_stage`` start from the
scheduler thread while the main thread may finish others: the in-flight table
is guarded by a lock. The queue's order is the same on every rank, so the
all-gathers are issued in the same order everywhere; only how early depends on
timing.
"""
from __future__ import annotations

import threading
from typing import Optional, Sequence

from .held_param_reads import ParamsInFlight
from .link_worker import PendingOp


class _Pending:
    """Buckets in flight or queued (a container for ParamsInFlight.landed)."""

    def __init__(self, in_flight: dict, queued: list):
        self._in_flight, self._queued = in_flight, queued

    def __contains__(self, bucket: int) -> bool:
        return bucket in self._in_flight or bucket in self._queued


class ParamGathers:
    def __init__(self, exchange, buckets: Sequence, timeline, param_versions,
                 schedule: str, overlaps_forward: bool):
        self._exchange = exchange
        self._buckets = buckets
        self._timeline = timeline
        self._param_versions = param_versions
        self._schedule = schedule
        # next_forward / two_stage: a queued all-gather starts as soon as the
        # lookahead allows; otherwise at the end of the step.
        self._overlaps_forward = overlaps_forward
        self._in_flight: dict[int, PendingOp] = {}
        # CUDA: landed by a wait off the loop, whose stream need not be the
        # forward's; the loop's next wait for the bucket orders its own stream too
        # (see finish).
        self._owed: dict[int, PendingOp] = {}
        # Started from the queue and not yet waited for by the training loop (see
        # [Note: the lookahead counts what the loop has not waited for]).
        self._ahead: set[int] = set()
        self._lock = threading.Lock()
        # Queued all-gathers start in queue order, one thread at a time: a read of
        # the parameters on another thread may start them too, and two threads
        # popping and submitting at once could submit them in another order on
        # each rank.
        self._starting = threading.RLock()
        # Not started yet, in the order they will be.
        self._queued: list[int] = []
        self.lookahead: Optional[int] = None  # None: no limit
        # Told as a bucket becomes pending (queued or started) and as it lands, under
        # the lock (held_param_reads.py: the parameters' class while pending).
        self.params_in_flight: Optional[ParamsInFlight] = None
        self._pending = _Pending(self._in_flight, self._queued)

    @property
    def queued(self) -> bool:
        return bool(self._queued)

    @property
    def in_flight(self) -> bool:
        return bool(self._in_flight)

    @property
    def in_flight_table(self) -> dict:
        """The table of all-gathers in flight itself (the same object for this
        object's life): a cheap truth test for the parameter reads of a forward."""
        return self._in_flight

    def start(self, bucket: int, *, from_the_queue: bool = False) -> None:
        """Send this rank's updated slice of ``bucket``; receive everyone else's.
        ``from_the_queue``: a stage-2 all-gather, counted by the lookahead (stage 1's
        and the re-sends of undone slices are not: they are no queue's)."""
        storage = self._buckets[bucket]
        with self._lock:
            previous = self._in_flight.pop(bucket, None)
            owed = self._owed.pop(bucket, None)
            if self.params_in_flight is not None and not from_the_queue:
                # Before the all-gather may write: a read from now on lands it.
                # (A queued one was told so when queued, and stays pending since.)
                self.params_in_flight.pending(bucket)
        for earlier in (previous, owed):
            if earlier is not None:
                earlier.wait()
        op = self._exchange.start_all_gather(storage.flat_param, storage.param_shard,
                                             label=f"b{bucket}")
        with self._lock:
            self._in_flight[bucket] = op
            if from_the_queue:
                self._ahead.add(bucket)

    def queue(self, bucket: int) -> None:
        """Queue ``bucket`` behind the step's earlier ones; under the
        forward-overlapped schedules start it now if the lookahead allows."""
        with self._lock:
            self._queued.append(bucket)
            if self.params_in_flight is not None:
                self.params_in_flight.pending(bucket)
        if self._overlaps_forward:
            self.start_queued()

    def start_queued(self, until: Optional[int] = None, all_of_them: bool = False) -> None:
        """Start queued all-gathers in queue order: up to the lookahead, and through ``until``."""
        queue = self._queued
        with self._starting:
            while queue:
                if not (all_of_them or until in queue) and self._lookahead_reached():
                    return
                self.start(queue.pop(0), from_the_queue=True)

    # [Note: the lookahead counts what the loop has not waited for]
    # A queued all-gather starts while fewer than ``lookahead`` ones started from
    # the queue (stage 2's; not stage 1's, which run in backward, a review found
    # they held every stage-2 start back to its forward's wait) have not been
    # waited for by the training loop (a forward's pre-hook, the step,
    # synchronize()). Not "have not landed": that depends on each rank's timing,
    # so one rank could start a bucket that another still held back, and a read
    # of the parameters on the first alone (a logged weight norm on rank 0, which
    # waits for what this rank started) then waited for an all-gather its peer
    # would start only at its next forward, while the peer waited in a collective
    # of the loop's after the read (a barrier): a deadlock, found by fuzzing the
    # timing. Counted so, every rank starts the same buckets at the same points of
    # its loop, and a read waits only for what every rank has started. Waits that
    # may run on one rank alone (reads, model.module(x)) do not count as the loop's.

    def _lookahead_reached(self) -> bool:
        """``lookahead`` started all-gathers or more wait for the loop. No count at all
        under a lookahead of every bucket (the plans' default), which limits nothing
        (at most one per bucket is in flight, and start() waits for a bucket's own)."""
        limit = self.lookahead
        if limit is None or limit >= len(self._buckets):
            return False
        with self._lock:
            return len(self._ahead) >= limit

    def finish(self, bucket: int, timer=None, *, by_the_loop: bool = True) -> None:
        """Wait for ``bucket``'s all-gather. ``timer``: the plan profiler, when the
        training loop waits here (see [Note: stage 1 only where the forward waits]
        in plan.py); told of a wait for one that has not landed. ``by_the_loop``:
        False for a wait that may run on one rank alone, which starts nothing and
        frees no place in the lookahead (see the note above)."""
        pending = bucket in self._queued
        if pending and by_the_loop:
            self.start_queued(until=bucket)
        with self._lock:
            op = self._in_flight.get(bucket)
            owed = self._owed.pop(bucket, None) if by_the_loop else None
        if owed is not None:
            owed.wait()  # a stream wait: it has landed
        if op is not None:
            pending = True
            if op.done():
                op.wait()
            else:
                need = timer.mark_gather_needed() if timer is not None else None
                with self._timeline.span("compute", f"wait AG b{bucket}"):
                    op.wait()
                if need is not None:
                    timer.on_gather_waited(bucket, need)
            # Taken out of the table only once landed: a read of the parameters on
            # another thread (a logger's, or one through model.module) may be
            # landing it at the same time, and the forward must not take a bucket
            # that is gone from the table for one that has landed. On CUDA a wait
            # orders only the waiting thread's current stream: one off the loop (a
            # read under an EMA's side stream, a checkpoint thread's) leaves the op
            # owed to the loop, whose next wait orders its own stream after it (a
            # stream wait; the bucket counts as landed for everything else).
            with self._lock:
                if self._in_flight.get(bucket) is op:
                    del self._in_flight[bucket]
                    if not by_the_loop and op.waits_per_stream:
                        self._owed[bucket] = op
                    if self.params_in_flight is not None:
                        self.params_in_flight.landed(bucket, self._pending)
        if by_the_loop:
            with self._lock:
                self._ahead.discard(bucket)
        if pending:
            # Written by the loop while the gather landed (a clamp right after
            # opt.step()): the gathered slices overwrote part of it, by timing.
            name = self._param_versions.written_since_change(bucket)
            if name is not None:
                raise RuntimeError(
                    f"fgpsdp: parameter {name!r} was changed in place after opt.step() while "
                    f"its updated values were still being all-gathered ({self._schedule} "
                    "finishes them during the next forward): call model.synchronize() "
                    "first, on every rank")
        if self._queued and by_the_loop:
            self.start_queued()

    def not_landed(self) -> list[int]:
        """Buckets whose updated values have not reached the parameters, and will
        not without this object: queued and never started, or in flight and failed
        or unfinished. (Asked as the wrapper is freed, its link threads stopped.)"""
        with self._lock:
            in_flight = dict(self._in_flight)
            queued = list(self._queued)
        failed = [b for b, op in in_flight.items()
                  if not op.done() or (op.future is not None and op.future.exception() is not None)]
        return sorted(set(queued) | set(failed))

    def finish_all(self, timer=None, *, by_the_loop: bool = True) -> None:
        if by_the_loop:
            self.start_queued(all_of_them=True)
        with self._lock:
            # (Those a one-rank wait landed are still ahead of the loop, or owed to it.)
            buckets = sorted(set(self._in_flight) | (self._ahead | set(self._owed)
                                                     if by_the_loop else set()))
        # Ascending: the last in forward order first, which was queued last and
        # lands last; a timed wait for all of them is counted there.
        for bucket in buckets:
            self.finish(bucket, timer, by_the_loop=by_the_loop)
