"""Bucket-level reduce-scatter and all-gather, flat or over two link classes.

Knows nothing of models or optimizers: it moves flat tensors between ranks
and counts the bytes it sends. Every operation returns a
:class:`~fgpsdp_runtime.link_worker.PendingOp` at once; the caller decides when
to wait (``start_*`` / ``finish_*`` pairs live in the wrapper). Each phase of
each link class runs on a worker thread of its own (link_worker.py), one
group's collective at a time (group_collectives.py).

[Note: the intra-node link of CPU ranks]
On CPU the ranks of a node are processes of one machine. With gloo their
bytes would cross TCP loopback, which costs CPU in the network stack at
both ends, CPU the training needs. Where every rank of the node can map one
file in /dev/shm, the intra-node phases (and the whole exchange of a
one-node group) go through shared memory instead (shared_memory.py); the
inter-node phase stays on gloo. ``Topology(shared_memory=False)`` or
``FGPSDP_SHARED_MEMORY=0`` turns it off; ``node_transport`` says which ran.

[Note: memory on the link streams]
On CUDA each worker runs its collectives on a stream of its own, and NCCL
called synchronously there neither records its tensors on that stream nor
keeps them. A tensor allocated on the compute stream (a send buffer, the
node's partial sum between the two reduce-scatter phases) is dropped by the
host once its task has been queued; without more, the caching allocator
would hand its block to the next allocation on the compute stream while
the slower link has not read it yet (silently wrong gradients). So every
tensor a task uses is recorded on the worker's stream (record_stream): the
block is reused only after the work queued there when it was freed.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import shutdown
from .backends import backend_of
from .group_collectives import run_to_end, start_all_gather, start_reduce_scatter
from .link_worker import LinkWorker, PendingOp
from .profiling import nvtx_range
from .shared_memory import SharedMemoryCollectives
from .topology import LinkGroups, NodeLayout
from .tracing import Timeline


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


def shared_memory_eligible(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether a group of one node's ranks may move CPU tensors through shared memory."""
    return device.type == "cpu" and backend_of(group, device) == "gloo" \
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
            shutdown.register_abortable(shm)  # its barriers stop waiting at exit
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
        return backend_of(self._node_group, self.device)

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
                uses: tuple[torch.Tensor, ...], after: Optional[PendingOp] = None) -> PendingOp:
        """Run ``fn`` on ``worker``; with ``after``, once that phase has finished.

        On CUDA the work is ordered after what the submitting stream has queued
        so far (ready event), or after the first phase's own collective (its
        done event: not the whole of its stream, which may already hold later
        buckets' first phases), and the returned op makes the waiting stream
        wait for it, without a host sync. ``uses`` are the tensors ``fn`` reads
        or writes: the caching allocator must not hand their memory to another
        stream's work before this one's is done (see [Note: memory on the link
        streams]).
        """
        ready = None
        if worker.stream is not None:
            for tensor in uses:
                tensor.record_stream(worker.stream)
            if after is None:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.device))
        done = torch.cuda.Event() if worker.stream is not None else None
        timeline = self.timeline

        def task():
            if after is not None:
                after.future.result()  # re-raises a failure of the first phase
                if worker.stream is not None:
                    # Recorded before the first phase's future was resolved.
                    worker.stream.wait_event(after.done_event)
            if worker.stream is not None:
                start = timeline.cuda_span_events(worker.stream)
                run_to_end(fn())
                timeline.end_cuda_span(worker.name, name, start, worker.stream)
                done.record(worker.stream)
                return None
            start = time.perf_counter()
            finish = fn()

            def finish_and_trace():
                run_to_end(finish)
                if timeline.enabled:
                    timeline.add(worker.name, name, start, time.perf_counter())
            if finish is None:  # finished already: the span ends now
                finish_and_trace()
                return None
            return finish_and_trace  # the worker runs it, now or on its finishing thread
        return PendingOp(worker.submit(task, ready), done_event=done, device=self.device)


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
                            f"RS {label}", uses=(output, input))

    def start_all_gather(self, output: torch.Tensor, input: torch.Tensor,
                         label: str = "") -> PendingOp:
        self.stats.add("flat", "all_gather",
                       bytes_sent(output.numel() * output.element_size(), self.size))
        return self._submit(self.ag_worker,
                            self._collective("all_gather", self.ag_group, self._ag_shm, output,
                                             input, self.ag_worker),
                            f"AG {label}", uses=(output, input))

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
                             f"RS {label}", uses=(partial, input))
        slots = self.inter_rs.in_flight
        return self._submit(self.inter_rs,
                            lambda: start_reduce_scatter(groups.inter, output, partial,
                                                         scratch_slots=slots),
                            f"RS {label}", uses=(output, partial), after=first)

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
                             f"AG {label}", uses=(own_chunk, input))
        return self._submit(self.intra_ag,
                            self._collective("all_gather", groups.intra, self._ag_shm, output,
                                             own_chunk, self.intra_ag),
                            f"AG {label}", uses=(output,), after=first)

    @property
    def workers(self) -> tuple[LinkWorker, ...]:
        return (self.intra_rs, self.inter_rs, self.intra_ag, self.inter_ag)
