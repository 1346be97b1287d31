"""Bucket-level reduce-scatter and all-gather, flat or over two link classes.

Knows nothing of models or optimizers: it moves flat tensors between ranks
and counts the bytes it sends. Every operation returns a :class:`PendingOp`
at once; the caller decides when to wait (``start_*`` / ``finish_*`` pairs
live in the wrapper).

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

[Note: the intra-node link of CPU ranks]
On CPU the ranks of a node are processes of one machine. With gloo their
bytes would cross TCP loopback, which costs CPU in the network stack at
both ends, CPU the training needs. Where every rank of the node can map one
file in /dev/shm, the intra-node phases (and the whole exchange of a
one-node group) go through shared memory instead (shared_memory.py); the
inter-node phase stays on gloo. ``Topology(shared_memory=False)`` or
``FGPSDP_SHARED_MEMORY=0`` turns it off; ``node_transport`` says which ran.

[Note: collectives on gloo]
On gloo both collectives of CPU tensors are point-to-point messages in
pieces, all in flight at once (gloo_collectives.py): gloo's reduce_scatter
sends as many bytes as an all-reduce (24 MiB per node for a 16 MiB buffer on
the emulated cluster, against 12 MiB for a ring), and its all_to_all_single
and all_gather_into_tensor moved 0.46-0.60 Gbit/s on one emulated 1 Gbit/s rail,
against 0.85-0.87. The reduce-scatter sums in rank order, as shared memory does.
NCCL's reduce_scatter_tensor and all_gather_into_tensor are used as they are.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import gloo_collectives, shutdown
from .profiling import nvtx_range
from .shared_memory import SharedMemoryCollectives
from .topology import LinkGroups, NodeLayout
from .tracing import Timeline

# torch 2.13 renamed the flat-tensor collectives; older releases have only the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class PendingOp:
    """A submitted bucket operation and what must happen once it has landed."""

    def __init__(self, future: Optional[Future], done_event=None,
                 on_done: Optional[Callable[[], None]] = None):
        self.future = future
        self._done_event = done_event  # CUDA: recorded on the link's stream
        self.on_done = on_done
        self._finished = False
        # The main thread and the scheduler thread may both wait for one
        # reduce-scatter: on_done must run once, and before either returns.
        self._lock = threading.Lock()

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
                    torch.cuda.current_stream().wait_event(self._done_event)
                if self.on_done is not None:
                    self.on_done()
                    if self._done_event is not None:
                        # on_done's kernels went to this stream: later waiters follow them.
                        self._done_event = torch.cuda.Event()
                        self._done_event.record()
                self._finished = True
                return
        if self._done_event is not None:
            torch.cuda.current_stream().wait_event(self._done_event)


class CommStats:
    """Bytes this rank sent, per link class and phase, since the last reset.

    The figures are what the algorithm puts on the wire per rank (a
    reduce-scatter or all-gather of B bytes over n ranks sends (n-1)/n * B),
    counted when an operation is submitted.
    """

    def __init__(self) -> None:
        self._bytes: dict[tuple[str, str], int] = defaultdict(int)
        self._lock = threading.Lock()

    def add(self, link: str, phase: str, nbytes: int) -> None:
        with self._lock:
            self._bytes[(link, phase)] += int(nbytes)

    def reset(self) -> None:
        with self._lock:
            self._bytes.clear()

    def as_dict(self) -> dict[str, dict[str, int]]:
        """``{link: {phase: bytes, ..., "total": bytes}}``."""
        out: dict[str, dict[str, int]] = {}
        with self._lock:
            items = sorted(self._bytes.items())
        for (link, phase), nbytes in items:
            per_link = out.setdefault(link, {"total": 0})
            per_link[phase] = nbytes
            per_link["total"] += nbytes
        return out


def bytes_sent(total_bytes: int, group_size: int) -> int:
    """Bytes one rank sends in a reduce-scatter/all-gather of total_bytes over group_size ranks."""
    return total_bytes * (group_size - 1) // group_size


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
    posting. Futures are resolved in submission order either way.
    """

    def __init__(self, name: str, device: torch.device, in_flight: Optional[int] = None):
        self.name = name
        self.device = device
        # CUDA: the link's own stream, so that its collectives overlap compute
        # and the other link's collectives.
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.in_flight = calls_in_flight() if in_flight is None else in_flight
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._finishes: Optional["queue.SimpleQueue"] = None
        self._slots: Optional[threading.Semaphore] = None
        self._finisher: Optional[threading.Thread] = None
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
        self._queue.put((fn, future, ready_event))
        return future

    def _run(self) -> None:
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
                self._finishes.put((finish, failure, future))
                continue
            self._resolve(finish, failure, future)

    def _finish_in_order(self) -> None:
        while True:
            item = self._finishes.get()
            if item is None:
                return
            self._resolve(*item)
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
        """The threads end once the collectives submitted so far have run."""
        self._queue.put(None)

    request_stop = close

    def join(self, timeout: Optional[float] = None) -> None:
        threads = [t for t in (self._thread, self._finisher) if t is not None]
        if threading.current_thread() in threads:
            return  # each of the two waits for the other: never join from inside
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


