"""Expert parallelism: trainable parameters named in torch's
``_ddp_params_and_buffers_to_ignore`` (rank-local experts) left to the user, as torch
DDP leaves them, beside the sharded ones.

On 2 CPU ranks, beside torch DDP with the same ignore list, each schedule, with and
without clipping; the loss scaler, a join, checkpoints and the warnings around them.
"""
import functools

import pytest
import torch

from . import expert_scenarios
from .dist_harness import run_distributed

TOL = 2e-5  # as test_equivalence (our norm is summed in float64, torch's clip in float32)


SCHEDULES = ("serial", "overlap_backward", "next_forward", "two_stage")
EXPERT_CONFIGS = {**{s: {"schedule": s} for s in SCHEDULES},
                  # Low enough that every step clips (the gradients' norm is ~1).
                  **{f"{s}_clipped": {"schedule": s, "max_norm": 0.05} for s in SCHEDULES},
                  **{f"{s}_clip_ignored": {"schedule": s, "max_norm": 0.05,
                                           "clip_ignored": "max_grad_norm"} for s in SCHEDULES},
                  "two_stage_clip_ignored_by_call": {"schedule": "two_stage", "max_norm": 0.05,
                                                     "clip_ignored": "call"},
                  # No step clips: speculation commits, but at the inf.
                  "two_stage_inf_in_one_expert": {"schedule": "two_stage", "max_norm": 1e6,
                                                  "clip_ignored": "max_grad_norm",
                                                  "inf_at_step": 2},
                  # Before, model.zero_grad() left the experts' gradients to add up.
                  "two_stage_zero_by_model": {"schedule": "two_stage", "zero": "model"},
                  "two_stage_zero_by_optimizer_first": {"schedule": "two_stage",
                                                        "zero": "optimizer_first"},
                  "two_stage_experts_fused": {"schedule": "two_stage", "expert_fused": True},
                  "experts_never_stepped": {"schedule": "two_stage", "expert_optimizer": False},
                  "experts_listed_late": {"schedule": "two_stage", "list_experts_late": True}}


@functools.lru_cache(maxsize=None)
def expert_results():
    return run_distributed(2, expert_scenarios.rank_local_experts_many, EXPERT_CONFIGS)


@pytest.mark.parametrize("name", [n for n in EXPERT_CONFIGS
                                  if n in SCHEDULES or "clip" in n or "inf" in n
                                  or "zero" in n or "fused" in n])
def test_trainable_parameters_torch_ddp_ignores_stay_rank_local(name):
    """Expert parallelism (Tutel's way): trainable parameters named in
    ``_ddp_params_and_buffers_to_ignore`` are left alone as torch DDP leaves them
    (never broadcast, never reduced, no bucket), stepped by the user's own
    optimizer; the wrapper's parameters end where torch DDP's do: bitwise on 2
    ranks, within TOL when clipping (our norm is summed in float64)."""
    per_rank = [res[name] for res in expert_results()]
    for rank, res in enumerate(per_rank):
        assert res["expert_kept_at_wrap"], (rank, "the expert was broadcast at construction")
        assert res["in_buckets"] == [], (rank, res["in_buckets"])
        tol = TOL if "max_norm" in EXPERT_CONFIGS[name] else 0.0
        # Each rank's own: a reduced one would be far from torch DDP's.
        assert max(res["expert_grads_local"]) <= tol, (rank, res["expert_grads_local"])
        assert res["expert_moved"], (rank, "the expert was never stepped")
        assert res["shared_diff"] <= tol, (rank, res["shared_diff"])
        assert res["expert_diff"] <= tol, (rank, res["expert_diff"])
        skips = ["fgpsdp: gradient norm is inf; step skipped (1 so far)"] if "inf" in name else []
        assert res["warnings"] == skips, (rank, res["warnings"])
        # As AdamW(model.parameters()) numbers them (experts 2 and 3, no state).
        assert res["full_numbering"] == ([0, 1, 2, 3, 4, 5], [0, 1, 4, 5]), res["full_numbering"]
        if name.startswith("two_stage"):  # stage 1 ran: committed, or rolled back
            commits, rollbacks = res["speculated"]
            assert (commits if "max_norm" not in EXPERT_CONFIGS[name] else rollbacks) > 0, res
            assert commits > 0 or "inf" not in name, res  # (it commits but at the inf)
    # Each rank trained its own expert: they end apart.
    assert not all(torch.equal(a, b) for a, b in zip(per_rank[0]["expert"], per_rank[1]["expert"]))


def test_ignored_trainable_parameters_left_unstepped_warn_once():
    """A loop moved from torch DDP's one AdamW(model.parameters()) to a
    ShardedOptimizer alone would leave the experts untrained: said once, at the
    third step, on every rank."""
    for rank, res in enumerate(expert_results()):
        res = res["experts_never_stepped"]
        assert not res["expert_moved"]
        assert len(res["warnings"]) == 1, (rank, res["warnings"])
        assert "'expert.weight', 'expert.bias'" in res["warnings"][0]
        assert "have not changed in 3 steps" in res["warnings"][0]



