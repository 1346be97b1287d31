"""Intra-node collectives through shared memory: the same bytes as gloo's path."""
from __future__ import annotations

import os

import pytest
import torch

from fgpsdp_runtime.shared_memory import remove_stale_regions, shared_memory_dir

from .dist_harness import run_distributed

pytestmark = pytest.mark.skipif(shared_memory_dir() is None, reason="no writable /dev/shm")


def _compare_with_gloo(rank, world, dtypes, sizes, max_slot_bytes):
    """Every op through shared memory and through gloo; returns how many differ bitwise."""
    import torch.distributed as dist

    from fgpsdp_runtime.group_collectives import all_gather_blocking, reduce_scatter_blocking
    from fgpsdp_runtime.shared_memory import SharedMemoryCollectives

    group = dist.new_group(list(range(world)))
    rs = SharedMemoryCollectives(group, max_slot_bytes=max_slot_bytes)
    ag = SharedMemoryCollectives(group, max_slot_bytes=max_slot_bytes)
    mismatches = 0
    gen = torch.Generator().manual_seed(1234 + rank)
    for dtype in dtypes:
        for chunk in sizes:  # grows and shrinks: the region is reallocated only to grow
            x = torch.randn(chunk * world, generator=gen).to(dtype)
            ours, ref = torch.empty(chunk, dtype=dtype), torch.empty(chunk, dtype=dtype)
            assert rs.reduce_scatter(ours, x)
            reduce_scatter_blocking(group, ref, x)
            mismatches += not torch.equal(ours, ref)
            mine = torch.randn(chunk, generator=gen).to(dtype)
            out, ref_out = torch.full((chunk * world,), -1.0, dtype=dtype), \
                torch.empty(chunk * world, dtype=dtype)
            assert ag.all_gather(out, mine)
            all_gather_blocking(group, ref_out, mine)
            mismatches += not torch.equal(out, ref_out)
    # In place, as the hierarchy calls it: the input is this rank's chunk of the output.
    flat = torch.arange(world * 8, dtype=torch.float32) * (rank + 1)
    shm2 = SharedMemoryCollectives(group, max_slot_bytes=max_slot_bytes)
    assert shm2.all_gather(flat, flat[rank * 8:(rank + 1) * 8])
    expected = torch.cat([torch.arange(r * 8, (r + 1) * 8, dtype=torch.float32) * (r + 1)
                          for r in range(world)])
    mismatches += not torch.equal(flat, expected)
    # Rank 0 created the files; each is unlinked once every rank has mapped it.
    leftovers = [f for f in os.listdir(shared_memory_dir())
                 if f.startswith(f"fgpsdp-{os.getpid()}-")]
    return mismatches, (rs.allocations, ag.allocations), leftovers


# 5 ranks: torch.sum's order over 5 or more float32 rows depended on their length,
# and shared memory's rounds cut the rows where gloo's whole-chunk sum did not.
@pytest.mark.parametrize("world", [2, 3, 5])
def test_shared_memory_matches_gloo_bitwise(world):
    sizes = [5, 1000, 40000, 7]
    results = run_distributed(world, _compare_with_gloo,
                              [torch.float32, torch.bfloat16, torch.float64], sizes, 2**20)
    for mismatches, allocations, _ in results:
        assert mismatches == 0
        # Grown for each larger float32 size and once for float64; never shrunk.
        assert allocations == (4, 4)
    assert results[0][2] == []


@pytest.mark.parametrize("world", [2, 3, 5])
def test_large_buckets_move_in_rounds(world):
    """A slot of 256 bytes: every op above 256 / (4 world) float32 elements per rank
    takes several rounds (with uneven last pieces); the region never grows past one slot."""
    results = run_distributed(world, _compare_with_gloo, [torch.float32, torch.float64],
                              [1000, 33, 4097], 256)
    for mismatches, allocations, _ in results:
        assert mismatches == 0
        assert allocations == (1, 1)


def _private_dirs(rank, world, base):
    """Each rank looks in a directory of its own: the region cannot be shared."""
    import warnings

    import torch.distributed as dist

    from fgpsdp_runtime.shared_memory import SharedMemoryCollectives

    directory = os.path.join(base, f"rank{rank}")
    os.makedirs(directory, exist_ok=True)
    shm = SharedMemoryCollectives(dist.new_group(list(range(world))), directory=directory)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        used = shm.reduce_scatter(torch.empty(4), torch.ones(4 * world))
    return used, shm.enabled, [str(w.message) for w in caught], os.listdir(directory)


def test_every_rank_falls_back_when_one_cannot_map(tmp_path):
    results = run_distributed(3, _private_dirs, str(tmp_path))
    for used, enabled, messages, files in results:
        assert not used and not enabled
        assert any("cannot use shared memory" in m for m in messages)
        assert files == []  # rank 0 removed what it created


