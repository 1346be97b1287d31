"""One process group's reduce-scatter and all-gather of flat tensors, on any backend.

Knows nothing of links or buckets: the exchanges (comm.py) call these on a
link worker's thread. ``start_*`` returns the function that finishes a call
where the call is point-to-point messages still in flight, else None.
``hold_past_gloo_worker`` keeps the tensors of the runtime's other gloo
collectives alive past gloo's thread (see the note at it).

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

import threading
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from . import gloo_collectives
from .backends import backend_of
from .profiling import nvtx_range
from .rank_order_sum import sum_in_rank_order

# torch 2.13 renamed the flat-tensor collectives; older releases have only the old names.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# [Note: tensors a finished gloo collective still holds]
# gloo runs a collective (all_reduce, broadcast) on a worker thread of its own,
# which drops its references to the collective's tensors only after the caller's
# wait has returned. Where the caller's Python tensor is gone by then, freeing it
# takes the GIL on that thread; and in older torch destroy_process_group() joins
# that thread while holding the GIL (torch releases it there since its pull request
# 154976, 2025), so the two wait for each other: a job that destroys its group right
# after such a collective hangs at its end (seen on torch 2.4.1:
# tests/test_shared_memory.py hung so in 5 of 9 runs of the file, gdb showing the
# main thread in ~ProcessGroupGloo and a gloo thread freeing a finished all-reduce's
# tensor; not seen on 2.13 or 2.14; see docs/compatibility.md). So each call site of
# the runtime's own blocking tensor collectives on CPU tensors keeps its latest tensors
# alive until its next call (large tensors of the module's are broadcast in place
# instead: buffer_broadcast.py), and so do the runtime's object collectives
# (object_collectives.py: the set-up checks, full_state_dict()'s metadata), which
# on gloo pickle into tensors of their own rather than torch's. Left out: CUDA
# tensors on a gloo group.
_held_past_gloo_worker: dict[str, tuple[torch.Tensor, ...]] = {}


def hold_past_gloo_worker(site: str, *tensors: torch.Tensor) -> None:
    """Keep ``tensors`` (a finished collective's, called from ``site``) alive until
    that site's next call: see the note above. CUDA tensors are not held."""
    _held_past_gloo_worker[site] = tuple(t for t in tensors if t.device.type == "cpu")


def all_reduce_held(tensor: torch.Tensor, op: dist.ReduceOp,
                    group: Optional[dist.ProcessGroup], site: str) -> None:
    """A blocking all-reduce of a small tensor, held past gloo's thread (the note above)."""
    dist.all_reduce(tensor, op=op, group=group)
    hold_past_gloo_worker(site, tensor)


def exchange_bytes(group: Optional[dist.ProcessGroup], sends: Sequence[torch.Tensor],
                   recvs: Sequence[torch.Tensor], site: str,
                   point_to_point: Optional[bool] = None) -> None:
    """A blocking all-to-all of byte tensors (uint8) of any sizes: ``sends[j]`` goes to
    group rank j and lands in j's ``recvs[this rank]``, which must be as large;
    this rank's own entries are left alone, and an empty pair sends nothing. Held
    past gloo's thread (the note above).

    On gloo, CPU tensors travel as point-to-point messages in pieces ([Note: why
    not gloo's own collectives] in gloo_collectives.py); elsewhere (NCCL) as one
    ``all_to_all_single`` with per-rank sizes. ``point_to_point`` overrides that
    choice (tests run both on gloo)."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return
    device = sends[me].device
    if point_to_point is None:
        point_to_point = device.type == "cpu" and backend_of(group, device) == "gloo"
    if point_to_point:
        for work in gloo_collectives.post_exchange(group, sends, recvs):
            work.wait()
    else:
        send_sizes = [0 if j == me else t.numel() for j, t in enumerate(sends)]
        recv_sizes = [0 if j == me else t.numel() for j, t in enumerate(recvs)]
        outgoing = torch.cat([t for j, t in enumerate(sends) if j != me]) if sum(send_sizes) \
            else torch.empty(0, dtype=torch.uint8, device=device)
        incoming = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
        dist.all_to_all_single(incoming, outgoing, recv_sizes, send_sizes, group=group)
        for j, part in enumerate(incoming.split(recv_sizes)):
            if j != me and part.numel():
                recvs[j].copy_(part)
        sends, recvs = [outgoing], [incoming]
    hold_past_gloo_worker(site, *sends, *recvs)


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
    run_to_end(start_reduce_scatter(group, output, input))


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
        if backend_of(group, input.device) == "nccl":
            reduce_scatter_single(output, input, group=group)
            return None
        if input.device.type == "cpu":
            received = _scratch_like(_next_scratch_slot("reduce_scatter_received", scratch_slots),
                                     input)
            return gloo_collectives.start_reduce_scatter(group, output, input, received)
        # gloo's point-to-point takes CPU tensors only.
        received = _scratch_like("reduce_scatter_received", input)
        dist.all_to_all_single(received, input, group=group)
        sum_in_rank_order(received.view(n, -1), output)
        return None


def all_gather_blocking(group: dist.ProcessGroup, output: torch.Tensor,
                        input: torch.Tensor) -> None:
    """Every rank's ``input`` lands at chunk ``group rank`` of ``output`` (may be in place)."""
    run_to_end(start_all_gather(group, output, input))


def run_to_end(finish: Optional[Callable[[], None]]) -> None:
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
        if backend_of(group, output.device) == "nccl":  # documents in-place
            all_gather_single(output, input, group=group)
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
        all_gather_single(output, input, group=group)
        return None