def test_a_parameter_walk_between_backward_and_step_says_the_experts_keep_their_gradients():
    """The clip warning (torch's clip over model.parameters() would clip the experts
    alone) says how a loop that only picks the experts out avoids it."""
    for rank, res in enumerate(expert_results()):
        res = res["experts_listed_late"]
        assert res["shared_diff"] == 0.0 and res["expert_diff"] == 0.0, (rank, res)
        assert len(res["warnings"]) == 1, (rank, res["warnings"])
        assert "clips nothing" in res["warnings"][0]
        assert "Only the parameters named in _ddp_params_and_buffers_to_ignore keep theirs" \
            in res["warnings"][0]


@pytest.mark.parametrize("name", [n for n in EXPERT_CONFIGS if "clip_ignored" in n])
def test_clip_ignored_parameters_clips_by_one_norm_over_every_ranks_experts(name):
    """``clip_ignored_parameters=True``: the norm covers the replicated gradients and
    every rank's own expert's, as Megatron's does, and the clip scales both
    (checked above against that clip in float64: with the experts left out of our
    norm, the experts' gradients there end 5e-4 from it); clip_grad_norm_ returns it."""
    for rank, res in enumerate(expert_results()):
        for ours, ref in res[name]["norms"]:
            assert ref > 0.05, (rank, ref)  # every step clips
            if ours is not None:
                assert ours == pytest.approx(ref, rel=1e-6), (rank, ours, ref)


def test_an_inf_in_one_ranks_expert_skips_the_step_on_every_rank():
    for rank, res in enumerate(expert_results()):
        assert res["two_stage_inf_in_one_expert"]["skipped"] == [False, False, True, False], rank


def test_a_joined_ranks_expert_gradients_count_for_nothing():
    """Under model.join() with clip_ignored_parameters, a rank that ran out of data
    adds nothing to the norm, as a rank feeding zero gradients would (before, its
    last expert gradients entered every later step's norm: over-clipped)."""
    rank0 = run_distributed(2, expert_scenarios.experts_through_a_join_and_without)[0]
    assert rank0["join"]["norms"] == rank0["zeros"]["norms"]
    assert all(torch.equal(a, b) for a, b in zip(rank0["join"]["shared"], rank0["zeros"]["shared"]))


@functools.lru_cache(maxsize=None)
def loss_scaling_results():
    return run_distributed(2, expert_scenarios.experts_under_loss_scaling_cases)


@pytest.mark.parametrize("updates", ["", "_update_each_sharded_first",
                                     "_update_each_experts_first", "_fused",
                                     "_fused_update_each", "_growing"])
def test_an_inf_in_one_ranks_experts_moves_every_ranks_loss_scale(updates):
    """torch's scaler backs off on the rank whose experts' optimizer found the inf
    only; the scales then parted for good, and the next reduce-scatters summed
    gradients scaled apart (each rank unscaling its slices by its own): the
    replicated parameters went wrong, silently. Now every rank's next backward runs
    with the smallest scale, and the run ends where one with the inf on every rank
    does: whether each step has its own update(), the experts' optimizer is fused,
    or not."""
    per_rank = loss_scaling_results()
    one, both = "inf_on_rank_1" + updates, "inf_on_both" + updates
    assert per_rank[0][one]["scales"] == per_rank[1][one]["scales"]
    assert per_rank[0][one]["scales"] == per_rank[0][both]["scales"]
    assert per_rank[0][both]["scales"][2] == 512.0  # (the back-off)
    for res in per_rank:
        assert all(torch.equal(a, b) for a, b in zip(res[one]["shared"], res[both]["shared"]))


def test_clip_ignored_parameters_warns_of_expert_gradients_still_loss_scaled():
    for res in loss_scaling_results():
        assert res["clip_unscaled_first"]["warnings"] == []
        said = res["clip_still_scaled"]["warnings"]
        assert len(said) == 1 and "still loss-scaled" in said[0], said


def test_a_torch_checkpoint_with_the_experts_state_says_it_is_not_loaded():
    for res in run_distributed(2, expert_scenarios.torch_checkpoint_with_expert_state):
        assert res["loaded"] == [0, 1, 4, 5], res  # the rest is
        assert len(res["warnings"]) == 1, res["warnings"]
        assert "holds the state of 2 parameter(s) named in _ddp_params_and_buffers_to_ignore " \
               "('expert.weight', 'expert.bias')" in res["warnings"][0]