# Per link-worker thread: one reusable buffer per purpose. A worker runs one
# collective at a time, and these buffers never outlive the call, so reusing
# them is safe; allocating them per call made every worker thread's heap hold
# bucket-sized freed blocks (see docs/benchmarks/2026-11-30-memory-cpu.md).
_scratch = threading.local()


def _next_scratch_slot(purpose: str, slots: int) -> str:
    """A scratch name that cycles through ``slots`` buffers: a worker has at most
    that many calls in flight, and finishes them in order, so call k + slots is
    posted only after call k has finished with its buffer."""
    counters = _scratch.__dict__.setdefault("counters", {})
    count = counters.get(purpose, 0)
    counters[purpose] = count + 1
    return f"{purpose}#{count % slots}"


def _scratch_like(purpose: str, like: torch.Tensor) -> torch.Tensor:
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buf = buffers.get(purpose)
    if buf is None or buf.numel() < like.numel() or buf.dtype != like.dtype \
            or buf.device != like.device:
        buf = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
        buffers[purpose] = buf
    return buf[:like.numel()].view_as(like)


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    a_lo, b_lo = a.data_ptr(), b.data_ptr()
    return a_lo < b_lo + b.numel() * b.element_size() and b_lo < a_lo + a.numel() * a.element_size()


def reduce_scatter_blocking(group: dist.ProcessGroup, output: torch.Tensor,
                            input: torch.Tensor) -> None:
    """Sum ``input`` over the group; this rank gets chunk ``group rank`` in ``output``."""
    _run_to_end(start_reduce_scatter(group, output, input))


def start_reduce_scatter(group: dist.ProcessGroup, output: torch.Tensor, input: torch.Tensor,
                         scratch_slots: int = 1) -> Optional[Callable[[], None]]:
    """``reduce_scatter_blocking``, or, where the call is point-to-point messages,
    post them and return the function that waits and sums (see LinkWorker).
    ``scratch_slots``: calls the caller may have in flight at once."""
    n = dist.get_world_size(group)
    if input.numel() != output.numel() * n:
        raise ValueError(f"reduce-scatter sizes: input {input.numel()} != {n} x output {output.numel()}")
    with nvtx_range(f"fgpsdp.reduce_scatter[{n}]"):
        if n == 1:
            output.copy_(input)
            return None
        if dist.get_backend(group) == "nccl":
            _reduce_scatter_single(output, input, group=group)
            return None
        if input.device.type == "cpu":
            received = _scratch_like(_next_scratch_slot("reduce_scatter_received", scratch_slots),
                                     input)
            return gloo_collectives.start_reduce_scatter(group, output, input, received)
        # gloo's point-to-point takes CPU tensors only.
        received = _scratch_like("reduce_scatter_received", input)
        dist.all_to_all_single(received, input, group=group)
        torch.sum(received.view(n, -1), dim=0, out=output)
        return None


def all_gather_blocking(group: dist.ProcessGroup, output: torch.Tensor,
                        input: torch.Tensor) -> None:
    """Every rank's ``input`` lands at chunk ``group rank`` of ``output`` (may be in place)."""
    _run_to_end(start_all_gather(group, output, input))


def _run_to_end(finish: Optional[Callable[[], None]]) -> None:
    if finish is not None:
        finish()


def start_all_gather(group: dist.ProcessGroup, output: torch.Tensor, input: torch.Tensor,
                     scratch_slots: int = 1) -> Optional[Callable[[], None]]:
    """``all_gather_blocking``, or, where the call is point-to-point messages,
    post them and return the function that waits for them (see LinkWorker).
    ``scratch_slots``: calls the caller may have in flight at once."""
    n = dist.get_world_size(group)
    if output.numel() != input.numel() * n:
        raise ValueError(f"all-gather sizes: output {output.numel()} != {n} x input {input.numel()}")
    with nvtx_range(f"fgpsdp.all_gather[{n}]"):
        if n == 1:
            if input.data_ptr() != output.data_ptr():
                output.copy_(input)
            return None
        if dist.get_backend(group) == "nccl":  # documents in-place
            _all_gather_single(output, input, group=group)
            return None
        point_to_point = input.device.type == "cpu"  # gloo's takes CPU tensors only
        own = output[dist.get_rank(group) * input.numel():][:input.numel()]
        # The point-to-point path sends this rank's chunk from where it lies; a host
        # backend's collective would read what it writes.
        in_place_ok = point_to_point and input.data_ptr() == own.data_ptr()
        if _aliases(input, output) and not in_place_ok:
            input = _scratch_like(_next_scratch_slot("all_gather_input", scratch_slots),
                                  input).copy_(input)
        if point_to_point:
            return gloo_collectives.start_all_gather(group, output, input)
        _all_gather_single(output, input, group=group)
        return None


