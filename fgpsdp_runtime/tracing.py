"""A per-step timeline of one rank: compute, scheduler and each link's collectives.

Off by default; a disabled timeline costs one attribute read per span. When
enabled (``model.timeline.enable()``), every span lands on a *lane*:
``compute`` (forward, backward, optimizer step and the waits inside them),
``scheduler`` (stage-1 speculative steps), and one lane per link worker
(``intra-rs``, ``inter-ag``, ``flat-rs``, ...). ``save_chrome_trace(path)``
writes Chrome trace JSON (chrome://tracing, Perfetto): one process per rank,
one thread row per lane.

A long run does not grow it without bound: it keeps the latest ``max_spans``
spans (100,000 by default, about 10,000 steps of a model of three buckets and some
17 MiB; settable, ``None`` for all), dropping the oldest, and ``dropped`` counts
them; ``clear()`` empties it.

Times are host clock readings (``time.perf_counter``). On CPU that is when the
work ran. On CUDA a collective's span would only cover its launch, so the
worker records CUDA events on its stream instead and the span is resolved
from them when the trace is read (``resolve`` synchronises the device once).
"""
from __future__ import annotations

import collections
import contextlib
import json
import threading
import time
from typing import Iterator, Optional

import torch

# Lanes in display order; unknown lanes follow, sorted.
LANE_ORDER = ("compute", "scheduler", "intra-rs", "inter-rs", "flat-rs",
              "inter-ag", "intra-ag", "flat-ag")


