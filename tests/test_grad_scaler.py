"""float16 loss scaling: fgpsdp + ShardedGradScaler trains as torch DDP + torch.amp.GradScaler.

The reduced gradients live in each rank's slices, so torch's scaler can
neither unscale them nor see an inf that landed in another rank's slice.
Every case overflows at least once: on rank 0 alone at step 5 (its loss
times inf), and under float16 autocast in the first steps (a scale of 2**20),
where only some gradient elements overflow, so the inf lands in some ranks'
slices only (with each rank's own flag instead, 15 cases here failed): every
rank must still skip those steps and back the scale off alike.
"""
import math

import pytest
import torch

from fgpsdp_runtime.ddp_options import SCHEDULES

from . import grad_scaler_scenarios
from .dist_harness import run_distributed

CASES = [{"schedule": s, "precision": "autocast_float16", "clip": clip, "rank0_overflows_at": 5}
         for s in SCHEDULES for clip in (None, "optimizer", "manual")]
CASES += [{"schedule": s, "precision": "float32", "clip": "optimizer", "rank0_overflows_at": 5}
          for s in SCHEDULES]
# The loop skips scaler.step itself when clip_grad_norm_ says inf (with the scaler
# off, the same loop without loss scaling).
CASES += [{"schedule": s, "precision": p, "clip": "manual", "rank0_overflows_at": 5,
           "loop_skips": True, "enabled": enabled}
          for s, p, enabled in (("two_stage", "autocast_float16", True),
                                ("next_forward", "float32", True),
                                ("two_stage", "float32", False))]
# clip_grad_value_ after unscale_ clamps the overflow's inf: the scaler still skips.
CASES += [{"schedule": s, "precision": "autocast_float16", "clip": "value",
           "rank0_overflows_at": 5} for s in ("next_forward", "two_stage")]
# A forward between unscale_ and the step (logging): the step skips by what unscale_
# found (before: it measured again, found the inf clamped away and stepped, or
# warned of an inf norm).
CASES += [{"schedule": s, "precision": "autocast_float16", "clip": clip,
           "rank0_overflows_at": 5, "eval_forward": True}
          for s, clip in (("serial", "value"), ("two_stage", "value"), ("two_stage", "manual"))]
DISABLED = {"schedule": "two_stage", "enabled": False}
# The clip before unscale_, on both: the same steps, and one warning (also with an
# evaluation forward between the clip and the step, which measures again).
BEFORE_UNSCALE = [{"schedule": s, "precision": "float32", "clip": "before_unscale",
                   "eval_forward": evaluation}
                  for s, evaluation in (("next_forward", False), ("two_stage", False),
                                        ("two_stage", True))]
# unscale_, the clip and zero_grad through a wrapper whose class mixes the optimizer's
# in (Lightning's manual optimization), the step on the optimizer itself.
THROUGH_A_WRAPPER = [{"schedule": s, "precision": "autocast_float16", "clip": "manual",
                      "rank0_overflows_at": 5, "through_a_wrapper": True}
                     for s in ("next_forward", "two_stage")]
THREE_RANK_CASES = [{"schedule": s, "precision": "autocast_float16", "clip": "manual",
                     "rank0_overflows_at": 5} for s in ("next_forward", "two_stage")]


def _name(case):
    name = "-".join(str(case.get(k)) for k in ("schedule", "precision", "clip"))
    return name + ("-loop_skips" if case.get("loop_skips") else "") + \
        ("-eval_forward" if case.get("eval_forward") else "") + \
        ("-disabled" if case.get("enabled") is False else "")


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(2, grad_scaler_scenarios.scaled_many,
                           CASES + [DISABLED] + BEFORE_UNSCALE + THROUGH_A_WRAPPER,
                           timeout_s=600)


@pytest.fixture(scope="module")
def three_ranks():
    return run_distributed(3, grad_scaler_scenarios.scaled_many, THREE_RANK_CASES,
                           timeout_s=600)