def shared_memory_eligible(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether a group of one node's ranks may move CPU tensors through shared memory."""
    return device.type == "cpu" and dist.get_backend(group) == "gloo" \
        and dist.get_world_size(group) > 1


class _Exchange:
    def __init__(self, device: torch.device, stats: CommStats, timeline: Optional[Timeline]):
        self.device = device
        self.stats = stats
        self.timeline = timeline if timeline is not None else Timeline()

    @staticmethod
    def _node_transport(group: dist.ProcessGroup, device: torch.device, enabled: bool,
                        name: str, slots: int) -> Optional[SharedMemoryCollectives]:
        """Shared memory for ``group`` if it may and can use it (collective: every rank
        of the group calls this, in the same order)."""
        if enabled and shared_memory_eligible(group, device):
            shm = SharedMemoryCollectives(group, name=name)
            shm.prepare(slots)
            return shm
        return None

    @staticmethod
    def _collective(phase: str, group, shm: Optional[SharedMemoryCollectives], output, input,
                    worker: "LinkWorker"):
        """The collective (``reduce_scatter`` or ``all_gather``) a worker runs: through
        shared memory when the node allows it, else on the group's backend. Returns
        what finishes it, or None if it has finished (see LinkWorker)."""
        through_node = getattr(shm, phase) if shm is not None else None
        on_group = start_reduce_scatter if phase == "reduce_scatter" else start_all_gather

        def run():
            if through_node is not None:
                with nvtx_range(f"fgpsdp.{phase}_shm[{shm.size}]"):
                    if through_node(output, input):
                        return None
            return on_group(group, output, input, scratch_slots=worker.in_flight)
        return run

    @property
    def node_transport(self) -> str:
        """How bytes move among one node's ranks: ``shared_memory`` or ``gloo``/``nccl``."""
        transports = [t for t in (self._rs_shm, self._ag_shm) if t is not None]
        if transports and all(t.enabled for t in transports):
            return "shared_memory"
        return dist.get_backend(self._node_group)

    # Set by the subclasses: the node's group, and its shared-memory collectives if any.
    _node_group: dist.ProcessGroup
    _rs_shm: Optional[SharedMemoryCollectives] = None
    _ag_shm: Optional[SharedMemoryCollectives] = None

    workers: tuple[LinkWorker, ...] = ()

    def close(self) -> None:
        """Stop the link workers once their submitted collectives have run, and
        wait for them (bounded: see shutdown.py)."""
        shutdown.stop_and_join(self.workers)

    def _submit(self, worker: LinkWorker, fn: Callable[[], None], name: str,
                after: Optional[tuple[Future, LinkWorker]] = None) -> PendingOp:
        """Run ``fn`` on ``worker``; with ``after``, once that phase has finished.

        On CUDA the work is ordered after what the submitting stream has queued
        so far (ready event), or after the first phase's stream, and the
        returned op makes the waiting stream wait for it, without a host sync.
        """
        ready = None
        if worker.stream is not None and after is None:
            ready = torch.cuda.Event()
            ready.record()
        done = torch.cuda.Event() if worker.stream is not None else None
        timeline = self.timeline

        def task():
            if after is not None:
                first, first_worker = after
                first.result()  # re-raises a failure of the first phase
                if worker.stream is not None:
                    worker.stream.wait_stream(first_worker.stream)
            if worker.stream is not None:
                start = timeline.cuda_span_events(worker.stream)
                _run_to_end(fn())
                timeline.end_cuda_span(worker.name, name, start, worker.stream)
                done.record(worker.stream)
                return None
            start = time.perf_counter()
            finish = fn()

            def finish_and_trace():
                _run_to_end(finish)
                if timeline.enabled:
                    timeline.add(worker.name, name, start, time.perf_counter())
            if finish is None:  # finished already: the span ends now
                finish_and_trace()
                return None
            return finish_and_trace  # the worker runs it, now or on its finishing thread
        return PendingOp(worker.submit(task, ready), done_event=done)


class FlatExchange(_Exchange):
    """All ranks in one group per phase: one link class, ``flat``."""

    def __init__(self, rs_group: dist.ProcessGroup, ag_group: dist.ProcessGroup,
                 device: torch.device, stats: CommStats, timeline: Optional[Timeline] = None,
                 *, one_node_shared_memory: bool = False):
        super().__init__(device, stats, timeline)
        self.rs_group, self.ag_group = rs_group, ag_group
        self.size = dist.get_world_size(rs_group)
        self.rs_worker = LinkWorker("flat-rs", device)
        self.ag_worker = LinkWorker("flat-ag", device)
        # Every rank on one node: the whole exchange may go through shared memory.
        self._rs_shm = self._node_transport(rs_group, device, one_node_shared_memory, "flat-rs",
                                            slots=self.size)
        self._ag_shm = self._node_transport(ag_group, device, one_node_shared_memory, "flat-ag",
                                            slots=1)
        self._node_group = rs_group

    def start_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                             label: str = "") -> PendingOp:
        self.stats.add("flat", "reduce_scatter",
                       bytes_sent(input.numel() * input.element_size(), self.size))
        return self._submit(self.rs_worker,
                            self._collective("reduce_scatter", self.rs_group, self._rs_shm,
                                             output, input, self.rs_worker),
                            f"RS {label}")

    def start_all_gather(self, output: torch.Tensor, input: torch.Tensor,
                         label: str = "") -> PendingOp:
        self.stats.add("flat", "all_gather",
                       bytes_sent(output.numel() * output.element_size(), self.size))
        return self._submit(self.ag_worker,
                            self._collective("all_gather", self.ag_group, self._ag_shm, output,
                                             input, self.ag_worker),
                            f"AG {label}")

    @property
    def workers(self) -> tuple[LinkWorker, ...]:
        return (self.rs_worker, self.ag_worker)


