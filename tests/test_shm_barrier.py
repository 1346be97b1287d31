"""The shared-memory collectives' barrier (shm_barrier.py): counts in the region, a
record lock per rank for liveness, the group's timeout, and gloo's barrier where a
rank cannot take part."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import torch

from fgpsdp_runtime.shared_memory import shared_memory_dir
from fgpsdp_runtime.shm_barrier import native_barrier_wanted

from .dist_harness import run_distributed

pytestmark = [
    pytest.mark.skipif(shared_memory_dir() is None, reason="no writable /dev/shm"),
    pytest.mark.skipif(not native_barrier_wanted(), reason="no counts barrier in this build"),
]


def _region_files_open() -> int:
    """Descriptors of this process open on region files (the barriers' locks)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "/fgpsdp-" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return n


def _many_rounds(rank, world):
    """Many barriers in a row through both collectives, with regions regrown: the same
    bytes as gloo's barrier gives, one lock descriptor per live instance, none after."""
    import gc

    import torch.distributed as dist

    from fgpsdp_runtime.group_collectives import all_gather_blocking, reduce_scatter_blocking
    from fgpsdp_runtime.shared_memory import SharedMemoryCollectives

    group = dist.new_group(list(range(world)))
    shm = SharedMemoryCollectives(group, max_slot_bytes=4096)  # big inputs: many rounds
    assert shm.prepare(world)
    native = shm._region_barrier is not None
    gen = torch.Generator().manual_seed(rank)
    mismatches = 0
    for chunk in (3, 500, 5000, 20000, 7):
        x = torch.randn(chunk * world, generator=gen)
        ours, ref = torch.empty(chunk), torch.empty(chunk)
        for _ in range(5):
            assert shm.reduce_scatter(ours, x)
        reduce_scatter_blocking(group, ref, x)
        mismatches += not torch.equal(ours, ref)
        out, ref_out = torch.empty(chunk * world), torch.empty(chunk * world)
        assert shm.all_gather(out, x[:chunk])
        all_gather_blocking(group, ref_out, x[:chunk])
        mismatches += not torch.equal(out, ref_out)
    open_with, allocations = _region_files_open(), shm.allocations
    del shm
    gc.collect()
    return native, mismatches, allocations, open_with, _region_files_open()


@pytest.mark.parametrize("world", [2, 3])
def test_counts_barrier_runs_many_rounds_and_keeps_one_lock(world):
    for native, mismatches, allocations, open_with, open_after in run_distributed(
            world, _many_rounds):
        assert native and mismatches == 0
        assert allocations >= 2  # regrown: the old region's lock was let go
        assert (open_with, open_after) == (1, 0)


def _one_rank_cannot_lock(rank, world):
    """Rank 1 cannot lock its byte: every rank agrees on gloo's barrier, results equal."""
    import torch.distributed as dist

    from fgpsdp_runtime import shared_memory
    from fgpsdp_runtime.group_collectives import reduce_scatter_blocking

    if rank == 1:
        shared_memory.open_region_barrier = lambda *args: None
    group = dist.new_group(list(range(world)))
    shm = shared_memory.SharedMemoryCollectives(group)
    x = torch.randn(40 * world, generator=torch.Generator().manual_seed(rank))
    ours, ref = torch.empty(40), torch.empty(40)
    assert shm.reduce_scatter(ours, x)
    reduce_scatter_blocking(group, ref, x)
    return shm._region_barrier is None, torch.equal(ours, ref), _region_files_open()


def test_a_rank_that_cannot_lock_makes_every_rank_use_gloos_barrier():
    assert run_distributed(3, _one_rank_cannot_lock) == [(True, True, 0)] * 3


def _report_one_reduce_scatter(shm, out, x, path):
    """Run one reduce-scatter and write what it raised and how long it took."""
    start = time.monotonic()
    try:
        shm.reduce_scatter(out, x)
        outcome = {"raised": None}
    except RuntimeError as error:
        outcome = {"raised": str(error)}
    outcome["seconds"] = time.monotonic() - start
    with open(path, "w") as f:
        json.dump(outcome, f)


def _peer_never_arrives(rank, world, report_dir):
    """Rank 0 does not arrive (it sleeps past its group's 3 s timeout); rank 1 fails
    at the timeout, not sooner and not never."""
    from datetime import timedelta

    import torch.distributed as dist

    from fgpsdp_runtime.shared_memory import SharedMemoryCollectives

    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=3))
    shm = SharedMemoryCollectives(group)
    out, x = torch.empty(8), torch.ones(8 * world)
    shm.reduce_scatter(out, x)
    if rank == 0:
        time.sleep(6)
        return None
    _report_one_reduce_scatter(shm, out, x, os.path.join(report_dir, "rank1.json"))


def test_a_peer_that_never_arrives_fails_the_wait_at_the_groups_timeout(tmp_path):
    run_distributed(2, _peer_never_arrives, str(tmp_path))
    outcome = json.loads((tmp_path / "rank1.json").read_text())
    assert "the group's timeout" in (outcome["raised"] or ""), outcome
    assert 2.9 < outcome["seconds"] < 5.5, outcome


def _killed_before_arriving(rank, world, report_dir):
    """Local rank 0 freezes (SIGSTOP) before arriving at a barrier and is SIGKILLed
    1 s later; the others wait in the counts barrier, in no gloo call that could see
    its connections close: its lock gone tells them."""
    import torch.distributed as dist

    from fgpsdp_runtime.shared_memory import SharedMemoryCollectives

    shm = SharedMemoryCollectives(dist.new_group(list(range(world))))
    out, x = torch.empty(8), torch.ones(8 * world)
    for _ in range(3):
        shm.reduce_scatter(out, x)
    if rank == 0:
        subprocess.Popen(["sh", "-c", f"sleep 1; kill -9 {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
    _report_one_reduce_scatter(shm, out, x, os.path.join(report_dir, f"rank{rank}.json"))


def test_survivors_see_a_killed_local_rank_gone_from_the_counts_barrier(tmp_path):
    with pytest.raises(RuntimeError, match="rank 0 died without a result"):
        run_distributed(3, _killed_before_arriving, str(tmp_path), pg_timeout_s=60,
                        timeout_s=120)
    outcomes = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (1, 2)]
    # One sees the lock gone (or both do); the other may see the flag the first one
    # set as it failed.
    gone = "local rank 0 of the intra shared-memory link has exited"
    flagged = "a rank of the intra shared-memory link failed in a collective"
    assert any(gone in (o["raised"] or "") for o in outcomes), outcomes
    for o in outcomes:
        assert gone in o["raised"] or flagged in o["raised"], outcomes
        # killed about 1 s after the others began to wait (the timeout: 60 s)
        assert o["seconds"] < 5, outcomes


def test_an_extension_built_before_the_barrier_means_gloos_barrier(monkeypatch):
    from fgpsdp_runtime import ops, shm_barrier

    class OlderBuild:  # the kernels, no barrier functions
        multi_tensor_pack = staticmethod(lambda *args: None)
    monkeypatch.setattr(ops, "_C", OlderBuild())
    assert not shm_barrier.native_barrier_wanted()
    monkeypatch.undo()
    assert shm_barrier.native_barrier_wanted()
    monkeypatch.setenv("FGPSDP_SHM_BARRIER", "gloo")
    assert not shm_barrier.native_barrier_wanted()
