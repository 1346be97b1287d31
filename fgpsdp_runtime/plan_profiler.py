"""Profiles the first steps of a two-stage run and switches it to a profile-based plan.

Steps ``warmup_steps`` .. ``warmup_steps + profiled_steps - 1`` are measured:
when backward finished each bucket (from the end of forward), how long
backward took, how long each forward waited for each bucket's all-gather
(every all-gather is in stage 2 while profiling), and how long each
collective held the bottleneck link (from the timeline, enabled for those
steps if the user had not); on CUDA the compute times and waits are the
GPU's, as the link times are (see ``DeviceMarks``). A link cost model
(latency + bytes / bandwidth) is fitted to the collectives, and
``plan.profile_plan`` turns the figures, with the size of each bucket's undo
record, into a plan: rank 0's compute and link times, and every bucket's
longest wait over all ranks (one all-reduce). Rank 0's plan is broadcast, and
every rank switches to it at the end of the same step, so the order of
collectives stays the same everywhere.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
import warnings
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from .backends import objects_on
from .group_collectives import all_reduce_held
from .object_collectives import broadcast_object
from .plan import BucketProfile, LinkModel, OverlapPlan, profile_plan

# The link whose time bounds the exchange: the rail between nodes, or the one group.
_BOTTLENECK_LANES = {True: ("inter-rs", "inter-ag"), False: ("flat-rs", "flat-ag")}
_EXTEND = "extend"  # rank 0's word when its window timed no backward
_MAX_EXTENSIONS = 4  # then the profiling plan is kept (no stage 1)


class PlanProfiler:
    def __init__(self, model, *, warmup_steps: int = 1, profiled_steps: int = 2,
                 undo_budget_bytes: Optional[float] = None):
        # Weak: the wrapper holds this profiler (a cycle would keep a dropped wrapper
        # alive until the garbage collector's next full pass).
        self._model_ref = weakref.ref(model)
        self.warmup_steps = warmup_steps
        self.profiled_steps = profiled_steps
        self.undo_budget_bytes = undo_budget_bytes  # DistributedDataParallel(speculation_memory_mb=)
        self.steps = 0
        self.done = False
        self._profiling = False
        self._extensions = 0  # windows profiled again: the last one timed no backward
        self._window_start = 0.0
        self._marks = DeviceMarks(model.device) if model.device.type == "cuda" else HostMarks()
        # The mark of the end of the forward that the next backward reduces; None
        # outside one (a round of reduce-scatters at the step, for gradients
        # accumulated under no_sync(), or a joined rank's round of zeros).
        self._forward_end = None
        # (forward end, bucket, mark) and (forward end, mark): resolved at the end
        self._ready_marks: list[tuple] = []
        self._backward_marks: list[tuple] = []
        self._wait_marks: list[tuple] = []  # (bucket, need, landed): the loop's wait
        # This rank's own waits per bucket in the last window (the plan takes every
        # rank's longest).
        self.local_forward_wait_s: dict[int, float] = {}
        model.reducer.bucket_ready_listeners.append(self._on_bucket_ready)
        model.reducer.backward_end_listeners.append(self._on_backward_end)
        if warmup_steps == 0:
            self._start()

    @property
    def model(self):
        return self._model_ref()

    # -- listeners (the main thread; on CUDA the hooks run on autograd's device thread) --

    def on_forward_end(self) -> None:
        # Only a forward that backward will reduce: an eval forward (no grad, or
        # under no_sync) in between must not move the origin.
        if self._profiling and torch.is_grad_enabled() and self.model.reducer.sync_enabled:
            self._forward_end = self._marks.mark()

    def mark_gather_needed(self):
        """The training loop (a forward, ``synchronize()``) needs a bucket's
        all-gather and it has not landed: a mark before it waits, or None outside
        the window, or on a rank joined under ``model.join()``: its shadowed
        forwards compute nothing and wait for every all-gather in full, a wait
        no forward has."""
        uneven = self.model._uneven_inputs
        if uneven is not None and uneven.joined:
            return None
        return self._marks.mark() if self._profiling else None

    def on_gather_waited(self, bucket: int, need) -> None:
        """The loop that took ``need`` may read ``bucket`` now. On CUDA the mark
        goes on the compute stream after its wait for the all-gather's event: the
        difference is how long the GPU's work stood still for it."""
        if need is not None and self._profiling:
            self._wait_marks.append((bucket, need, self._marks.mark()))

    def _on_bucket_ready(self, b: int) -> None:
        if self._profiling and self._forward_end is not None:
            self._ready_marks.append((self._forward_end, b, self._marks.mark()))

    def _on_backward_end(self) -> None:
        if self._profiling and self._forward_end is not None:
            self._backward_marks.append((self._forward_end, self._marks.mark()))
        self._forward_end = None

    def end_step(self) -> None:
        """Called by the optimizer at the end of every step, on every rank."""
        if self.done:
            return
        self.steps += 1
        self._forward_end = None
        if self.steps == self.warmup_steps:
            self._start()
        elif self.steps == self.warmup_steps + self.profiled_steps:
            self._finish()

    # -- the window ----------------------------------------------------------------

    def stop(self) -> None:
        """The caller set a plan of its own (``model.set_overlap_plan``): profile no
        more, so that the profile's plan does not replace it. Between steps, on
        every rank, as the plan is set (the profile ends in a broadcast)."""
        if self.done:
            return
        self.done = True
        if self.steps >= self.warmup_steps:  # _start() ran: its hold on the timeline
            self.model.timeline.release()
        self._profiling = False
        self._ready_marks, self._backward_marks, self._wait_marks = [], [], []
        self._forward_end = None

    def _open_window(self) -> None:
        self._profiling = True
        self._window_start = time.perf_counter()

    def _start(self) -> None:
        self._open_window()
        timeline = self.model.timeline
        if self.model.device.type == "cuda":
            # Here, at a step's end, the host has just waited for the norm: the
            # clock's synchronisation costs next to nothing.
            timeline.start_cuda_clock(self.model.device)
        timeline.hold()

    def _finish(self) -> None:
        model = self.model
        self._profiling = False
        marks = self._ready_marks, self._backward_marks, self._wait_marks
        self._ready_marks, self._backward_marks, self._forward_end = [], [], None
        self._wait_marks = []
        # Every rank's: the step waits for the slowest forward, and ranks wait
        # differently (another node's link, a slower core).
        waits = self._slowest_forward_waits(marks[2])
        decision = None
        # Rank 0's, or under join() an active rank's (a joined one times no compute).
        if model.rank == model.authoritative_rank:
            try:  # (the timeline read too: the others wait in the broadcast)
                spans = [s for s in model.timeline.spans() if s[2] >= self._window_start]
                if marks[1]:
                    decision = self.plan_from(spans, *self._resolve_marks(*marks[:2]),
                                              waits).to_json()
                elif self._extensions < _MAX_EXTENSIONS:
                    # No backward was reduced in the window (every micro-batch under
                    # no_sync(), say): nothing to plan from. Profile as many steps again.
                    decision = _EXTEND
                else:  # a loop that never reduces in backward: nothing to overlap there
                    decision = model.plan.to_json()
            except Exception as error:  # noqa: BLE001 - the others wait in the broadcast
                warnings.warn(f"fgpsdp: no profile plan ({error!r}); keeping {model.plan}",
                              RuntimeWarning)
                decision = model.plan.to_json()
        with objects_on(model.device):
            decision = broadcast_object(decision, model.authoritative_rank,
                                        model.process_group, "profile plan")
        if decision == _EXTEND:  # every rank alike: the decision was broadcast
            self._extensions += 1
            self.steps = self.warmup_steps
            self._open_window()
            return
        self.done = True
        model.timeline.release()
        model.install_overlap_plan(OverlapPlan.from_json(decision))

    def _resolve_marks(self, ready_marks, backward_marks
                       ) -> tuple[dict[int, list[float]], list[float]]:
        """Seconds from each forward's end: per bucket, when backward finished it;
        and when backward ended."""
        self._marks.wait()
        seconds = self._marks.seconds
        ready: dict[int, list[float]] = {}
        for origin, b, mark in ready_marks:
            ready.setdefault(b, []).append(seconds(origin, mark))
        return ready, [seconds(origin, mark) for origin, mark in backward_marks]

    def _resolve_waits(self, wait_marks) -> dict[int, float]:
        """Per bucket, this rank's forwards' waits per profiled step."""
        self._marks.wait()
        seconds = self._marks.seconds
        waits: dict[int, float] = {}
        for b, need, landed in wait_marks:
            waits[b] = waits.get(b, 0.0) + max(0.0, seconds(need, landed)) / self.profiled_steps
        return waits

    def _slowest_forward_waits(self, wait_marks) -> dict[int, float]:
        """Per bucket, the longest of every rank's waits (a MAX all-reduce on every
        rank, joined ones included: they time no waits and send zeros)."""
        model = self.model
        try:
            self.local_forward_wait_s = self._resolve_waits(wait_marks)
        except Exception as error:  # noqa: BLE001 - the others wait in the all-reduce
            warnings.warn(f"fgpsdp: this rank's forward waits are unknown ({error!r})",
                          RuntimeWarning)
            self.local_forward_wait_s = {}
        if model.world_size == 1:
            return dict(self.local_forward_wait_s)
        n = len(model.bucket_layouts)
        slowest = torch.zeros(n, dtype=torch.float64, device=model.device)
        for b, s in self.local_forward_wait_s.items():
            slowest[b] = s
        all_reduce_held(slowest, dist.ReduceOp.MAX, model.process_group, "forward waits")
        return {b: s for b, s in enumerate(slowest.tolist()) if s > 0.0}

    def plan_from(self, spans, ready: dict[int, list[float]], backward: list[float],
                  forward_waits: Optional[dict[int, float]] = None) -> OverlapPlan:
        model = self.model
        layouts = model.bucket_layouts
        backward_s = statistics.median(backward) if backward else 0.0
        reduce_itemsize = [s.reduce_dtype.itemsize for s in model.buckets]
        buckets = [BucketProfile(bytes=l.padded_numel * l.element_size,
                                 ready_s=statistics.median(ready[b]) if ready.get(b) else backward_s,
                                 reduce_bytes=l.padded_numel * reduce_itemsize[b])
                   for b, l in enumerate(layouts)]
        fraction = link_fraction(model.topology, model.world_size)

        def span_bytes(lane, name):
            bucket = buckets[_bucket_of(name)]
            return bucket.reduce_scatter_bytes if lane.endswith("-rs") else bucket.bytes
        link = fit_link([(span_bytes(lane, name) * fraction, end - start)
                         for lane, name, start, end in spans
                         if lane in _BOTTLENECK_LANES[model.topology.uses_hierarchy]])
        optimizer = model.attached_optimizer
        undo_bytes = optimizer.undo_record_bytes() if optimizer is not None else None
        plan = profile_plan(buckets, backward_s, model.forward_bucket_order, link=link,
                            reduce_fraction=fraction, forward_wait_s=forward_waits,
                            undo_bytes=undo_bytes, undo_budget_bytes=self.undo_budget_bytes)
        predicted = dict(plan.predicted or {}, link={"latency_s": link.latency_s,
                                                     "bandwidth_Bps": link.bandwidth_Bps},
                         bucket_ready_s=[b.ready_s for b in buckets])
        return dataclasses.replace(plan, predicted=predicted)


