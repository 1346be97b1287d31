"""Wrappers on subgroups: pipeline stages (or any split of the job) that each train
data-parallel over a group of their own, wrapped at the same time."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fgpsdp_runtime as fgp

from .dist_harness import regroup_without_a_backend, run_distributed, skip_with_a_gpu
from .scenarios import MLP, param_diff, train_both


def _disjoint_subgroups(rank: int, world_size: int, torchrun_env: bool) -> dict:
    """Ranks 0-1 and 2-3 wrap on their own groups, each beside torch DDP there.
    ``torchrun_env``: the four are one torchrun node (LOCAL_WORLD_SIZE=4), and the
    topology comes from there."""
    if torchrun_env:
        os.environ.update(LOCAL_WORLD_SIZE="4", LOCAL_RANK=str(rank), GROUP_RANK="0")
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    group = pairs[rank // 2]
    torch.manual_seed(1234 + rank)
    base = MLP()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), process_group=group)
    ours = fgp.DistributedDataParallel(base, process_group=group,
                                       topology=None if torchrun_env else "flat")
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    train_both([(ours, opt), (ref, ref_opt)], rank, 3)
    ours.synchronize()
    diff = param_diff(ours, ref)
    names: list = [None] * world_size
    dist.all_gather_object(names, sorted(g.group_name for g in ours._own_groups))
    # A group every rank creates after the wrappers: the same one everywhere.
    everyone = dist.new_group(list(range(world_size)))
    total = torch.ones(1)
    dist.all_reduce(total, group=everyone)
    return {"diff": diff, "names": names, "total": float(total),
            "nodes_x_local": (ours.topology.nodes, ours.topology.local_size)}


@pytest.mark.parametrize("torchrun_env", [False, True])
def test_wrappers_on_disjoint_subgroups_train_like_torch_ddp(torchrun_env):
    """Before, both pairs' own groups got the same names (torch numbers groups per
    process), so their gloo rendezvous shared store keys: an error or a hang, at
    random (2 runs in 6 passed). Under torchrun's environment, LOCAL_WORLD_SIZE=4
    was taken as the pair's own: it raised that 4 does not divide 2."""
    results = run_distributed(4, _disjoint_subgroups, torchrun_env, timeout_s=180)
    for rank, res in enumerate(results):
        assert res["diff"] == 0.0, (rank, res["diff"])  # two ranks per group: bitwise
        assert res["total"] == 4.0
    names = results[0]["names"]
    assert names[0] == names[1] and names[2] == names[3]  # the members agree
    assert not set(names[0]) & set(names[2]), names
    assert all(res["nodes_x_local"] == (1, 2) for res in results)  # a pair on one node


def _asymmetric_members(rank: int, world_size: int) -> object:
    """Ranks 0-1 train on [0, 1]; rank 0 is also in [0, 2] (an evaluator it talks to):
    the members hold different numbers of groups."""
    dp, side = dist.new_group([0, 1]), dist.new_group([0, 2])
    if rank in (0, 2):
        # Rank 2 tears its groups down as it returns: not before rank 0 has finished
        # connecting to it (once in CI, rank 0's gloo connectFullMesh saw it close).
        dist.barrier(group=side)
    if rank == 2:
        return None
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(nn.Linear(4, 4), process_group=dp, topology="flat")
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    model.synchronize()
    return [p.detach().clone() for p in model.module.parameters()]


def _rewrapped_beside_another(rank: int, world_size: int) -> object:
    """G and D on [0, 1]; G dropped and wrapped again (to unfreeze layers): the
    dropped groups lower the count torch hashes, to one D's groups were named with."""
    import gc
    group = dist.new_group([0, 1])
    if rank == 2:
        return None
    torch.manual_seed(0)
    g_module, d_module = nn.Linear(4, 4), nn.Linear(4, 4)
    g = fgp.DistributedDataParallel(g_module, process_group=group, topology="flat")
    d = fgp.DistributedDataParallel(d_module, process_group=group, topology="flat")  # noqa: F841
    del g
    gc.collect()
    g = fgp.DistributedDataParallel(g_module, process_group=group, topology="flat")
    opt = fgp.ShardedOptimizer(g, torch.optim.SGD, lr=0.1)
    g(torch.randn(2, 4)).sum().backward()
    opt.step()
    g.synchronize()
    return [p.detach().clone() for p in g.module.parameters()]


