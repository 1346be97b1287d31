"""Uneven inputs: ``with model.join():`` trains as torch DDP's join() does.

Every rank runs its own number of steps; ranks that run out join and keep
stepping their slices with the others' gradients. Compared with torch DDP
under its own join() on the same data: bitwise on 2 ranks, within the
gradient sum order's rounding on more.
"""
import pytest
import torch

from . import uneven_inputs_scenarios as scen
from .dist_harness import run_calls

TWO = [name for name in scen.CASES if name.startswith("2r-")]
THREE = [name for name in scen.CASES if name.startswith("3r-")]
ERROR_CALLS = [(scen.train_case_throwing,), (scen.join_with_grad_scaler,)]
REFUSALS_CAUGHT = [(scen.refusal_caught_under_join, what) for what in ("norm_type", "train")]
MISALIGNED_NO_SYNC = (scen.no_sync_beside_a_synchronised_forward,)
LOADS = [(scen.load_while_joined, what, load_at) for what in ("model", "full", "shard", "plan")
         for load_at in (0, 2)]  # at 0 every rank is active: the load is fine
TWO_WRAPPERS = [(scen.join_of_two_wrappers, how) for how in ("generic", "nested")]
# (rank 0's micro-batches, rank 1's): even; rank 0 leaves one and joins first;
# rank 1, the last to join, leaves one.
LEFT_AT_JOIN = [(3, 3), (3, 5), (4, 5)]
LEFT_AT_JOIN_CALLS = [(scen.no_sync_left_at_the_join, system, counts)
                      for counts in LEFT_AT_JOIN
                      for system in ("torch", "serial", "next_forward", "two_stage")]
RANK0_ONLY_SAVE = (scen.join_then_save, "two_stage", True)
RANK0_ONLY_SAVE_TWO_JOINED = (scen.join_then_save, "next_forward", True, (0, 1))
BACKWARD_SKIPPED = [(scen.backward_skipped_on_rank1, (4, 4), False),
                    (scen.backward_skipped_on_rank1, (4, 4), True),
                    (scen.backward_skipped_on_rank1, (5, 4), True)]


def _by_case(per_rank, names, fn=scen.train_case):
    return {name: [r[(fn, name)] for r in per_rank] for name in names}


@pytest.fixture(scope="module")
def two_ranks():
    calls = [(scen.train_case, name) for name in TWO] + [(scen.join_then_save, "two_stage"),
                                                        (scen.join_then_save, "next_forward"),
                                                        RANK0_ONLY_SAVE]
    calls += ERROR_CALLS + REFUSALS_CAUGHT + BACKWARD_SKIPPED + LEFT_AT_JOIN_CALLS
    calls += [MISALIGNED_NO_SYNC]
    return run_calls(2, calls, timeout_s=300)


@pytest.fixture(scope="module")
def three_ranks():
    calls = [(scen.train_case, name) for name in THREE] + [(scen.tensor_lr_through_join,),
                                                          (scen.step_counters_through_join,)]
    calls += LOADS + TWO_WRAPPERS + [RANK0_ONLY_SAVE, RANK0_ONLY_SAVE_TWO_JOINED]
    return run_calls(3, calls, timeout_s=300)


@pytest.mark.parametrize("name", [n for n in TWO if not scen.CASES[n].get("skip_reference")])
def test_two_ranks_match_torch_ddp_join_bitwise(two_ranks, name):
    for rank, res in enumerate(two_ranks[(scen.train_case, name)]):
        assert res["param_diff"] == 0.0, (rank, name, res["param_diff"])
        if not scen.CASES[name].get("then_even_steps"):
            # After a join torch DDP keeps broadcasting buffers from its highest
            # rank (its join config is never reset); fgpsdp from rank 0 again.
            assert res["buffer_diff"] == 0.0, (rank, name, res["buffer_diff"])
        assert res["losses"] == res["ref_losses"]