class HostMarks:
    """CPU: a mark is the host clock, which is when the work ran."""

    @staticmethod
    def mark() -> float:
        return time.perf_counter()

    @staticmethod
    def seconds(origin: float, mark: float) -> float:
        return mark - origin

    def wait(self) -> None:
        pass


class DeviceMarks:
    """CUDA: a mark is an event on the compute stream.

    Why not the host clock: the host only enqueues backward's kernels, and
    runs ahead of the GPU by as many as the launch queue holds; a gradient hook
    fires when its bucket's pack is enqueued, not when it has run. Host times
    would squeeze backward towards its start (and a step that waited on the
    allocator would stretch it), while the link times come from events on the
    link streams: the plan would compare two clocks. Events read the GPU's.
    A gradient hook's mark goes on the stream autograd runs that node on, which
    waits for the gradient; the end-of-backward callback's on the caller's
    streams, which autograd syncs with every node's first. Any two marks are on
    one device, so their difference is defined whatever streams they are on.
    """

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    @staticmethod
    def seconds(origin, mark) -> float:
        return origin.elapsed_time(mark) / 1e3

    def wait(self) -> None:
        """Once, when the profile ends: every mark's event must have run."""
        torch.cuda.synchronize(self.device)


def link_fraction(topology, world_size: int) -> float:
    """Bytes one rank puts on the bottleneck link per bucket byte, per phase."""
    if topology.uses_hierarchy:
        nodes, local = topology.nodes, topology.local_size
        return (nodes - 1) / (nodes * local)
    return (world_size - 1) / world_size


