"""Tensor (model) parallelism beside the wrapper: one norm over the whole model.

4 CPU ranks as a 2 x 2 ("dp", "tp") mesh: Megatron-style column- and row-parallel
layers of plain tensors over ``mesh["tp"]``, a replicated bias and LayerNorm, the
wrapper over ``mesh["dp"]``. With ``model_parallel_group=mesh["tp"]`` the
ShardedOptimizer clips by Megatron's norm (the marked shards' squares summed over
the tensor-parallel group, the replicated parameters' once), beside torch DDP
clipped so in float64.
"""
import functools

import pytest

from . import model_parallel_scenarios
from .dist_harness import run_distributed

CONFIGS = {
    "two_stage": {"schedule": "two_stage", "clip": "max_grad_norm", "max_norm": 0.05, "mp": True},
    "serial_by_call": {"schedule": "serial", "clip": "call", "max_norm": 0.05, "mp": True},
    "next_forward_by_call": {"schedule": "next_forward", "clip": "call", "max_norm": 0.05,
                             "mp": True},
    # A norm under max_norm: stage 1's speculative steps commit, their squares
    # taken before the step over the counted elements only.
    "two_stage_unclipped": {"schedule": "two_stage", "clip": "call", "max_norm": 1e3,
                            "mp": True},
    # Without the group each tensor-parallel rank clips by its own shards' norm.
    "without_the_group": {"schedule": "serial", "clip": "call", "max_norm": 0.05, "mp": False},
}


@functools.lru_cache(maxsize=None)
def results():
    return run_distributed(4, model_parallel_scenarios.clipped_beside_tensor_parallel_many,
                           CONFIGS)


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "without_the_group"])
def test_the_norm_over_the_model_parallel_group_is_megatrons(name):
    _assert_megatrons_norm(results(), CONFIGS, name, speculating="two_stage_unclipped")


def _assert_megatrons_norm(per_rank: list, configs: dict, name: str, speculating: str) -> None:
    """Config ``name``'s norms are Megatron's on every rank (each step clipping where
    max_norm < 1) and the parameters torch DDP's; config ``speculating`` committed
    speculative steps."""
    for rank, per_config in enumerate(per_rank):
        res = per_config[name]
        for ours, ref in res["norms"]:
            if configs[name]["max_norm"] < 1:
                assert ref > configs[name]["max_norm"], (rank, ref)  # every step clips
            if ours is not None:
                assert ours == pytest.approx(ref, rel=1e-6), (rank, name, ours, ref)
        assert res["param_diff"] <= 1e-6, (rank, name, res["param_diff"])
    if name == speculating:
        assert all(per_config[name]["commits"] > 0 for per_config in per_rank)


def test_without_the_group_each_tensor_parallel_rank_clips_by_its_own_shards():
    per_rank = [per_config["without_the_group"] for per_config in results()]
    # Ranks 0 and 1 are a tensor-parallel pair: their norms part, and from Megatron's.
    assert per_rank[0]["norms"][0][0] != pytest.approx(per_rank[1]["norms"][0][0], rel=1e-3)
    assert all(res["param_diff"] > 1e-4 for res in per_rank), \
        [res["param_diff"] for res in per_rank]


PIPELINE_CONFIGS = {
    "pp x dp two_stage": {"layout": "pp x dp", "schedule": "two_stage", "clip": "max_grad_norm",
                          "max_norm": 0.05, "pp": True},
    "pp x dp serial_by_call": {"layout": "pp x dp", "schedule": "serial", "clip": "call",
                               "max_norm": 0.05, "pp": True},
    "pp x tp next_forward_by_call": {"layout": "pp x tp", "schedule": "next_forward",
                                     "clip": "call", "max_norm": 0.05, "pp": True},
    "pp x tp two_stage_unclipped": {"layout": "pp x tp", "schedule": "two_stage", "clip": "call",
                                    "max_norm": 1e3, "pp": True},
    # Without the group each stage clips by its own norm.
    "pp x dp without_the_group": {"layout": "pp x dp", "schedule": "serial", "clip": "call",
                                  "max_norm": 0.05, "pp": False},
}


@functools.lru_cache(maxsize=None)
def pipeline_results():
    return run_distributed(4, model_parallel_scenarios.clipped_beside_pipeline_stages_many,
                           PIPELINE_CONFIGS)