def _a_rank_dies_setting_up_a_region(rank, world, base, when):
    """The first reduce-scatter maps a region; a rank dies on the way (os._exit, as
    SIGKILL), and the survivor reports what it raised.

    ``peer``: rank 1 dies as rank 0 creates the region: rank 0's broadcast of its
    name fails. ``owner``: local rank 0 dies after broadcasting the name, before its
    unlink: rank 1, in the all-reduce that follows, knows the name."""
    import torch.distributed as dist

    from fgpsdp_runtime.shared_memory import SharedMemoryCollectives

    shm = SharedMemoryCollectives(dist.new_group(list(range(world))), directory=base)
    dist.barrier()
    if when == "peer" and rank == 1:
        os._exit(0)
    if when == "owner" and rank == 0:
        real_all_reduce = dist.all_reduce

        def dies_at_the_mapping_vote(tensor, *args, **kwargs):
            if tensor.dtype == torch.int32:  # the "every rank mapped it" vote
                os._exit(0)
            return real_all_reduce(tensor, *args, **kwargs)
        dist.all_reduce = dies_at_the_mapping_vote
    with open(os.path.join(base, "..", f"rank{rank}-raised"), "w") as f:
        try:
            shm.reduce_scatter(torch.empty(4), torch.ones(4 * world))
        except RuntimeError as error:
            f.write(type(error).__name__)


def test_a_peer_dying_while_a_region_is_mapped_leaves_no_file(tmp_path):
    base = tmp_path / "shm"
    base.mkdir()
    with pytest.raises(RuntimeError, match="rank 1 died without a result"):
        run_distributed(2, _a_rank_dies_setting_up_a_region, str(base), "peer",
                        pg_timeout_s=20)
    assert (tmp_path / "rank0-raised").read_text() == "RuntimeError"
    assert os.listdir(base) == []  # before: the region's file stayed in tmpfs for good


def test_the_owner_dying_after_naming_a_region_leaves_no_file(tmp_path):
    base = tmp_path / "shm"
    base.mkdir()
    with pytest.raises(RuntimeError, match="rank 0 died without a result"):
        run_distributed(2, _a_rank_dies_setting_up_a_region, str(base), "owner",
                        pg_timeout_s=20)
    assert (tmp_path / "rank1-raised").read_text() == "RuntimeError"
    assert os.listdir(base) == []  # before: the file stayed until a later job's sweep


def _train_and_report(rank, world, local_size, shared_memory):
    import fgpsdp_runtime as fgp
    from fgpsdp_runtime.topology import Topology

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model = fgp.DistributedDataParallel(
        module, bucket_cap_mb=0.001,
        topology=Topology(local_size=local_size, shared_memory=shared_memory))
    at_construction = model.node_transport  # probed when the wrapper is built
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2, max_grad_norm=1.0)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(8, 16, generator=gen)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.synchronize()
    params = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    assert at_construction == model.node_transport
    return model.node_transport, params


@pytest.mark.parametrize("world,local_size", [(4, 2), (3, 3)])
def test_training_through_shared_memory_matches_gloo(world, local_size):
    """Hierarchy (2 nodes x 2) and one node of 3 (flat): the same parameters bitwise."""
    shm = run_distributed(world, _train_and_report, local_size, True)
    gloo = run_distributed(world, _train_and_report, local_size, False)
    assert [t for t, _ in shm] == ["shared_memory"] * world
    assert [t for t, _ in gloo] == ["gloo"] * world
    for (_, a), (_, b) in zip(shm, gloo):
        assert torch.equal(a, b)
    assert all(torch.equal(shm[0][1], p) for _, p in shm)


def test_env_switch(monkeypatch):
    from fgpsdp_runtime.topology import resolve

    monkeypatch.delenv("FGPSDP_SHARED_MEMORY", raising=False)
    assert resolve(None, 4).shared_memory
    monkeypatch.setenv("FGPSDP_SHARED_MEMORY", "0")
    assert not resolve(None, 4).shared_memory


def test_regions_left_by_a_killed_job_are_removed(tmp_path):
    """A SIGTERM while local rank 0 waits for its peers to map a new region skips its
    unlink: the next region's creation removes such files, and only those (their
    creator gone, older than a region's name lives)."""
    import subprocess
    import sys
    import time
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is free now (reused this soon: unlikely)
    hexname = "0" * 32
    old = time.time() - 3600
    files = {"left": f"fgpsdp-{dead.pid}-{hexname}",
             "fresh": f"fgpsdp-{dead.pid}-{'1' * 32}",            # still being mapped, maybe
             "alive": f"fgpsdp-{os.getppid()}-{hexname}",          # its creator runs
             "own": f"fgpsdp-{os.getpid()}-{hexname}",
             "other": f"fgpsdp-{dead.pid}-notaregion"}
    for key, name in files.items():
        (tmp_path / name).write_bytes(b"x")
        if key != "fresh":
            os.utime(tmp_path / name, (old, old))
    assert remove_stale_regions(str(tmp_path)) == [files["left"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        name for key, name in files.items() if key != "left")