def fit_link(samples) -> LinkModel:
    """Least-squares latency + bytes / bandwidth over (bytes, seconds) samples.

    With fewer than two sizes, or a fit that makes no physical sense, the
    latency is taken as zero and the bandwidth as total bytes / total time.
    """
    samples = [(b, t) for b, t in samples if t > 0 and b > 0]
    if not samples:
        return LinkModel(latency_s=0.0, bandwidth_Bps=float("inf"))
    fitted = _least_squares(samples)
    if fitted is not None:
        return fitted
    return LinkModel(latency_s=0.0, bandwidth_Bps=sum(b for b, _ in samples)
                     / sum(t for _, t in samples))


def _least_squares(samples) -> Optional[LinkModel]:
    n = len(samples)
    mean_b = sum(b for b, _ in samples) / n
    mean_t = sum(t for _, t in samples) / n
    var_b = sum((b - mean_b) ** 2 for b, _ in samples)
    if n < 2 or var_b <= 0:
        return None
    slope = sum((b - mean_b) * (t - mean_t) for b, t in samples) / var_b  # seconds per byte
    latency = mean_t - slope * mean_b
    if slope <= 0 or latency < 0:
        return None
    return LinkModel(latency_s=latency, bandwidth_Bps=1.0 / slope)


def _bucket_of(span_name: str) -> int:
    """'RS b3' -> 3 (names given by the reducer and the wrapper)."""
    return int(span_name.rsplit("b", 1)[1])
