"""Muon for the matrices, AdamW for the rest (fgp.MuonWithAdamW): trains as torch DDP
with torch.optim.Muon and torch.optim.AdamW. Before, Muon was refused (it is not
element-wise: it orthogonalises each matrix as a whole)."""
import copy

import pytest
import torch
from torch import nn

import fgpsdp_runtime as fgp

from . import muon_scenarios
from .dist_harness import run_distributed

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"),
                                reason="torch.optim.Muon came with torch 2.9")


def test_on_whole_tensors_it_steps_as_torchs_muon_and_adamw():
    """Without a wrapper (each parameter a whole matrix): the two torch optimizers'
    steps, bit for bit, with the settings each group leaves out at their defaults."""
    torch.manual_seed(0)
    ours_module = muon_scenarios.MuonNet()
    theirs_module = copy.deepcopy(ours_module)
    muon_groups, adamw_groups = muon_scenarios._groups(ours_module, muon_flag=True)
    ours = fgp.MuonWithAdamW(muon_groups + adamw_groups)
    muon_groups, adamw_groups = muon_scenarios._groups(theirs_module, muon_flag=False)
    theirs = [torch.optim.Muon(muon_groups), torch.optim.AdamW(adamw_groups)]
    assert ours.param_groups[1]["weight_decay"] == 0.1  # Muon's default
    assert ours.param_groups[3]["betas"] == (0.9, 0.999)  # AdamW's
    for step in range(3):
        x, y = muon_scenarios._batch(step, 0)
        for module, opts in ((ours_module, [ours]), (theirs_module, theirs)):
            nn.functional.mse_loss(module(x), y).backward()
            for o in opts:
                o.step()
                o.zero_grad()
    for a, b in zip(ours_module.parameters(), theirs_module.parameters()):
        assert torch.equal(a, b)


CASES = [("serial", None), ("serial", 1.0), ("next_forward", 1.0), ("two_stage", None),
         ("two_stage", 1.0)]


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(2, muon_scenarios.trains_as_torch_ddp_by_case, CASES)


@pytest.mark.parametrize("case", CASES, ids=[f"{s}-clip{c}" for s, c in CASES])
def test_trains_bitwise_as_torch_ddp_with_torchs_muon_and_adamw(two_ranks, case):
    """2 ranks, every matrix cut between them: parameters and Muon's momentum bit for
    bit torch DDP's with torch.optim.Muon + AdamW (clipping at 1.0 triggers on some
    steps), under each schedule; two_stage does not speculate; a resume from
    full_state_dict() trains on as the uninterrupted run."""
    for rank, per_case in enumerate(two_ranks):
        res = per_case[case]
        assert res["n_buckets"] >= 4, res  # the matrices in buckets apart
        assert res["param_diff"] == 0.0, (rank, case, res)
        assert res["momentum_diff"] == 0.0, (rank, case, res)
        assert res["resumed_diff"] == 0.0, (rank, case, res)
        if case[1] is not None:
            assert 0 < res["clipped_steps"] < 4, res  # clipped and unclipped steps
        if case[0] == "two_stage":
            assert res["speculated"] == 0 and "MuonWithAdamW" in res["speculation_stopped"]


def test_three_ranks_train_as_torch_ddp_within_rounding():
    """3 ranks sum the gradients in another order than torch DDP's ring: within
    rounding (Newton-Schulz runs in bfloat16, so a last-bit difference in a gradient
    can move an update by a bfloat16 step)."""
    cases = [("serial", 1.0), ("two_stage", 1.0)]
    for rank, per_case in enumerate(run_distributed(
            3, muon_scenarios.trains_as_torch_ddp_by_case, cases)):
        serial, two_stage = (per_case[c] for c in cases)
        assert serial["param_diff"] < 1e-4, (rank, serial)
        assert serial["param_diff"] == two_stage["param_diff"], rank  # the same sums
        assert serial["resumed_diff"] == 0.0 and two_stage["resumed_diff"] == 0.0


