"""Reduce-scatter and all-gather on gloo, as point-to-point messages in pieces.

[Note: why not gloo's own collectives]
On the emulated cluster (two network namespaces joined by a veth pair shaped
to 1 Gbit/s, one rail of two ranks, a 25 MiB buffer) gloo's
``all_to_all_single`` moved 0.46 Gbit/s and ``all_gather_into_tensor``
0.58-0.60; the same bytes as one isend/irecv per peer 0.48, as 4 MiB pieces
all in flight 0.74, as 1 MiB pieces 0.87 (bench/rail_collectives.py; the
record is docs/benchmarks/2026-11-30-rail-collectives-cpu.md). Those
point-to-point figures had each send posted before its receive, and most of
what the larger messages lost was the turn-taking of [Note: receives first]:
with every receive posted first, one message per direction moves 0.92-0.93
and 4 MiB pieces 0.92, level with 1 MiB pieces. (gloo's ``reduce_scatter`` is
worse still: it sends as many bytes as an all-reduce.) So both collectives
here post every message at once, split into pieces of at most
``PIECE_BYTES``, and wait for all:

- reduce-scatter: chunk j of the input goes to rank j; this rank receives its
  chunk from every peer and sums the n chunks in rank order (the same order
  on every rank and on every transport: rank_order_sum.py);
- all-gather: this rank's input goes to every peer; each peer's lands in its
  chunk of the output.

Every rank sends (n-1)/n of the buffer, the ring's volume. The messages of one
call carry the piece index as their tag; gloo matches a peer's messages of
one tag in the order they were posted, and every rank posts the calls of a
group in the same order, so calls on one group cannot mix even while several
are in flight. ``start_*`` posts a call and returns the function that waits
for it (and, for a reduce-scatter, sums): a link worker posts its next call
before the previous one has landed (link_worker.py), so that the link does not
drain between two bucket-sized calls.

[Note: receives first]
gloo's TCP transport sends a message's data only once the receiver's
"ready to receive" notice has arrived, and the notice travels in the same TCP
stream as the receiver's own data to the sender, behind whatever is queued
there. Posting each piece's send before its receive (as this module did up
to d13d0af) let a rank whose peer's notices had already arrived write a piece
of data and then the notice for the matching piece the other way, so the two
directions took turns: on the emulated 1 Gbit/s link, an all-gather of one
12.5 MiB message each way took 218 ms instead of the 113 ms it takes with the
receive posted first (in 1 MiB pieces 119-125 ms against 114-121, within
the bench's spread), and VGG-16's step at 2x1 went from 0.67-0.69 s to
0.61-0.63 s (docs/benchmarks/2026-12-04-receives-first.md).
So a call posts every receive before its first send. (A later call's notices
still queue behind an earlier call's data, but that data moves both ways at
once, so the directions do not take turns.)
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .rank_order_sum import sum_in_rank_order

# docs/benchmarks/2026-11-30-rail-collectives-cpu.md: 1 MiB pieces move as much as 256 KiB;
# each message costs a little CPU, so no smaller.
PIECE_BYTES = 1 << 20


def post_exchange(group: dist.ProcessGroup, sends: Sequence[torch.Tensor],
                  recvs: Sequence[torch.Tensor]) -> list:
    """For every peer j (group rank) other than this rank: post sending ``sends[j]``
    to j and receiving ``recvs[j]`` from j, all at once; return the works to wait
    for. What j sends this rank must be as large as what this rank receives from j
    (the sizes may differ from peer to peer and from one direction to the other)."""
    me = dist.get_rank(group)
    n = len(sends)
    peers = [(me + k) % n for k in range(1, n)]  # start at the next rank: spreads the load
    pieces = []  # (global rank of the peer, pieces to send, pieces to receive)
    for j in peers:
        numel = max(1, PIECE_BYTES // sends[j].element_size())
        # (An empty tensor posts no message: its peer, passing an empty one too, none.)
        pieces.append((dist.get_global_rank(group, j),
                       sends[j].split(numel) if sends[j].numel() else (),
                       recvs[j].split(numel) if recvs[j].numel() else ()))
    # Every receive before any send: see [Note: receives first].
    works = []
    for send_side in (False, True):
        for i in range(max((max(len(send), len(recv)) for _, send, recv in pieces), default=0)):
            for peer, send, recv in pieces:
                if send_side and i < len(send):
                    works.append(dist.isend(send[i], peer, group=group, tag=i))
                elif not send_side and i < len(recv):
                    works.append(dist.irecv(recv[i], peer, group=group, tag=i))
    return works


def _wait_all(works) -> None:
    for work in works:
        work.wait()


def start_reduce_scatter(group: dist.ProcessGroup, output: torch.Tensor, input: torch.Tensor,
                         received: torch.Tensor) -> Callable[[], None]:
    """Post a reduce-scatter; the returned function waits for it and sums.

    The sum of every rank's ``input`` lands in ``output`` (this rank's chunk).
    ``received`` is scratch of the input's size (peers' chunks land there);
    none of the three may be touched until the returned function has run.
    """
    n, me = dist.get_world_size(group), dist.get_rank(group)
    chunks = input.view(n, -1)
    rows = received.view(n, -1)
    works = post_exchange(group, list(chunks), list(rows))

    def finish() -> None:
        _wait_all(works)
        if n == 2:
            # One addition per element: the same bits as the sum in rank order,
            # without first copying this rank's own chunk into the scratch.
            mine, theirs = chunks[me], rows[1 - me]
            torch.add(*((mine, theirs) if me == 0 else (theirs, mine)), out=output)
            return
        rows[me].copy_(chunks[me])
        sum_in_rank_order(rows, output)
    return finish


def start_all_gather(group: dist.ProcessGroup, output: torch.Tensor,
                     input: torch.Tensor) -> Callable[[], None]:
    """Post an all-gather (every rank's ``input`` lands at chunk ``group rank`` of
    ``output``); the returned function waits for it.

    ``input`` may be this rank's chunk of ``output`` (in place); it must not
    overlap any other chunk.
    """
    n, me = dist.get_world_size(group), dist.get_rank(group)
    chunks = list(output.view(n, -1))
    if input.data_ptr() != chunks[me].data_ptr():
        chunks[me].copy_(input)
    works = post_exchange(group, [chunks[me]] * n, chunks)
    return lambda: _wait_all(works)
