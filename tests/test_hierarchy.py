"""Hierarchical (two-level) communication: topology, equivalence, byte accounting."""
import functools
import os
import subprocess
import sys

import pytest
import torch

from fgpsdp_runtime.topology import NodeLayout, Topology, resolve

from .dist_harness import run_distributed
from .scenarios import comm_stats_around_a_reset, train_many
from .test_equivalence import SCENARIOS, TOL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A subset of the DDP-equivalence scenarios, under each topology.
HIER_SCENARIOS = ("adamw_groups", "clip_triggers", "no_sync", "unused", "bn_frozen",
                  "small_buckets")
TOPOLOGIES = {"2x2": (4, {"local_size": 2}), "2x3": (6, {"local_size": 3}),
              "flat4": (4, {"flat": True})}


@functools.lru_cache(maxsize=None)
def results(topology: str):
    world, extra = TOPOLOGIES[topology]
    cfgs = {name: dict(SCENARIOS[name], steps=5, **extra) for name in HIER_SCENARIOS}
    return run_distributed(world, train_many, cfgs, timeout_s=600)


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
@pytest.mark.parametrize("scenario", HIER_SCENARIOS)
def test_matches_torch_ddp(topology, scenario):
    per_rank = [r[scenario] for r in results(topology)]
    for rank, res in enumerate(per_rank):
        assert res["param_diff"] <= TOL, f"rank {rank}: params differ by {res['param_diff']}"
        assert res["buffer_diff"] <= TOL
    assert sum(r["local_numel"] for r in per_rank) == per_rank[0]["trainable"]
    assert sorted(r["slice_index"] for r in per_rank) == list(range(len(per_rank)))


