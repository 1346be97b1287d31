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
    # Caps under one byte: torch DDP takes them (0 bytes: one parameter per bucket).
    "bucket_cap_mb_zero": {"kw": {"bucket_cap_mb": 0}},
    "bucket_cap_mb_under_a_byte": {"kw": {"bucket_cap_mb": 1e-7}},
    "bucket_cap_mb_list_under_a_byte": {"kw": {"bucket_cap_mb_list": [1e-7]}},
    "params_and_buffers_to_ignore": {"kw": {}, "ignore": ["frozen.weight", "bn.running_mean"]},
    "accepted_unneeded": {"kw": {"skip_all_reduce_unused_params": True,
                                 "batched_grad_copy": True, "static_graph": True,
                                 "gradient_as_bucket_view": True},
                          # torch 2.15's: given to torch DDP too where it takes it.
                          ("kw" if "lazy_bucket_allocation" in inspect.signature(
                              torch.nn.parallel.DistributedDataParallel).parameters
                           else "ours_kw"): {"lazy_bucket_allocation": True}},
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


def test_bucket_cap_mb_list_sets_each_buckets_cap():
    assert results()[0]["bucket_cap_mb_list"]["n_buckets"] == 3
    # The largest entry, in whole bytes (419).
    assert results()[0]["bucket_cap_mb_list"]["bucket_cap_mb"] == pytest.approx(0.0004, abs=2**-20)
    assert results()[0]["defaults"]["n_buckets"] == 1


def test_a_cap_under_a_byte_puts_each_parameter_in_a_bucket_of_its_own():
    # Before, every rank raised "bucket_cap_bytes must be > 0, got 0" (0 itself: a
    # refusal torch DDP does not make).
    trainable = sum(p.requires_grad for p in ddp_keyword_scenarios.BatchNormNet().parameters())
    for name in ("bucket_cap_mb_zero", "bucket_cap_mb_under_a_byte",
                 "bucket_cap_mb_list_under_a_byte"):
        assert results()[0][name]["n_buckets"] == trainable, name


@pytest.mark.parametrize("kw", [{"bucket_cap_mb": -1.0}, {"bucket_cap_mb": float("nan")},
                                {"bucket_cap_mb_list": [1.0, -1.0]}])
def test_a_negative_cap_is_refused(kw):
    with pytest.raises(ValueError, match=r"bucket_cap_mb(_list entries)? must be >= 0"):
        fgp.DistributedDataParallel(torch.nn.Linear(2, 2), **kw)


def test_signature_takes_torch_ddps_parameters_in_its_order():
    """Positional calls written for this torch's DDP bind to the same parameters."""
    theirs = [n for n in inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters]
    ours = [n for n, p in inspect.signature(fgp.DistributedDataParallel).parameters.items()
            if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert ours[:len(theirs)] == theirs


def test_manual_backward_finalization_trains_as_torch_ddp():
    """torch 2.15 DDP's ``require_manual_backward_finalization`` / ``finalize_backward()``
    (torch writes the reduced gradients back there): a loop calling them trains as
    torch DDP's, and their misuse raises as in torch. Before, the call raised
    AttributeError."""
    schedules = ["serial", "two_stage"]
    for rank, per_schedule in enumerate(run_distributed(
            2, ddp_keyword_scenarios.manual_backward_finalization_by_schedule, schedules)):
        for schedule, res in per_schedule.items():
            where = (rank, schedule)
            assert res["param_diff"] == 0.0, (where, res)
            assert res["required"] is True
            ours, *theirs = res["unrequested"]
            assert "require_manual_backward_finalization" in ours, where
            assert all(t is not None for t in theirs), (where, theirs)  # torch refuses too
            ours, *theirs = res["inside_no_sync"]
            assert len(ours) == 4 and all("no_sync" in m for m in ours), (where, ours)
            assert all(m is not None for t in theirs for m in t), (where, theirs)
            ours, *theirs = res["after_backward"]
            assert ours == [(False, None)] * 4, (where, ours)
            assert all(raised is None for t in theirs for _, raised in t), (where, theirs)
            if schedule == "two_stage":
                assert res["speculated"] > 0, where  # the overlap ran beside the calls


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



def test_a_data_parallel_slice_of_a_larger_mesh_trains_like_torch_ddp():
    """torch DDP takes ``device_mesh=mesh["dp"]`` beside tensor parallelism of plain
    tensors (Megatron's column- and row-parallel layers over ``mesh["tp"]``, all-reducing
    inside forward and backward); before, fgpsdp refused every sliced mesh."""
    schedules = ["serial", "next_forward", "two_stage"]
    for rank, per_schedule in enumerate(run_distributed(
            4, ddp_keyword_scenarios.data_parallel_slice_of_a_mesh_by_schedule, schedules)):
        for schedule, res in per_schedule.items():
            assert res["group_ranks"] == [rank % 2, rank % 2 + 2], (rank, res["group_ranks"])
            assert res["same_process_group"], rank
            assert res["param_diff"] == 0.0, (rank, schedule, res["param_diff"])
        assert per_schedule["two_stage"]["speculated"] > 0, rank  # stage 1 ran


def test_buffers_registered_or_replaced_after_wrapping_are_broadcast_as_torch_ddp_does():
    """Buffers are read from the module at every forward's broadcast, not fixed at
    wrapping: a buffer registered later, and a statistic given a new tensor, carry rank
    0's values to every rank, bitwise as under torch DDP (2 ranks, each schedule)."""
    schedules = ["serial", "overlap_backward", "next_forward", "two_stage"]
    for rank, per_schedule in enumerate(run_distributed(
            2, ddp_keyword_scenarios.buffers_changed_after_wrapping_by_schedule, schedules)):
        for schedule, res in per_schedule.items():
            assert res["param_diff"] == 0.0, (rank, schedule, res)
            assert res["buffer_diff"] == 0.0, (rank, schedule, res)
            assert res["late"] == [1.0, 1.0, 1.0], (rank, schedule, res["late"])
        assert per_schedule["two_stage"]["speculated"] > 0, rank  # stage 1 ran