@pytest.mark.parametrize("name", [n for n in PIPELINE_CONFIGS if "without" not in n])
def test_the_norm_over_pipeline_stages_is_megatrons(name):
    """Megatron's model-parallel group is the tensor-parallel ranks of every stage:
    ``pipeline_parallel_group`` sums the norm over the stages too (every stage's
    parameters count), beside torch DDP clipped so in float64."""
    _assert_megatrons_norm(pipeline_results(), PIPELINE_CONFIGS, name,
                           speculating="pp x tp two_stage_unclipped")


def test_without_the_pipeline_group_each_stage_clips_by_its_own_norm():
    per_rank = [per_config["pp x dp without_the_group"] for per_config in pipeline_results()]
    for res in per_rank:  # ranks 0, 1: stage 0; ranks 2, 3: stage 1
        ours, ref = res["norms"][0]
        assert ours < ref * (1 - 1e-3), (ours, ref)
        assert res["param_diff"] > 1e-4, res["param_diff"]


def test_a_pipeline_schedule_with_the_recipe_trains_as_data_parallel_by_hand():
    """torch.distributed.pipelining's GPipe and 1F1B schedules over each stage's
    wrapper: the schedule under model.no_sync() (one reduction at the step instead of
    one per microbatch), scale_grads=False with the loss divided by the microbatches
    (its scale_grads divides param.grad, None here), pipeline_parallel_group for the
    clip."""
    per_rank = run_distributed(4, model_parallel_scenarios.
                               pipeline_schedule_beside_data_parallel_by_hand,
                               ["serial", "two_stage"])
    for rank, diffs in enumerate(per_rank):
        said = diffs.pop("said")
        assert diffs == {f"{pipeline} {schedule}": 0.0
                         for pipeline in ("ScheduleGPipe", "Schedule1F1B")
                         for schedule in ("serial", "two_stage")}, (rank, diffs)
        # Without it, the warning about reads of param.grad between backward and step
        # names it.
        assert len(said) == 1, (rank, said)


def test_a_loss_scaled_pipeline_skips_an_inf_on_every_stage():
    """The recipe with a ShardedGradScaler on every rank (the first stage setting its
    scale with scaler.scale(torch.zeros(()))): an inf in one stage-1 rank's gradient
    skips the step on every rank, and the scales stay alike; without
    pipeline_parallel_group stage 0 steps on and the scales part."""
    per_rank = run_distributed(4, model_parallel_scenarios.loss_scaled_pipeline_with_an_inf_both)
    for rank, res in enumerate(per_rank):
        assert res[True] == [(False, 1024.0), (True, 512.0), (False, 512.0)], (rank, res)
        stage_1 = rank >= 2
        assert res[False] == ([(False, 1024.0), (True, 512.0), (False, 512.0)] if stage_1
                              else [(False, 1024.0)] * 3), (rank, res)


def test_an_inf_on_one_rank_skips_the_step_on_every_rank_of_both_groups():
    """Rank 0 (data-parallel pair {0, 2}, tensor-parallel pair {0, 1}) holds an inf:
    with the group every rank skips that step; without it, its data-parallel pair
    alone, and the tensor-parallel shards part."""
    per_rank = run_distributed(4, model_parallel_scenarios.an_inf_on_one_rank_both)
    for rank, res in enumerate(per_rank):
        assert res[True] == [False, True, False], (rank, res[True])
        expected = [False, rank % 2 == 0, False]
        assert res[False] == expected, (rank, res[False])
        # A replica's inf on a tensor-parallel rank other than the first, which the
        # norm's squares leave out there: still seen, as Megatron's found_inf sees it.
        assert res["replica on rank 1"] == [False, True, False], (rank, res)


def test_values_clamped_on_one_tensor_parallel_side_then_clipped_by_norm():
    """clip_grad_value_ clamps on one tensor-parallel side only (in the steps where
    tensor-parallel rank 0's shards hold the largest gradients): every rank measures
    the norm again at the step (before, the other side skipped that collective and
    the ranks' collectives parted: a gloo size mismatch)."""
    per_rank = run_distributed(
        4, model_parallel_scenarios.values_clamped_on_one_tensor_parallel_side)
    for rank, res in enumerate(per_rank):
        one_sided = [clamped for one_sided, clamped in res["clamped_here"] if one_sided]
        assert one_sided and one_sided == [rank % 2 == 0] * len(one_sided), \
            (rank, res["clamped_here"])
        assert res["param_diff"] <= 1e-6, (rank, res["param_diff"])