@pytest.mark.parametrize("topology", ["2x2", "2x3"])
def test_inter_node_bytes_match_theory(topology):
    world, extra = TOPOLOGIES[topology]
    local = extra["local_size"]
    nodes = world // local
    per_rank = [r["small_buckets"] for r in results(topology)]
    steps = 5
    bucket_bytes = sum(per_rank[0]["bucket_bytes"])
    for rank, res in enumerate(per_rank):
        stats = res["comm_stats"]
        assert set(stats) == {"intra", "inter"}
        for phase in ("reduce_scatter", "all_gather"):
            # Per phase: (nodes-1)/nodes x bucket bytes / local_size per rank, per step.
            expected_inter = steps * sum((nodes - 1) * b // local // nodes
                                         for b in res["bucket_bytes"])
            assert stats["inter"][phase] == expected_inter, (rank, phase)
            expected_intra = steps * sum((local - 1) * b // local for b in res["bucket_bytes"])
            assert stats["intra"][phase] == expected_intra, (rank, phase)
        assert stats == per_rank[0]["comm_stats"], "balanced: equal on every rank"
    # The slow link carries 1/local_size of what a flat ring would put on it.
    assert per_rank[0]["comm_stats"]["inter"]["reduce_scatter"] * local * nodes \
        == steps * (nodes - 1) * bucket_bytes


def test_flat_counts_flat_link():
    stats = results("flat4")[0]["small_buckets"]["comm_stats"]
    assert set(stats) == {"flat"}


def test_resolve_and_slice_mapping():
    layout = resolve(Topology(local_size=2), 6)
    assert (layout.nodes, layout.local_size, layout.uses_hierarchy) == (3, 2, True)
    # rank r = node * local + l owns slice l * nodes + node
    assert [layout.slice_index(r) for r in range(6)] == [0, 3, 1, 4, 2, 5]
    assert layout.intra_ranks(1) == [2, 3] and layout.rail_ranks(1) == [1, 3, 5]
    assert not resolve("flat", 4).uses_hierarchy
    assert [resolve("flat", 4).slice_index(r) for r in range(4)] == [0, 1, 2, 3]
    assert not resolve(Topology(local_size=4), 4).uses_hierarchy  # one node


@pytest.mark.parametrize("arg, world, message", [
    (Topology(local_size=4), 6, "not divisible"),
    (Topology(local_size=0), 4, "positive integer"),
    ("rings", 4, "Topology, 'flat' or 'auto'"),
])
def test_bad_topology(arg, world, message):
    with pytest.raises(ValueError, match=message):
        resolve(arg, world)


def test_local_size_from_torchrun_env(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert resolve(None, 6) == NodeLayout(world_size=6, local_size=3, hierarchical=True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="does not divide"):
        resolve(None, 6)


@pytest.mark.parametrize("local_world_size, members, local_size", [
    (4, [0, 1], 2),           # data parallel inside one node of 4 (tensor parallel 2)
    (2, [0, 2], 1),           # one rank on each of two nodes: inter-node links only
    (2, [0, 1, 4, 5], 2),     # two of the four nodes of 2
    (2, [0, 1, 2], 1),        # uneven over the nodes: no hierarchy
    (4, [1, 3, 5, 7], 2),     # every other rank of two nodes of 4
])
def test_subgroup_local_size_from_torchrun_env(monkeypatch, local_world_size, members,
                                               local_size):
    """LOCAL_WORLD_SIZE counts the node's ranks: a subgroup gets its members per node
    (before, it was taken as the subgroup's own and raised, or made one node of two)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world_size))
    assert resolve(None, len(members), members).local_size == local_size
    assert resolve("flat", len(members), members).local_size == local_size


def test_two_torchrun_agents_detect_topology(tmp_path):
    """Two torchrun agents with --nnodes=2 on one host: topology from torchrun's environment."""
    # A port no store or gloo socket of a test beside this one (pytest -n) can take
    # before node 0's agent binds it.
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        from compare_runs import free_port_below_ephemeral_range
    finally:
        sys.path.pop(0)
    port = free_port_below_ephemeral_range()
    script = os.path.join(ROOT, "tests", "torchrun_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
         f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}",
         script, str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for node in range(2)]
    outputs = []
    for p in procs:
        out, _ = p.communicate(timeout=240)
        outputs.append(out.decode(errors="replace"))
        assert p.returncode == 0, outputs[-1][-3000:]
    lines = sorted((tmp_path / f"rank{r}.txt").read_text() for r in range(4))
    # rank, node, local, slice, param diff
    assert lines == sorted(f"{r} {r // 2} {r % 2} {(r % 2) * 2 + r // 2} ok" for r in range(4))


def test_flat_on_nodes_of_different_sizes(monkeypatch):
    """torchrun agents with --nproc_per_node 2 and 1 (world 3): 'flat' runs, as torch DDP
    does (it was refused: LOCAL_WORLD_SIZE must divide the world); the hierarchy still
    needs equal nodes."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    layout = resolve("flat", 3)
    assert not layout.uses_hierarchy and layout.nodes > 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert layout.summary() == resolve("flat", 3).summary()  # the other node's rank agrees
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="does not divide"):
        resolve(None, 3)
    # Nodes of 4 and 2 (world 6): the small node's size divides the world, the
    # large one's does not; both resolve to what the ranks compare alike.
    small = resolve("flat", 6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve("flat", 6).summary() == small.summary()
    assert not small.uses_hierarchy and small.slice_index(5) == 5


def _flat_on_uneven_nodes(rank, world_size):
    from torch import nn

    import fgpsdp_runtime as fgp
    os.environ.update(LOCAL_WORLD_SIZE="2" if rank < 2 else "1",
                      GROUP_RANK="0" if rank < 2 else "1",
                      LOCAL_RANK=str(rank % 2 if rank < 2 else 0))
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = fgp.DistributedDataParallel(module, topology="flat")
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1, max_grad_norm=0.5)
    for step in range(3):
        torch.manual_seed(step + 10 * rank)
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()
    return [p.detach().clone() for p in model.module.parameters()]


def test_flat_trains_on_nodes_of_different_sizes():
    ranks = run_distributed(3, _flat_on_uneven_nodes, timeout_s=120)
    for other in ranks[1:]:
        assert all(torch.equal(a, b) for a, b in zip(ranks[0], other))


def test_reset_comm_stats_starts_the_count_again():
    for seen in run_distributed(2, comm_stats_around_a_reset, timeout_s=120):
        assert seen["after the reset"] == {}
        assert seen["after step 1"] == seen["after step 0"]
        assert seen["after step 0"]["flat"]["total"] > 0