def test_a_joined_ranks_learning_rate_is_its_own_again_after_the_join(two_ranks):
    # During the join rank 0 stepped its slices with rank 1's learning rate
    # (a wrong one fails the bitwise test above); afterwards it holds what its
    # own schedule set.
    for res in two_ranks[(scen.train_case, "2r-two_stage")]:
        assert res["lrs"] == res["own_lrs"]
    rank0, rank1 = two_ranks[(scen.train_case, "2r-two_stage")]
    assert rank0["lrs"] != rank1["lrs"]  # 3 and 5 steps of StepLR(step_size=2)


def test_speculation_pauses_while_a_rank_is_joined(two_ranks):
    # Rank 1 has 2 batches, rank 0 5, then both 3 more outside the join.
    for res in two_ranks[(scen.train_case, "2r-speculation-resumes")]:
        n = res["stage1_buckets"]
        assert n >= 1 and res["speculating_stopped"] is None  # paused, not stopped
        assert res["commits_in_join"] == 2 * n  # the 2 steps before rank 1 joined
        # From the second step after the join on (the first decides it).
        assert res["commits"] == res["commits_in_join"] + 2 * n


def test_evaluation_forwards_under_join_change_no_parameter(two_ranks):
    with_eval = two_ranks[(scen.train_case, "2r-eval-forwards")]
    without = two_ranks[(scen.train_case, "2r-no-eval-forwards")]
    for a, b in zip(with_eval, without):
        assert all((x == y).all() for x, y in zip(a["params"], b["params"]))


@pytest.mark.parametrize("schedule", ["two_stage", "next_forward"])
def test_the_active_ranks_synchronize_and_save_while_one_is_joined(two_ranks, schedule):
    rank0, rank1 = two_ranks[(scen.join_then_save, schedule)]
    assert rank1["saved_steps"] == [4]  # the full optimizer state, every slice at step 4
    assert (rank0["params"] == rank1["params"]).all()


def test_a_rank0_only_save_while_rank_0_is_joined_is_kept_on_the_lowest_active_rank(
        two_ranks, three_ranks):
    # Rank 0 has joined: it can hand the dict to no loop. Before, every rank
    # dropped it and a loop's save wrote nothing, silently.
    for results in (two_ranks[RANK0_ONLY_SAVE], three_ranks[RANK0_ONLY_SAVE]):
        keeper = results[1]
        assert keeper["saved_steps"] == [4] and keeper["kept_the_whole"]
        for res in results[1:]:
            assert len(res["warnings"]) == 1, res["warnings"]
            assert "kept on rank 1" in res["warnings"][0]
        assert results[0]["warnings"] == []  # the joined rank's loop has ended
    rank2 = three_ranks[RANK0_ONLY_SAVE][2]
    assert rank2["saved_steps"] is None and not rank2["kept_the_whole"]  # got {}
    assert all((r["params"] == two_ranks[RANK0_ONLY_SAVE][0]["params"]).all()
               for r in two_ranks[RANK0_ONLY_SAVE])
    # Ranks 0 and 1 joined: rank 2, the only active one, keeps it.
    rank0, rank1, rank2 = three_ranks[RANK0_ONLY_SAVE_TWO_JOINED]
    assert rank2["saved_steps"] == [4] and rank2["kept_the_whole"]
    assert len(rank2["warnings"]) == 1 and "kept on rank 2" in rank2["warnings"][0]
    assert rank0["warnings"] == rank1["warnings"] == []


@pytest.mark.parametrize("name", THREE)
def test_three_ranks_match_torch_ddp_join(three_ranks, name):
    results = three_ranks[(scen.train_case, name)]
    for rank, res in enumerate(results):
        if not scen.CASES[name].get("skip_reference"):
            assert res["param_diff"] <= 2e-5, (rank, name, res["param_diff"])
            assert res["buffer_diff"] <= 2e-5, (rank, name, res["buffer_diff"])
        # Every rank holds the same parameters.
        assert all((a == b).all() for a, b in zip(res["params"], results[0]["params"]))


