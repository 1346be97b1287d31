"""torch DDP's constructor keywords mean here what they mean there.

Every keyword is given alike to torch DDP and to fgpsdp on 3 CPU ranks with
rank-local starting parameters and BatchNorm statistics: what construction
syncs, and where 4 steps end, must match torch DDP's rank by rank.
"""
import functools
import inspect

import pytest
import torch

import fgpsdp_runtime as fgp

from . import ddp_keyword_scenarios
from .dist_harness import run_distributed

TOL = 2e-5  # as test_equivalence: 3 ranks sum in another order than torch's ring

CONFIGS = {
    "defaults": {"kw": {}},
    # Rank-local buffers stay out of the init sync too (torch's rule, old and new).
    "broadcast_buffers_off": {"kw": {"broadcast_buffers": False}},
    # torch 2.13: buffers synced at init, not at each forward.
    "forward_sync_buffers_off": {"kw": {"forward_sync_buffers": False}},
    "init_sync_off": {"kw": {"init_sync": False}},
    "device_mesh": {"kw": {"device_mesh": True}},
    # Backward fills out.* first (480 bytes: closes at 419), then bn.* (184 >= 104),
    # then body.weight alone.
    "bucket_cap_mb_list": {"kw": {"bucket_cap_mb_list": [0.0004, 0.0001]}},
    # Rank-local: a frozen parameter and a BatchNorm statistic, never broadcast.
    "params_and_buffers_to_ignore": {"kw": {}, "ignore": ["frozen.weight", "bn.running_mean"]},
    "accepted_unneeded": {"kw": {"skip_all_reduce_unused_params": True,
                                 "batched_grad_copy": True, "static_graph": True,
                                 "gradient_as_bucket_view": True}},
    "late_static_graph": {"kw": {}, "late_static_graph": True},
}


@functools.lru_cache(maxsize=None)
def results():
    return run_distributed(3, ddp_keyword_scenarios.train_many_with_keywords, CONFIGS)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_keyword_acts_as_in_torch_ddp(name):
    for rank, per_config in enumerate(results()):
        res = per_config[name]
        ours, theirs = res["own_params_kept"]
        assert ours == theirs, (rank, "parameters synced at construction unlike torch DDP")
        ours, theirs = res["own_buffers_kept"]
        assert ours == theirs, (rank, "buffers synced at construction unlike torch DDP")
        assert res["broadcast_buffers"][0] == res["broadcast_buffers"][1]
        for attribute, ours, theirs in res["attributes"]:
            assert ours == theirs, (attribute, ours, theirs)
        assert res["same_process_group"], (rank, "model.process_group is not torch DDP's")
        assert res["param_diff"] <= TOL, (rank, res)
        assert res["buffer_diff"] <= TOL, (rank, res)


def test_the_scenarios_can_tell_syncs_apart():
    """Rank 1 keeps its own buffers only where torch DDP skips the init sync."""
    rank1 = results()[1]
    kept = {name: res["own_buffers_kept"][1] for name, res in rank1.items()}
    assert kept == {name: name in ("broadcast_buffers_off", "init_sync_off") for name in CONFIGS}
    assert rank1["init_sync_off"]["own_params_kept"] == (True, True)
    assert rank1["defaults"]["own_params_kept"] == (False, False)


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
    return run_distributed(2, ddp_keyword_scenarios.rank_local_experts_many, EXPERT_CONFIGS)


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


def test_bucket_cap_mb_list_sets_each_buckets_cap():
    assert results()[0]["bucket_cap_mb_list"]["n_buckets"] == 3
    # The largest entry, in whole bytes (419).
    assert results()[0]["bucket_cap_mb_list"]["bucket_cap_mb"] == pytest.approx(0.0004, abs=2**-20)
    assert results()[0]["defaults"]["n_buckets"] == 1


def test_signature_takes_torch_ddps_parameters_in_its_order():
    """Positional calls written for this torch's DDP bind to the same parameters."""
    theirs = [n for n in inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters]
    ours = [n for n, p in inspect.signature(fgp.DistributedDataParallel).parameters.items()
            if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert ours[:len(theirs)] == theirs


def test_device_ids_name_a_gpu_by_index_of_any_integer_type():
    """torch DDP's device_ids take an int or a device; an integer-like value (a numpy
    int, a 0-dim integer tensor) was accepted by the check and then crashed every
    forward's move of the inputs (torch.device(tensor); found by review)."""
    import numpy as np
    import torch

    from fgpsdp_runtime.ddp_options import named_device
    cuda1 = torch.device("cuda", 1)
    for device_id in (1, np.int64(1), torch.tensor(1), "cuda:1", cuda1):
        assert named_device(device_id) == cuda1, device_id


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
    rank0 = run_distributed(2, ddp_keyword_scenarios.experts_through_a_join_and_without)[0]
    assert rank0["join"]["norms"] == rank0["zeros"]["norms"]
    assert all(torch.equal(a, b) for a, b in zip(rank0["join"]["shared"], rank0["zeros"]["shared"]))


@functools.lru_cache(maxsize=None)
def loss_scaling_results():
    return run_distributed(2, ddp_keyword_scenarios.experts_under_loss_scaling_cases)


@pytest.mark.parametrize("updates", ["", "_update_each_sharded_first",
                                     "_update_each_experts_first"])
def test_an_inf_in_one_ranks_experts_moves_every_ranks_loss_scale(updates):
    """torch's scaler backs off on the rank whose experts' optimizer found the inf
    only; the scales then parted for good, and the next reduce-scatters summed
    gradients scaled apart (each rank unscaling its slices by its own): the
    replicated parameters went wrong, silently. Now every rank backs off, and the
    run ends where one with the inf on every rank does."""
    per_rank = loss_scaling_results()
    one, both = "inf_on_rank_1" + updates, "inf_on_both" + updates
    assert per_rank[0][one]["scales"] == per_rank[1][one]["scales"]
    assert per_rank[0][one]["scales"] == per_rank[0][both]["scales"]
    assert per_rank[0][both]["scales"][1] == 512.0  # (the back-off)
    for res in per_rank:
        assert all(torch.equal(a, b) for a, b in zip(res[one]["shared"], res[both]["shared"]))


def test_clip_ignored_parameters_warns_of_expert_gradients_still_loss_scaled():
    for res in loss_scaling_results():
        assert res["clip_unscaled_first"]["warnings"] == []
        said = res["clip_still_scaled"]["warnings"]
        assert len(said) == 1 and "still loss-scaled" in said[0], said


def test_a_torch_checkpoint_with_the_experts_state_says_it_is_not_loaded():
    for res in run_distributed(2, ddp_keyword_scenarios.torch_checkpoint_with_expert_state):
        assert res["loaded"] == [0, 1, 4, 5], res  # the rest is
        assert len(res["warnings"]) == 1, res["warnings"]
        assert "holds the state of 2 parameter(s) named in _ddp_params_and_buffers_to_ignore " \
               "('expert.weight', 'expert.bias')" in res["warnings"][0]


def test_a_scale_given_to_one_ranks_update_does_not_hang_the_others():
    """update() shares the experts' infs in a collective whether or not it is given
    a scale (torch's would only let the scales differ, as the loop asked)."""
    per_rank = loss_scaling_results()
    assert per_rank[0]["new_scale_on_rank_0"]["scales"][2] == 2048.0
    assert per_rank[1]["new_scale_on_rank_0"]["scales"][2] == 1024.0


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