class Timeline:
    """Spans (lane, name, start, end) of one rank, recorded from any thread."""

    DEFAULT_MAX_SPANS = 100_000

    def __init__(self, rank: int = 0, max_spans: Optional[int] = DEFAULT_MAX_SPANS):
        self.rank = rank
        self.enabled = False
        self._lock = threading.Lock()
        self._max_spans = max_spans
        self._spans: collections.deque = collections.deque(maxlen=max_spans)
        # CUDA spans: (lane, name, start event, end event), resolved later
        # against _cuda_origin, an event recorded together with _host_origin.
        self._cuda_spans: collections.deque = collections.deque(maxlen=max_spans)
        self.dropped = 0  # spans dropped to stay within max_spans
        self._host_origin = time.perf_counter()
        self._cuda_origin = None
        self._cuda_origin_device = None
        self._wanted = False  # the user's say: enable() / disable()
        self._holders = 0  # the runtime's own readers (the plan profiler), see hold()
        # While held: where the spans recorded while the user did not want them
        # begin and end, [host, CUDA, host end, CUDA end] (ends None while open),
        # indices that hold still since nothing is dropped while held; release()
        # drops those spans.
        self._unwanted: list[list] = []

    def enable(self) -> None:
        with self._lock:
            self._wanted = True
            self._close_unwanted()
        self.enabled = True

    def disable(self) -> None:
        with self._lock:
            self._wanted = False
            if self._holders:
                self._open_unwanted()
        self.enabled = self._holders > 0

    def hold(self) -> None:
        """Record for the runtime's own use (the plan profiler's window), whatever
        the user says meanwhile; release() hands the timeline back. Every span is
        kept while held: the profile reads its whole window (with a small
        ``max_spans`` it would fit its link model to the last few spans)."""
        with self._lock:
            self._holders += 1
            if self._holders == 1:
                self._limit_to(None)
                if not self._wanted:
                    self._open_unwanted()
        self.enabled = True

    def release(self) -> None:
        """The last holder gone: as the user left it, with the spans recorded while
        the user wanted it (none, if it never did since the last ``clear()``); on if
        the user wants it, else off. Then ``max_spans`` holds again, dropping the
        oldest."""
        with self._lock:
            if not self._holders:  # (unbalanced: nothing to hand back)
                return
            self._holders -= 1
            if self._holders:
                return
            self._close_unwanted()
            self._drop_unwanted()
            self.enabled = self._wanted
            self._limit_to(self._max_spans)

    def _open_unwanted(self) -> None:
        # Under _lock.
        if not self._unwanted or self._unwanted[-1][2] is not None:
            self._unwanted.append([len(self._spans), len(self._cuda_spans), None, None])

    def _close_unwanted(self) -> None:
        # Under _lock.
        if self._unwanted and self._unwanted[-1][2] is None:
            self._unwanted[-1][2:] = [len(self._spans), len(self._cuda_spans)]

    def _drop_unwanted(self) -> None:
        # Under _lock, at the release: the deques are unbounded, the indices hold.
        for kind, name in enumerate(("_spans", "_cuda_spans")):
            ranges = [(r[kind], r[kind + 2]) for r in self._unwanted]
            if ranges:
                kept = [span for i, span in enumerate(getattr(self, name))
                        if not any(start <= i < end for start, end in ranges)]
                setattr(self, name, collections.deque(kept, maxlen=None))
        self._unwanted = []

    @property
    def max_spans(self) -> Optional[int]:
        return self._max_spans

    @max_spans.setter
    def max_spans(self, value: Optional[int]) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"max_spans must be a positive int or None, got {value!r}")
        with self._lock:
            self._max_spans = value
            if not self._holders:  # (held: at release)
                self._limit_to(value)

    def _limit_to(self, limit: Optional[int]) -> None:
        # Under _lock. While held only to lift the cap: the unwanted ranges' indices
        # must hold.
        for name in ("_spans", "_cuda_spans"):
            kept = getattr(self, name)
            self.dropped += max(0, len(kept) - (limit or len(kept)))
            setattr(self, name, collections.deque(kept, maxlen=limit))

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()
            self._cuda_spans.clear()
            self.dropped = 0
            self._unwanted = []
            if self._holders and not self._wanted:
                self._open_unwanted()

    # -- recording -----------------------------------------------------------

    def add(self, lane: str, name: str, start: float, end: float) -> None:
        """A span in perf_counter seconds."""
        with self._lock:
            if len(self._spans) == self._spans.maxlen:
                self.dropped += 1
            self._spans.append((lane, name, start, end))

    @contextlib.contextmanager
    def span(self, lane: str, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.enabled:  # disabled meanwhile (and maybe cleared): drop it
                self.add(lane, name, start, time.perf_counter())

    def start_cuda_clock(self, device, stream=None) -> None:
        """Pin CUDA event times to the host clock: an event recorded at a known host time.

        The host waits for that event, so call it where the host has just waited
        for the GPU anyway (the plan profiler does, at the end of a step), and only
        from the training thread (see cuda_span_events). Never under ``_lock``:
        a span added meanwhile (the end of backward adds one) would wait for the GPU.
        The event, not the device: a device synchronisation also waits for the
        link streams, where the all-gathers of the next forward are queued, and the
        plan profiler's first profiled forward then found them landed and timed
        its waits as none (on an H200 its measured waits were half the real ones).
        Without it, the first CUDA span's start event is the origin, tied to the
        host clock when the spans are read.
        """
        if self._cuda_origin is not None:
            return
        stream = stream if stream is not None else torch.cuda.current_stream(device)
        origin = torch.cuda.Event(enable_timing=True)
        origin.record(stream)
        origin.synchronize()
        host_origin = time.perf_counter()
        with self._lock:
            if self._cuda_origin is None:
                self._cuda_origin, self._host_origin = origin, host_origin
                self._cuda_origin_device = stream.device

    def cuda_span_events(self, stream) -> Optional[tuple]:
        """Start event recorded on ``stream``; pass it to ``end_cuda_span``."""
        if not self.enabled:
            return None
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        if self._cuda_origin is None:
            # No device synchronisation here: this runs on a link worker just
            # before its collective, and a worker waiting for the whole device
            # may wait for another link's collective whose peer, on another rank,
            # is that rank's worker blocked the same way: a hang across ranks.
            with self._lock:
                if self._cuda_origin is None:
                    self._cuda_origin, self._host_origin = start, None
                    self._cuda_origin_device = stream.device
        return start

    def end_cuda_span(self, lane: str, name: str, start, stream) -> None:
        if start is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        with self._lock:
            if not self.enabled:  # (off since it began: a hold released meanwhile)
                return
            if len(self._cuda_spans) == self._cuda_spans.maxlen:
                self.dropped += 1
            self._cuda_spans.append((lane, name, start, end))

    # -- reading -------------------------------------------------------------

    def spans(self) -> list[tuple[str, str, float, float]]:
        """Every span as (lane, name, start, end) in perf_counter seconds, by start."""
        with self._lock:
            spans = list(self._spans)
            cuda_spans = list(self._cuda_spans)
        if cuda_spans:
            # The spans' device, which need not be the current one (a loop that
            # switched devices, several wrappers in one process).
            torch.cuda.synchronize(self._cuda_origin_device)
            origin = self._cuda_origin
            if self._host_origin is None:  # the origin is a span's start event
                self._host_origin = self._host_time_of(origin)
            for lane, name, start, end in cuda_spans:
                spans.append((lane, name, self._host_origin + origin.elapsed_time(start) / 1e3,
                              self._host_origin + origin.elapsed_time(end) / 1e3))
        return sorted(spans, key=lambda s: s[2])

    def _host_time_of(self, event) -> float:
        """perf_counter reading at which ``event`` (recorded, completed) ran: an
        event recorded now on the idle device, and the GPU time between them."""
        now = torch.cuda.Event(enable_timing=True)
        now.record(torch.cuda.current_stream(self._cuda_origin_device))
        now.synchronize()
        return time.perf_counter() - event.elapsed_time(now) / 1e3

    def chrome_trace(self) -> dict:
        """Chrome trace JSON object: complete ("X") events in microseconds."""
        spans = self.spans()
        lanes = sorted({lane for lane, *_ in spans},
                       key=lambda l: (LANE_ORDER.index(l) if l in LANE_ORDER else len(LANE_ORDER), l))
        tid = {lane: i for i, lane in enumerate(lanes)}
        t0 = spans[0][2] if spans else 0.0
        # Times are relative to the first span; its perf_counter reading is kept so
        # that traces of ranks on one host can be lined up.
        events = [{"ph": "M", "name": "process_name", "pid": self.rank, "tid": 0,
                   "args": {"name": f"rank {self.rank}", "perf_counter_origin_s": t0}}]
        for lane in lanes:
            events.append({"ph": "M", "name": "thread_name", "pid": self.rank, "tid": tid[lane],
                           "args": {"name": lane}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": self.rank,
                           "tid": tid[lane], "args": {"sort_index": tid[lane]}})
        for lane, name, start, end in spans:
            events.append({"ph": "X", "name": name, "cat": lane, "pid": self.rank,
                           "tid": tid[lane], "ts": (start - t0) * 1e6,
                           "dur": max(0.0, end - start) * 1e6})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save_chrome_trace(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)


def busy_seconds(spans, lane: str, start: float, end: float) -> float:
    """Time within [start, end] during which ``lane`` had at least one span open."""
    intervals = sorted((max(s, start), min(e, end)) for l, _, s, e in spans
                       if l == lane and e > start and s < end)
    busy, cursor = 0.0, start
    for s, e in intervals:
        if e <= cursor:
            continue
        busy += e - max(s, cursor)
        cursor = e
    return busy