SAME_ARGS = (scen.announced_arguments, (0.1, 0.1, 0.1, 0.1))
DIFFERENT_ARGS = (scen.announced_arguments, (0.1, 0.1, 0.2, 0.1))


@pytest.fixture(scope="module")
def four_ranks():
    return run_calls(4, [(scen.train_case, "4r-2x2"), SAME_ARGS, DIFFERENT_ARGS], timeout_s=300)


def test_two_nodes_of_two_match_torch_ddp_join(four_ranks):
    for rank, res in enumerate(four_ranks[(scen.train_case, "4r-2x2")]):
        assert res["param_diff"] <= 2e-5, (rank, res["param_diff"])


def test_a_joined_rank_clips_with_the_arguments_the_active_ranks_passed(four_ranks):
    """Rank 0 joins after one step; the three active ranks' 0.1 reached it as
    0.10000000000000002 before (their sum divided by three), and 0.7 as
    0.6999999999999998; zero_grad's set_to_none reaches it as passed."""
    expected = [call for step in range(3) for call in (
        ("value", (0.7).hex()), ("norm", (0.1).hex()), ("zero", step % 2 == 1))]
    for rank, res in enumerate(four_ranks[SAME_ARGS]):
        assert res["type"] is None, (rank, res)
        assert res["received"] == expected, (rank, res["received"])


def test_different_arguments_on_the_active_ranks_raise_on_every_rank(four_ranks):
    for rank, res in enumerate(four_ranks[DIFFERENT_ARGS]):
        assert res["type"] == "RuntimeError" and "different arguments" in res["message"], \
            (rank, res)


def test_refusals_and_early_termination_raise_on_every_rank(two_ranks):
    for rank in range(2):
        early = two_ranks[(scen.train_case_throwing,)][rank]
        assert early["type"] == "RuntimeError" and "exhausted" in early["message"], (rank, early)
        scaler = two_ranks[(scen.join_with_grad_scaler,)][rank]
        assert scaler["type"] == "NotImplementedError", (rank, scaler)
        if rank == 1:  # the rank whose loop raised; rank 0 was told
            assert "ShardedGradScaler" in scaler["message"]


@pytest.mark.parametrize("call", REFUSALS_CAUGHT, ids=lambda c: c[1])
def test_a_refusal_the_loop_catches_leaves_the_join_going(two_ranks, call):
    """A call refused before its announcement announces nothing: the loop that catches
    the error goes on, and the joined rank keeps shadowing it to the end."""
    joined, active = two_ranks[call]
    assert joined["error"] is None and active["error"] is None, (joined, active)
    assert active["caught"] == ("ValueError" if call[1] == "norm_type" else "AttributeError")
    assert torch.equal(joined["params"], active["params"])


def test_a_no_sync_micro_batch_beside_a_synchronised_forward_raises_on_every_rank(two_ranks):
    for rank, res in enumerate(two_ranks[MISALIGNED_NO_SYNC]):
        assert res["type"] == "RuntimeError" and "different arguments" in res["message"], \
            (rank, res)


def test_a_backward_that_reaches_no_parameter_on_one_rank(two_ranks):
    # Rank 1 skips backward on even steps: its step launches that round of
    # reduce-scatters, announced before the step (before the fix, the other
    # rank's step announcement met its norm all-reduce and gloo aborted).
    without_join, even_join, uneven_join = (two_ranks[call] for call in BACKWARD_SKIPPED)
    for params in (without_join, even_join, uneven_join):
        assert all((a == b).all() for a, b in zip(params[0], params[1]))
    assert all((a == b).all() for a, b in zip(without_join[0], even_join[0]))
    assert any((a != b).any() for a, b in zip(even_join[0], uneven_join[0]))


@pytest.mark.parametrize("call", LOADS, ids=[f"{c[1]}-at{c[2]}" for c in LOADS])
def test_loads_are_refused_on_every_rank_once_a_rank_has_joined(three_ranks, call):
    for rank, res in enumerate(three_ranks[call]):
        if call[2] == 0:  # rank 0 has not joined yet: every rank loads its slices
            assert res["type"] is None, (rank, res)
            continue
        assert res["type"] == "NotImplementedError", (rank, res)
        if rank > 0:  # the active ranks say why; the joined one was told
            assert "after a rank has joined" in res["message"], (rank, res)