def test_two_nodes_of_two_train_as_torch_ddp_within_rounding():
    """2 nodes x 2 ranks (reduce-scatter in the node, then across), where the slices a
    matrix is cut into lie on both nodes: within rounding of torch DDP (its ring sums
    in another order), and the schedules agree bit for bit."""
    cases = [("serial", 1.0, 2), ("two_stage", 1.0, 2)]
    for rank, per_case in enumerate(run_distributed(
            4, muon_scenarios.trains_as_torch_ddp_by_case, cases)):
        serial, two_stage = (per_case[c] for c in cases)
        assert serial["param_diff"] < 1e-4, (rank, serial)
        assert serial["param_diff"] == two_stage["param_diff"], rank
        assert serial["resumed_diff"] == 0.0 and two_stage["resumed_diff"] == 0.0


def test_wrong_groups_are_refused_on_every_rank():
    for rank, out in enumerate(run_distributed(2, muon_scenarios.refusals)):
        assert out["vector_in_muon_group"].startswith("ValueError: "), out
        assert "parameter 'up.bias' of shape (40,) is in a use_muon=True group" \
            in out["vector_in_muon_group"]
        assert out["no_flag"].startswith("ValueError: ") and "use_muon" in out["no_flag"]
        assert out["flag_not_a_bool"].startswith("ValueError: ") and "got 1" in \
            out["flag_not_a_bool"], out
        assert out["adamw_setting_in_muon_group"].startswith("TypeError: "), out
        assert "Muon takes no such setting" in out["adamw_setting_in_muon_group"], out


def test_bfloat16_model_with_master_weights_trains_as_torch_ddp():
    """bfloat16 parameters stepped through float32 masters: bit for bit torch DDP over
    the bfloat16 model with torch's Muon + AdamW over float32 copies."""
    schedules = ["serial", "two_stage"]
    for rank, diffs in enumerate(run_distributed(
            2, muon_scenarios.master_weights_by_schedule, schedules)):
        assert diffs == {s: 0.0 for s in schedules}, (rank, diffs)


def test_each_matrix_is_orthogonalised_by_one_rank_the_work_spread_evenly():
    """Newton-Schulz's work (min(m, n)^2 * max(m, n) per matrix) spread over the ranks,
    the biggest first, the same on every rank; under torch DDP each rank does it all."""
    from fgpsdp_runtime.whole_matrices import owners
    # GPT-2's block: qkv, proj, fc, fc2, four times.
    shapes = [torch.Size(s) for s in [(1536, 512), (512, 512), (2048, 512), (512, 2048)] * 4]
    cost = [min(s) ** 2 * max(s) for s in shapes]
    for world in (1, 2, 3, 8):
        owner = owners(shapes, world)
        assert owner == owners(list(shapes), world)
        loads = [sum(c for c, o in zip(cost, owner) if o == r) for r in range(world)]
        assert max(loads) - min(loads) <= max(cost), (world, loads)
    assert owners([torch.Size((4, 4))] * 3, 2) == [0, 1, 0]


def test_owners_prefer_the_rank_holding_most_among_the_least_loaded():
    """The heap-based owners() against the rule written out (every rank compared for
    every matrix), on random shapes and holdings: the same owners."""
    import random

    from fgpsdp_runtime.whole_matrices import _cost, owners

    def by_the_rule(shapes, world, held):
        load, owner = [0] * world, [0] * len(shapes)
        for i in sorted(range(len(shapes)), key=lambda i: (-_cost(shapes[i]), i)):
            owner[i] = min(range(world), key=lambda r: (load[r], -held[i].get(r, 0), r))
            load[owner[i]] += _cost(shapes[i])
        return owner

    rng = random.Random(0)
    for _ in range(200):
        world = rng.randint(1, 9)
        shapes = [torch.Size((rng.choice([2, 4, 8]), rng.choice([2, 4, 8])))
                  for _ in range(rng.randint(0, 12))]
        held = [{r: rng.randint(1, 9) for r in rng.sample(range(world), rng.randint(1, world))}
                for _ in shapes]
        assert owners(shapes, world, held) == by_the_rule(shapes, world, held)
    # Two equal matrices on 2 ranks, the second held mostly by rank 0: rank 1 is the
    # less loaded when it comes, and takes it.
    assert owners([torch.Size((4, 4))] * 2, 2, [{0: 10, 1: 6}, {0: 12, 1: 4}]) == [0, 1]
    assert owners([torch.Size((4, 4))] * 2, 2, [{0: 4, 1: 12}, {0: 12, 1: 4}]) == [1, 0]