class HierarchicalExchange(_Exchange):
    """Intra-node phase on the node's group, inter-node phase on the rail."""

    def __init__(self, layout: NodeLayout, rs_groups: LinkGroups, ag_groups: LinkGroups,
                 device: torch.device, stats: CommStats, timeline: Optional[Timeline] = None,
                 *, intra_shared_memory: bool = False):
        super().__init__(device, stats, timeline)
        self.layout = layout
        self.rs_groups, self.ag_groups = rs_groups, ag_groups
        self.intra_rs = LinkWorker("intra-rs", device)
        self.inter_rs = LinkWorker("inter-rs", device)
        self.intra_ag = LinkWorker("intra-ag", device)
        self.inter_ag = LinkWorker("inter-ag", device)
        self._rs_shm = self._node_transport(rs_groups.intra, device, intra_shared_memory,
                                            "intra-rs", slots=layout.local_size)
        self._ag_shm = self._node_transport(ag_groups.intra, device, intra_shared_memory,
                                            "intra-ag", slots=1)
        self._node_group = rs_groups.intra

    def start_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                             label: str = "") -> PendingOp:
        L, M = self.layout.local_size, self.layout.nodes
        nbytes = input.numel() * input.element_size()
        self.stats.add("intra", "reduce_scatter", bytes_sent(nbytes, L))
        self.stats.add("inter", "reduce_scatter", bytes_sent(nbytes // L, M))
        # The node's sum of this rank's chunk; lives until the inter phase is done.
        partial = torch.empty(input.numel() // L, dtype=input.dtype, device=input.device)
        groups = self.rs_groups
        first = self._submit(self.intra_rs,
                             self._collective("reduce_scatter", groups.intra, self._rs_shm,
                                              partial, input, self.intra_rs),
                             f"RS {label}")
        slots = self.inter_rs.in_flight
        return self._submit(self.inter_rs,
                            lambda: start_reduce_scatter(groups.inter, output, partial,
                                                         scratch_slots=slots),
                            f"RS {label}", after=(first.future, self.intra_rs))

    def start_all_gather(self, output: torch.Tensor, input: torch.Tensor,
                         label: str = "") -> PendingOp:
        L, M = self.layout.local_size, self.layout.nodes
        nbytes = output.numel() * output.element_size()
        self.stats.add("inter", "all_gather", bytes_sent(nbytes // L, M))
        self.stats.add("intra", "all_gather", bytes_sent(nbytes, L))
        chunk = output.numel() // L
        groups = self.ag_groups
        local = dist.get_rank(groups.intra)
        # This rank's chunk of the bucket: the rail fills it, then the node shares it.
        own_chunk = output[local * chunk:(local + 1) * chunk]
        slots = self.inter_ag.in_flight
        first = self._submit(self.inter_ag,
                             lambda: start_all_gather(groups.inter, own_chunk, input,
                                                      scratch_slots=slots),
                             f"AG {label}")
        return self._submit(self.intra_ag,
                            self._collective("all_gather", groups.intra, self._ag_shm, output,
                                             own_chunk, self.intra_ag),
                            f"AG {label}", after=(first.future, self.inter_ag))

    @property
    def workers(self) -> tuple[LinkWorker, ...]:
        return (self.intra_rs, self.inter_rs, self.intra_ag, self.inter_ag)