@pytest.mark.parametrize("scenario", [_asymmetric_members, _rewrapped_beside_another])
def test_subgroup_wrappers_where_hashed_names_would_not_agree(scenario):
    """Members holding different numbers of groups: torch 2.13's hash would differ
    between them (a hang); a dropped wrapper's names would come back beside a live
    one's. The wrapper's own names agree and never come back."""
    results = run_distributed(3, scenario, timeout_s=120, pg_timeout_s=20)
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1]))


def _rewrapped_one_member_late(rank: int, world_size: int) -> dict:
    """Pairs [0, 1] and [2, 3] wrap, train, drop the wrapper and wrap again, one
    member of each pair a while after the other (a slower data loader), then both at
    once. With torch's hashed names (up to 2.13) the new groups got the dropped
    ones' names, and the member arriving first read its peer's address of the old
    rendezvous from the store: gloo's connection refused. The wrapper's own names
    never come back."""
    import gc
    import time
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = pairs[rank // 2]
    module = MLP()
    held, names = [], []
    for phase in range(3):
        if phase == 1 and rank % 2:
            time.sleep(2.0)
        model = fgp.DistributedDataParallel(module, process_group=group, topology="flat")
        opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
        train_both([(model, opt)], rank, 2)
        names.append(sorted(g.group_name for g in model._own_groups))
        del model, opt
        gc.collect()
        held.append(len(dist.distributed_c10d._world.pg_names))
    return {"held": held, "names": names}


def test_a_subgroup_wrapper_rebuilt_with_one_member_late():
    results = run_distributed(4, _rewrapped_one_member_late, timeout_s=180, pg_timeout_s=30)
    for res in results:
        assert res["held"][0] == res["held"][1] == res["held"][2], res
        assert len({name for phase in res["names"] for name in phase}) == 6, res  # all new
    for a, b in (results[0], results[1]), (results[2], results[3]):
        assert a["names"] == b["names"]  # the members of a pair agree, phase by phase
    assert not set(results[0]["names"][0]) & set(results[2]["names"][0])  # pairs apart


def _overlapping_subgroups(rank: int, world_size: int) -> object:
    """Rank 0 is in [0, 1] and [0, 2] and wraps on both, its peers on theirs: the
    members hold different numbers of groups (torch 2.13's hash differed, and its
    counter fallback named [0, 2]'s groups as [0, 1]'s: a hang)."""
    a, b = dist.new_group([0, 1]), dist.new_group([0, 2])
    params = []
    for group, members in ((a, (0, 1)), (b, (0, 2))):
        if rank in members:
            torch.manual_seed(0)
            model = fgp.DistributedDataParallel(nn.Linear(4, 4), process_group=group,
                                                topology="flat")
            opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
            model(torch.randn(2, 4) + rank).sum().backward()
            opt.step()
            model.synchronize()
            params.append([p.detach().clone() for p in model.module.parameters()])
    return params


def _rebuilt_beside_a_users_group(rank: int, world_size: int) -> object:
    """Each pair wraps, makes a use_local_synchronization group of its own, drops the
    wrapper and wraps again (torch 2.13's hash came back to the user's group's name,
    and both pairs fell back to the same counter name: a hang in one run of three)."""
    import gc
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = pairs[rank // 2]
    module = MLP()
    model = fgp.DistributedDataParallel(module, process_group=group, topology="flat")
    user = dist.new_group([0, 1] if rank < 2 else [2, 3], use_local_synchronization=True)
    del model
    gc.collect()
    model = fgp.DistributedDataParallel(module, process_group=group, topology="flat")
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    train_both([(model, opt)], rank, 2)
    model.synchronize()
    flag = torch.ones(1)
    dist.all_reduce(flag, group=user)  # the user's group still works
    return {"names": sorted(g.group_name for g in model._own_groups), "user": float(flag),
            "params": [p.detach().clone() for p in module.parameters()]}


def test_wrappers_on_overlapping_subgroups():
    results = run_distributed(3, _overlapping_subgroups, timeout_s=120, pg_timeout_s=15)
    on_a, on_b = results[0]
    assert all(torch.equal(x, y) for x, y in zip(on_a, results[1][0]))
    assert all(torch.equal(x, y) for x, y in zip(on_b, results[2][0]))


def test_a_wrapper_rebuilt_beside_a_users_local_group():
    results = run_distributed(4, _rebuilt_beside_a_users_group, timeout_s=120, pg_timeout_s=15)
    assert results[0]["names"] == results[1]["names"] != results[2]["names"] == results[3]["names"]
    assert all(res["user"] == 2.0 for res in results)
    for a, b in (results[0], results[1]), (results[2], results[3]):
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


def _with_counter_salted_names() -> None:
    """This process names hashed groups as torch 2.14 does (on an older torch): the
    hash of the ranks salted with the group counter, and the counter advanced for
    hashed names as for counted ones."""
    import hashlib
    c10d = dist.distributed_c10d

    def hash_ranks(ranks):
        text = "_".join(map(str, ranks)) + "_" + str(c10d._world.group_count)
        return hashlib.sha1(text.encode()).hexdigest()

    def group_name(ranks, use_hashed_name):
        name = hash_ranks(ranks) if use_hashed_name else str(c10d._world.group_count)
        c10d._world.group_count += 1
        return name
    c10d._hash_ranks_to_str, c10d._process_group_name = hash_ranks, group_name


def _subgroup_wrapper_then_whole_job(rank: int, world_size: int, counter_salted: bool) -> dict:
    """Ranks 0-1 wrap on their pair (hashed names), then every rank wraps on the whole
    job (counter names): the counter must still agree on every rank."""
    if counter_salted:
        _with_counter_salted_names()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    if rank < 2:
        pair_model = fgp.DistributedDataParallel(MLP(), process_group=pairs[0], topology="flat")
        pair_names = sorted(g.group_name for g in pair_model._own_groups)
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(MLP(), topology="flat")
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    train_both([(model, opt)], rank, 1)
    return {"names": sorted(g.group_name for g in model._own_groups),
            "pair_hashed": rank >= 2 or all(not n.isdigit() for n in pair_names),
            "params": [p.detach().clone() for p in model.module.parameters()]}


@pytest.mark.parametrize("counter_salted", [False, True], ids=["torch", "torch_2_14_naming"])
def test_a_subgroup_wrapper_leaves_the_job_counter_alone(counter_salted):
    """torch 2.14 salts a hashed name with the group counter and advances it on the
    members only: before 2026-12-05 the job-wide wrapper that followed named its
    groups differently on ranks 0-1 and 2-3, and its rendezvous hung."""
    results = run_distributed(4, _subgroup_wrapper_then_whole_job, counter_salted,
                              timeout_s=120, pg_timeout_s=15)
    assert all(res["pair_hashed"] for res in results)
    assert all(res["names"] == results[0]["names"] for res in results)
    for res in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(res["params"], results[0]["params"]))


def _default_group_without_a_backend(rank: int, world_size: int, store_path: str) -> dict:
    """The job's group made by init_process_group() with no backend (torch picks gloo
    for CPU tensors, NCCL for CUDA ones where built; dist.get_backend() then says
    "undefined"), as many launch scripts do: ours must take it for what it is for the
    buckets' device, here gloo, beside torch DDP."""
    regroup_without_a_backend(rank, world_size, store_path)
    assert dist.get_backend() == "undefined"
    torch.manual_seed(1234 + rank)
    base = MLP()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ours = fgp.DistributedDataParallel(base, bucket_cap_mb=0.002)
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    train_both([(ours, opt), (ref, ref_opt)], rank, 3)
    ours.synchronize()
    own_groups = list(ours._own_groups)
    transport = ours.node_transport
    diff = param_diff(ours, ref)
    del ours, opt
    import gc
    gc.collect()
    # A dropped wrapper destroys its own gloo groups (their sockets and threads).
    destroyed = [g not in dist.distributed_c10d._world.pg_map for g in own_groups]
    return {"diff": diff, "transport": transport, "destroyed": destroyed}


@skip_with_a_gpu
def test_a_default_group_made_without_a_backend_is_taken_for_gloo_on_cpu(tmp_path):
    """Before, the backend was read from dist.get_backend()'s string, "undefined" here:
    the ranks of one node left shared memory for gloo's TCP loopback, and a dropped
    wrapper kept its groups (found by a review of the backend checks, where on a GPU
    such a group's NCCL collectives took the host backends' path)."""
    results = run_distributed(2, _default_group_without_a_backend, str(tmp_path / "store"),
                              timeout_s=120)
    for rank, res in enumerate(results):
        assert res["diff"] == 0.0, (rank, res["diff"])
        assert res["transport"] == "shared_memory", (rank, res["transport"])
        assert res["destroyed"] and all(res["destroyed"]), (rank, res["destroyed"])