def test_groups_read_back_from_param_groups_build_again():
    """``MuonWithAdamW(opt.param_groups)`` (what ShardedOptimizer.from_optimizer does):
    torch 2.13's AdamW groups hold ``decoupled_weight_decay``, which its constructor
    does not take; before, that raised TypeError."""
    module = muon_scenarios.MuonNet()
    muon_groups, adamw_groups = muon_scenarios._groups(module, muon_flag=True)
    first = fgp.MuonWithAdamW(muon_groups + adamw_groups)
    again = fgp.MuonWithAdamW(first.param_groups)
    assert again.param_groups == first.param_groups
    with pytest.raises(TypeError, match="AdamW takes no such setting"):
        fgp.MuonWithAdamW([{**adamw_groups[0], "decoupled_weight_decay": False}])


def test_an_error_before_the_exchanges_raises_on_every_rank_and_the_retry_trains_on():
    """An error on one rank while it computes its pieces' momentum, before the first
    exchange: it travels in that exchange and is raised on every rank, the others
    naming it (before, they waited in the exchange until the timeout); called again,
    the step trains on bit for bit as torch DDP's."""
    for rank, per_schedule in enumerate(run_distributed(
            2, muon_scenarios.newton_schulz_raises_by_schedule, ["next_forward"], True)):
        res = per_schedule["next_forward"]
        if rank == 0:
            assert res["raised"].startswith("MemoryError: out of memory"), res
        else:
            assert res["raised"].startswith("RuntimeError: fgpsdp: MuonWithAdamW's step "
                                            "raised on rank(s) [0] before its matrices"), res
        assert res["param_diff"] == 0.0, (rank, res)


def test_newton_schulz_raising_on_one_rank_raises_on_every_rank_and_the_retry_trains_on():
    """Each matrix is orthogonalised on one rank: an error there (an out of memory)
    is raised on every rank, the others naming it (before, they waited in the
    all-reduce until the timeout), nothing of that step's matrices changed; the loop
    calls opt.step() again and ends bit for bit where torch DDP does. The optimizer
    was converted from a MuonWithAdamW over the module (from_optimizer)."""
    schedules = ["serial", "next_forward"]
    for rank, per_schedule in enumerate(run_distributed(
            2, muon_scenarios.newton_schulz_raises_by_schedule, schedules)):
        for schedule, res in per_schedule.items():
            assert res["converted"] == "MuonWithAdamW"
            assert res["raised"] is not None, (rank, schedule)
            # Rank 0 raised its error; rank 1, waiting for its results, fgpsdp's.
            if rank == 0:
                assert res["raised"].startswith("MemoryError: out of memory"), res
            else:
                assert res["raised"].startswith(
                    "RuntimeError: fgpsdp: Newton-Schulz raised on rank(s) [0]"), res
            assert res["param_diff"] == 0.0, (rank, schedule, res)


def test_settings_that_would_pair_no_collectives_are_refused_at_construction():
    for rank, out in enumerate(run_distributed(2, muon_scenarios.settings_that_differ)):
        assert "use_muon per group" in out["use_muon_on_one_rank"], (rank, out)
        assert "Number of steps must be less than 100" in out["ns_steps_100"], out
        assert "3 values" in out["two_coefficients"], out


def test_matrices_travel_to_their_owner_and_back_not_to_every_rank():
    """Small matrices in one bucket on 3 ranks: most lie in one rank's slice, and some
    are orthogonalised by a rank holding none of them. Within rounding of torch DDP
    (3 ranks sum in another order), and each rank sends less than one all-reduce of
    the matrices' updates alone would (a ring sends about 2 x (n-1)/n of the buffer)."""
    for rank, out in enumerate(run_distributed(
            3, muon_scenarios.many_matrices_as_torch_ddp, "serial")):
        assert out["n_buckets"] == 1, out
        assert out["param_diff"] < 1e-4, (rank, out)
        seen = out["seen"]  # (each exchange asks for the owners: twice per step)
        assert seen["matrices"] == 2 * 4 * 6 and seen["owner_holds_none"] > 0 \
            and seen["held_by_one_rank"] > 0, (rank, seen)
        all_reduce_bytes = 4 * 2 * 4 * out["matrix_elements"] * 2 / 3  # 4 steps, float32
        assert sum(out["sent"].values()) < all_reduce_bytes / 2, (rank, out["sent"])