def _check(case, per_rank, tolerance):
    for rank, res in enumerate(per_rank):
        where = (rank, _name(case))
        assert res["diff_to_ddp"] <= tolerance, (where, res["diff_to_ddp"])
        # The same steps skipped and the same scale after every update, on every rank.
        assert res["scales"] == res["ref_scales"], where
        assert res["scaler_state"] == res["ref_scaler_state"], where
        assert res["hook_calls"]["ours"] == res["hook_calls"]["ref"], where
        if case.get("enabled", True):
            assert res["step_warnings"] == [], where  # a skip under loss scaling is routine
        if case.get("loop_skips"):
            # Skipped by the loop (the next steps must measure their own gradients):
            # none left for the optimizer to skip.
            assert res["skipped"] == 0, where
            assert res["hook_calls"]["ours"] < len(res["scales"]), where
        else:
            assert res["skipped"] == res["ref_skipped"] >= (4 if case["precision"] ==
                                                            "autocast_float16" else 1), where
        if case["clip"] == "manual":
            assert list(map(repr, res["norms"])) == list(map(repr, per_rank[0]["norms"])), where
            for ours, ref in zip(res["norms"], res["ref_norms"]):
                if math.isfinite(ref):  # clip_grad_norm_'s total is float32, as torch's
                    assert ours == pytest.approx(ref, rel=1e-6), where
                else:
                    assert not math.isfinite(ours), where
        if case["schedule"] == "two_stage" and case.get("enabled", True):
            # It speculated at the first step, before the scale was known: undone, then off.
            assert res["rollbacks"] > 0 and res["commits"] == 0, where
            assert "loss-scaled" in res["speculation_stopped"], where


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_name(c) for c in CASES])
def test_loss_scaled_training_matches_torch_ddp_on_two_ranks(two_ranks, index):
    _check(CASES[index], [per_rank[index] for per_rank in two_ranks], tolerance=0.0)


@pytest.mark.parametrize("index", range(len(THREE_RANK_CASES)),
                         ids=[_name(c) for c in THREE_RANK_CASES])
def test_loss_scaled_training_matches_torch_ddp_on_three_ranks(three_ranks, index):
    # Three ranks sum in another order than torch DDP's all-reduce.
    _check(THREE_RANK_CASES[index], [per_rank[index] for per_rank in three_ranks],
           tolerance=2e-5)


def test_disabled_scaler_steps_directly_and_keeps_speculation(two_ranks):
    for rank, per_rank in enumerate(two_ranks):
        res = per_rank[len(CASES)]
        assert res["diff_to_ddp"] == 0.0, rank
        assert res["scales"] == res["ref_scales"] == [1.0] * len(res["scales"]), rank
        assert res["commits"] > 0 and res["speculation_stopped"] is None, rank


@pytest.mark.parametrize("index", range(len(BEFORE_UNSCALE)),
                         ids=[_name(c) for c in BEFORE_UNSCALE])
def test_a_clip_before_unscale_clips_the_scaled_gradients_as_torchs_and_warns_once(
        two_ranks, index):
    # Before: silent (Lightning's MixedPrecision plugin with fgp.ShardedGradScaler and
    # opt.clip_grad_norm_ in configure_gradient_clipping clipped the scaled gradients).
    for rank, per_rank in enumerate(two_ranks):
        res = per_rank[len(CASES) + 1 + index]
        assert res["diff_to_ddp"] == 0.0, (rank, res["diff_to_ddp"])
        assert res["scales"] == res["ref_scales"], rank
        assert res["norms"] == pytest.approx(res["ref_norms"], rel=1e-6), rank
        assert min(res["norms"]) > 1e3  # the scaled gradients' norm: the clip bound
        assert len(res["step_warnings"]) == 1, (rank, res["step_warnings"])
        assert "ran before scaler.unscale_(opt)" in res["step_warnings"][0]


@pytest.mark.parametrize("index", range(len(THROUGH_A_WRAPPER)),
                         ids=[_name(c) for c in THROUGH_A_WRAPPER])
def test_calls_through_a_wrapper_mixing_in_the_optimizers_class_act_on_the_optimizer(
        two_ranks, index):
    # Before: the methods ran on Lightning's LightningOptimizer, which kept what they
    # wrote (the clip's and unscale_'s step-wide state), and the scaler keyed the
    # unscale_ by the wrapper: the step on the optimizer unscaled again.
    per_rank = [results[len(CASES) + 1 + len(BEFORE_UNSCALE) + index] for results in two_ranks]
    for rank, res in enumerate(per_rank):
        written = res["written_on_the_wrapper"]
        assert written == ["_optimizer"], (rank, written)
    _check(THROUGH_A_WRAPPER[index], per_rank, tolerance=0.0)


def test_clip_returns_and_scaler_refusals_as_torchs():
    # Before: the total was float32 on a float32 + float64 model, clip_grad_value_
    # refused foreach= (a TypeError), and the scaler stepped a step without gradients
    # and counted it as a good one.
    for out in run_distributed(2, grad_scaler_scenarios.calls_as_torchs, timeout_s=120):
        ours, theirs, diff = out["norm"]
        assert ours == theirs == torch.float64 and diff < 1e-6, out
        assert out["clip_value_foreach"] == "ok", out
        said, torch_said = out["scaler_without_gradients"]
        assert said == torch_said == \
            "AssertionError: No inf checks were recorded for this optimizer.", out
