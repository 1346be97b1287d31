"""Reduce-scatter and all-gather on gloo as point-to-point pieces: exact results."""
from __future__ import annotations

import pytest
import torch

from .dist_harness import run_distributed


def _inputs(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(numel, generator=gen).to(dtype)


def _check(rank, world, piece_bytes, dtypes, chunk_sizes):
    """Every rank rebuilds the others' inputs from their seeds and checks its
    results against the sum in rank order and the concatenation; returns how
    many results differ bitwise."""
    import torch.distributed as dist

    from fgpsdp_runtime import gloo_collectives
    from fgpsdp_runtime.group_collectives import all_gather_blocking, reduce_scatter_blocking

    gloo_collectives.PIECE_BYTES = piece_bytes  # many pieces per message
    group = dist.new_group(list(range(world)))
    mismatches = 0
    for dtype in dtypes:
        for chunk in chunk_sizes:
            inputs = [_inputs(r, chunk * world, dtype) for r in range(world)]
            out = torch.full((chunk,), float("nan"), dtype=dtype)
            reduce_scatter_blocking(group, out, inputs[rank])
            expected = torch.sum(torch.stack([x.view(world, -1)[rank] for x in inputs]), dim=0)
            mismatches += not torch.equal(out, expected)

            gathered = torch.full((chunk * world,), float("nan"), dtype=dtype)
            all_gather_blocking(group, gathered, inputs[rank][:chunk])
            mismatches += not torch.equal(gathered, torch.cat([x[:chunk] for x in inputs]))

            # In place, as the wrapper calls it: the input is this rank's chunk.
            flat = torch.cat([x[:chunk] if r == rank else torch.zeros(chunk, dtype=dtype)
                              for r, x in enumerate(inputs)])
            all_gather_blocking(group, flat, flat[rank * chunk:(rank + 1) * chunk])
            mismatches += not torch.equal(flat, torch.cat([x[:chunk] for x in inputs]))
    return mismatches


@pytest.mark.parametrize("world", [2, 3])
def test_point_to_point_collectives_are_exact(world):
    # 64-byte pieces: a 1000-element float32 chunk is 63 messages per peer,
    # the last one short; 7 elements is one short message.
    results = run_distributed(world, _check, 64, [torch.float32, torch.bfloat16, torch.float64],
                              [7, 1000, 16])
    assert results == [0] * world


def _wrong_size(rank, world):
    import torch.distributed as dist

    from fgpsdp_runtime.group_collectives import reduce_scatter_blocking
    try:
        reduce_scatter_blocking(dist.group.WORLD, torch.empty(3), torch.empty(7))
    except ValueError as error:
        return str(error)
    return None


def test_reduce_scatter_rejects_mismatched_sizes():
    for message in run_distributed(2, _wrong_size):
        assert message is not None and "reduce-scatter sizes" in message


def _calls_in_flight(rank, world, piece_bytes):
    """Several calls posted on one group before any is waited for, as a link
    worker with calls in flight does; returns how many results differ bitwise."""
    import torch.distributed as dist

    from fgpsdp_runtime import gloo_collectives
    from fgpsdp_runtime.group_collectives import start_all_gather, start_reduce_scatter

    gloo_collectives.PIECE_BYTES = piece_bytes
    group = dist.new_group(list(range(world)))
    calls = []
    for i, chunk in enumerate([1000, 7, 333, 64]):
        inputs = [_inputs(r + 10 * i, chunk * world, torch.float32) for r in range(world)]
        out = torch.full((chunk,), float("nan"))
        finish = start_reduce_scatter(group, out, inputs[rank], scratch_slots=4)
        expected = torch.sum(torch.stack([x.view(world, -1)[rank] for x in inputs]), dim=0)
        calls.append((finish, out, expected))
        gathered = torch.full((chunk * world,), float("nan"))
        finish = start_all_gather(group, gathered, inputs[rank][:chunk], scratch_slots=4)
        calls.append((finish, gathered, torch.cat([x[:chunk] for x in inputs])))
    mismatches = 0
    for finish, out, expected in calls:  # finished in posting order, as the worker does
        finish()
        mismatches += not torch.equal(out, expected)
    return mismatches


@pytest.mark.parametrize("world", [2, 3])
def test_calls_in_flight_on_one_group_do_not_mix(world):
    # 64-byte pieces: every call is many messages per peer with the same tags.
    assert run_distributed(world, _calls_in_flight, 64) == [0] * world


def test_every_receive_is_posted_before_any_send(monkeypatch):
    # gloo sends a message's data only once the receiver's notification has come
    # back, in the same TCP stream as the receiver's own data; a receive posted
    # after a send would queue that notification behind the send's data
    # ([Note: receives first] in gloo_collectives.py). Order only: no link here.
    import torch.distributed as dist

    from fgpsdp_runtime import gloo_collectives

    posted = []
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: 10 + rank)
    monkeypatch.setattr(dist, "isend", lambda t, peer, group=None, tag=0:
                        posted.append(("send", peer, tag, t.numel())))
    monkeypatch.setattr(dist, "irecv", lambda t, peer, group=None, tag=0:
                        posted.append(("recv", peer, tag, t.numel())))
    monkeypatch.setattr(gloo_collectives, "PIECE_BYTES", 16)  # 4 float32 per piece
    sends = [torch.zeros(10) for _ in range(3)]
    recvs = [torch.zeros(10) for _ in range(3)]
    works = gloo_collectives.post_exchange(object(), sends, recvs)

    kinds = [kind for kind, *_ in posted]
    assert len(works) == len(posted) == 2 * 2 * 3  # 2 peers, 3 pieces each way
    assert kinds == ["recv"] * 6 + ["send"] * 6
    # Within each side: piece by piece, peers from the next rank on.
    expected = [(peer, tag, numel) for tag, numel in enumerate([4, 4, 2]) for peer in (12, 10)]
    assert [p[1:] for p in posted if p[0] == "recv"] == expected
    assert [p[1:] for p in posted if p[0] == "send"] == expected


def _exchange(rank, world, piece_bytes):
    """exchange_bytes with sizes that differ by pair and by direction, some empty,
    through both paths; returns how many received tensors differ from what their
    sender filled them with."""
    import torch.distributed as dist

    from fgpsdp_runtime import gloo_collectives
    from fgpsdp_runtime.group_collectives import exchange_bytes

    gloo_collectives.PIECE_BYTES = piece_bytes  # several pieces per message

    def size(src, dst):  # 0 from rank 1 to rank 0 and between equal ranks
        return 0 if (src, dst) == (1, 0) or src == dst else 3 + 5 * src + 2 * dst

    def payload(src, dst):
        gen = torch.Generator().manual_seed(10 * src + dst)
        return torch.randint(0, 256, (size(src, dst),), generator=gen, dtype=torch.uint8)

    mismatches = 0
    for point_to_point in (True, False):
        sends = [payload(rank, j) for j in range(world)]
        recvs = [torch.full((size(j, rank),), 7, dtype=torch.uint8) for j in range(world)]
        exchange_bytes(dist.group.WORLD, sends, recvs, "test", point_to_point=point_to_point)
        mismatches += sum(not torch.equal(recvs[j], payload(j, rank))
                          for j in range(world) if j != rank)
    return mismatches


@pytest.mark.parametrize("world", [2, 3])
def test_byte_exchange_of_uneven_sizes_is_exact(world):
    """The all-to-all of MuonWithAdamW's matrices: point-to-point pieces on gloo,
    all_to_all_single (NCCL's path) otherwise; empty pairs send nothing."""
    assert run_distributed(world, _exchange, 4) == [0] * world