def test_data_parallel_subgroups_train_as_torch_ddp():
    """Two groups of 2 in a job of 4 ([0, 2] and [1, 3]): bit for bit torch DDP on
    each group (the exchanges are point-to-point messages addressed by job rank)."""
    assert run_distributed(4, muon_scenarios.trains_as_torch_ddp_on_subgroups,
                           "next_forward") == [0.0] * 4


def test_beside_tensor_parallelism_each_shard_trains_as_torch_ddp():
    """With tensor-parallel layers (a 2 x 2 mesh), each rank's shard of a matrix is
    orthogonalised alone, as torch's Muon under torch DDP on that rank: bit for bit,
    clipped over both groups."""
    for rank, out in enumerate(run_distributed(4, muon_scenarios.beside_tensor_parallel)):
        assert out["param_diff"] == 0.0, (rank, out)
        assert out["clipped"] > 0, out


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_newton_schulz_raising_under_join_is_taken_again_by_the_joined_rank_too(failing_rank):
    """Under model.join() an error while a rank orthogonalises is raised on the active
    rank; its opt.step() called again is a collective, which the joined rank takes up
    too: bit for bit torch DDP's join. Before, the joined rank dropped the step and
    the two waited in different collectives until the timeout. An active rank that
    goes on instead (its next forward) or leaves its loop sends the rest unstepped,
    and so does the joined rank: both end, each with one warning."""
    for rank, out in enumerate(run_distributed(
            2, muon_scenarios.newton_schulz_raises_under_join, failing_rank, "again")):
        if rank == 0:
            assert out["raised"] is not None, out
        assert out["param_diff"] == 0.0, (rank, out)
        assert out["warnings"] == [], (rank, out)
    for then in ("on", "end"):
        gone_on = run_distributed(2, muon_scenarios.newton_schulz_raises_under_join,
                                  failing_rank, then)
        assert gone_on[0]["raised"] is not None
        # That step's update missed the slices of the Muon buckets, on both ranks alike.
        assert gone_on[0]["param_diff"] == gone_on[1]["param_diff"] > 0.0, (then, gone_on)
        for out in gone_on:
            assert len(out["warnings"]) == 1 and "sent as they were" in out["warnings"][0], \
                (then, out)
        assert "stand-in step" in gone_on[1]["warnings"][0], gone_on


def test_the_checkpoint_template_holds_every_parameters_state_as_torchs():
    # full_state_dict(init_state=True): before the first step, and after two for a
    # matrix that never had a gradient; before, every rank raised "an inner step that
    # puts matrices together ran outside opt.step()'s chunks".
    for out in run_distributed(2, muon_scenarios.template_of_the_state):
        assert out == {"before_any_step": True, "left_empty": True,
                       "spare_had_no_state": True, "spare_momentum_zero": True,
                       "others_as_live": True, "training_unchanged": True}, out


def test_a_group_of_vectors_turned_muon_after_a_step_is_refused_by_name():
    # Before: "ValueError: not enough values to unpack" from the owners' cost.
    for out in run_distributed(2, muon_scenarios.vector_turned_muon_after_a_step):
        assert out.startswith("ValueError: ") and "2-D parameters only" in out \
            and "'up.bias' of shape (40,)" in out, out


def test_a_traced_step_shows_the_exchanges_and_newton_schulz():
    for names in run_distributed(2, muon_scenarios.spans_of_a_step):
        for name in ("optimizer step", "Muon's whole matrices", "Newton-Schulz",
                     "Muon's orthogonalised matrices"):
            assert names.count(name) == 1, (name, names)