@pytest.mark.parametrize("call", TWO_WRAPPERS, ids=[c[1] for c in TWO_WRAPPERS])
def test_joins_of_two_wrappers_are_refused_on_every_rank(three_ranks, call):
    for rank, res in enumerate(three_ranks[call]):
        assert res["type"] == "NotImplementedError", (rank, res)
        assert "model.join()" in res["message"], (rank, res)


def test_a_tensor_learning_rate_stays_the_loops_through_a_join(three_ranks):
    for rank, res in enumerate(three_ranks[(scen.tensor_lr_through_join,)]):
        assert res["same_tensor"] and res["lr"] == pytest.approx(0.001), (rank, res)


def test_step_counts_outside_the_parameters_agree_after_a_join(three_ranks):
    for rank, res in enumerate(three_ranks[(scen.step_counters_through_join,)]):
        assert res == {"k": [5], "t": [5.0], "steps": 5, "meta": 5, "n_steps": 5}, (rank, res)


@pytest.mark.parametrize("counts", LEFT_AT_JOIN, ids=[f"{a}-{b}" for a, b in LEFT_AT_JOIN])
@pytest.mark.parametrize("schedule", ["serial", "next_forward", "two_stage"])
def test_a_no_sync_gradient_left_at_the_join_goes_into_the_next_step(two_ranks, schedule, counts):
    """Before: dropped on every rank (0.006 off torch DDP with even inputs)."""
    ref = two_ranks[(scen.no_sync_left_at_the_join, "torch", counts)]
    ours = two_ranks[(scen.no_sync_left_at_the_join, schedule, counts)]
    for rank in range(2):
        assert all(torch.equal(a, b) for a, b in zip(ours[rank], ref[rank])), rank


def test_zero_and_minus_zero_are_the_same_argument():
    """Three active ranks announcing a call with 0.0, -0.0 and 0.0 (the same
    argument to any call; before, the sign bit made them "different arguments")."""
    from fgpsdp_runtime import uneven_inputs as ui
    summed = [sum(slots) for slots in zip(*(ui._arg_slots(a) for a in
                                              [(0.0, 1.5), (-0.0, 1.5), (0.0, 1.5)]))]
    packet = torch.zeros(1 + ui._N_CALLS + ui._ARG_SLOTS, dtype=torch.float64)
    packet[1 + ui._N_CALLS:] = torch.tensor(summed, dtype=torch.float64)
    assert ui._take_args(packet, 3) == [0.0, 1.5]
    different = [sum(slots) for slots in zip(*(ui._arg_slots(a) for a in [(0.5,), (0.25,)]))]
    packet[1 + ui._N_CALLS:] = torch.tensor(different, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="different arguments"):
        ui._take_args(packet, 2)


def test_shared_hyperparameters_travel_on_the_host_and_land_where_the_groups_were():
    """Join's broadcast of param-group hyperparameters: a pickled CUDA tensor would be
    unpickled on the sender's GPU, and a replaced one (betas of tensors) stayed there
    (found by review; "meta" stands in for a GPU here)."""
    from fgpsdp_runtime.uneven_inputs import _on_the_host, _update_in_place
    sent = _on_the_host({"lr": torch.tensor(0.1), "betas": (torch.tensor(0.9), 0.999),
                         "eps": 1e-8})
    assert sent["lr"].device.type == "cpu" and sent["betas"][0].device.type == "cpu"
    lr = torch.tensor(1.0)
    group = {"lr": lr, "betas": (torch.empty((), device="meta"), 0.999), "eps": 1e-6}
    _update_in_place(group, sent)
    assert group["lr"] is lr and float(lr) == pytest.approx(0.1)  # filled in place
    assert group["betas"][0].device.type == "meta" and group["betas"][1] == 0.999
    assert group["eps"] == 1e-8