def test_a_scale_given_to_one_ranks_update_gives_way_to_the_smallest():
    """A rank updated to a scale of its own (2048) runs its next backward with the
    smallest of the ranks' scales, as the others do."""
    per_rank = loss_scaling_results()
    assert [res["new_scale_on_rank_0"]["scales"][3] for res in per_rank] == [1024.0, 1024.0]


def test_ranks_updated_to_scales_of_their_own_grow_together():
    """The growth counts are taken together with the scales: before, the rank
    brought down started its count again while the other kept its own, each grew
    alone, and the smallest undid it: the scale stayed at 128."""
    scales = [res["new_scales_apart"]["scales"] for res in loss_scaling_results()]
    assert scales[0] == scales[1], scales
    assert scales[0][3] == 128.0 and max(scales[0][3:]) > 128.0, scales


def test_a_parameter_counts_as_stepped_by_its_version_or_its_values():
    """The never-stepped warning's test: a fused step or a write through .data
    moves no version counter; a meta parameter cannot be read (no warning then)."""
    from fgpsdp_runtime.ignored_params import _fingerprint, _unchanged
    param = torch.nn.Parameter(torch.ones(3))
    version, fingerprint = param._version, _fingerprint(param)
    assert _unchanged(param, version, fingerprint)
    param.data.add_(1.0)  # (no version counter moves)
    assert param._version == version and not _unchanged(param, version, fingerprint)
    with torch.no_grad():
        param.mul_(1.0)  # the same values, its version moved
    assert not _unchanged(param, version, _fingerprint(param))
    meta = torch.nn.Parameter(torch.empty(3, device="meta"))
    assert not _unchanged(meta, meta._version, _fingerprint(meta))


def test_an_expert_given_a_new_parameter_after_wrapping_is_the_one_reset_and_clipped():
    for res in run_distributed(2, expert_scenarios.expert_replaced_after_wrapping):
        assert res == {"covered": ["expert.weight"], "clipped": True, "reset": True}, res


@pytest.mark.parametrize("case", ["inf_on_rank_1_idle_rank_0",
                                  "inf_on_rank_1_idle_rank_0_update_each"])
def test_a_rank_whose_experts_got_no_gradient_keeps_the_scales_together_too(case):
    """A rank that does not step the experts' optimizer in a round (their gradients
    None there), even where that leaves it one update() fewer (each step with its
    own): the scales are taken together at scale(), which every rank calls once per
    backward. (Shared at update() after that optimizer's unscale_, this rank went on
    while the others waited in the collective until the group's timeout.)"""
    per_rank = loss_scaling_results()
    scales = [res[case]["scales"] for res in per_rank]
    assert scales[0] == scales[1] and scales[0][2] == 512.0, scales


def test_an_expert_module_replaced_after_wrapping_is_the_one_reset_and_clipped():
    for res in run_distributed(2, expert_scenarios.expert_module_replaced_after_wrapping):
        assert res == {"covered": ["expert.weight", "expert.bias"], "reset": True}, res


def test_the_scale_grows_again_after_an_inf_on_one_rank():
    """The rank whose scale came down to the others' starts its growth count again
    with theirs: before, each rank grew alone, the smallest undid it, and the scale
    never grew again."""
    scales = loss_scaling_results()[0]["inf_on_rank_1_growing"]["scales"]
    assert scales == [1024.0, 1024.0, 512.0, 512.0, 1024.0, 1024.0, 2048.0], scales


def test_two_losses_scaled_for_one_backward():
    """scale() called twice before one backward: the scale is a new tensor each time
    the ranks agree on it (written in place, the first product's backward raised)."""
    for res in loss_scaling_results():
        assert res["two_losses"]["scales"] == [1024.0] * 4


def test_experts_replicated_on_r_ranks_count_once_with_ignored_parameter_replicas():
    """4 ranks, each expert on 2 of them (expert-data-parallel), clipped by one norm
    counting each expert once (as Megatron counts them): with
    ``ignored_parameter_replicas=2`` ours matches torch DDP clipped so; with the
    default (each rank's own counted, the experts twice) the norm is larger and the
    runs part."""
    for rank, res in enumerate(run_distributed(4, expert_scenarios.replicated_experts_both)):
        counted_once, counted_twice = res[2], res[1]
        for ours, ref in counted_once["norms"]:
            assert ref > 0.05, (rank, ref)  # every step clips
            assert ours == pytest.approx(ref, rel=1e-6), (rank, ours, ref)
        assert counted_once["shared_diff"] <= 2e-5, (rank, counted_once["shared_diff"])
        assert counted_once["expert_diff"] <= 2e-5, (rank, counted_once["expert_diff"])
        assert all(ours > ref * (1 + 1e-3) for ours, ref in counted_twice["norms"][:1]), \
            (rank, counted_twice["norms"])
        assert counted_twice["expert_diff"] > 1e-4, (rank, counted_twice["expert_diff"])
