"""master_weights=True: 16-bit parameters stepped through float32 copies of each rank's
slice, against torch DDP with a float32 master copy of every parameter (see
master_weights_scenarios.py). On 2 ranks the two sides round alike at every
point, so the parameters must be equal bit for bit after every step."""
import pytest

from . import master_weights_scenarios
from .dist_harness import run_distributed

CASES = [
    {"schedule": "serial"},
    {"schedule": "overlap_backward"},
    {"schedule": "next_forward"},
    # The layout plan speculates from the first step; clipping at 0.05 rolls every
    # speculative step back (the masters restored with the slices).
    {"schedule": "two_stage"},
    {"schedule": "two_stage", "clip": 0.05},
    # The loop writes a parameter between steps: the master takes the written value.
    {"schedule": "next_forward", "write_at": 2},
    {"schedule": "two_stage", "write_at": 2},
    # The loop writes the optimizer's own tensors (the masters) in place: a weight
    # decay before the step (two_stage refuses it after a speculative step), and
    # after it, where the next step takes it.
    {"schedule": "next_forward", "decay": "before_step"},
    {"schedule": "serial", "decay": "before_step", "clip": 0.05},
    {"schedule": "two_stage", "decay": "after_step"},
    {"schedule": "two_stage", "decay": "after_step_data"},
    # Both between two steps: each write stands (the decay of every master, the
    # value written into one parameter).
    {"schedule": "next_forward", "decay": "after_step", "write_at": 3},
    # A WGAN's clamp through p.data after every step.
    {"schedule": "two_stage", "clamp": 0.05},
    # A step skipped for its inf gradient, its speculative steps undone, then a
    # parameter written by the loop: the write stands (the undo wrote the masters).
    {"schedule": "two_stage", "inf_at": 1, "write_at": 2},
    # Megatron's grad_reduce_in_fp32: reduced into the float32 gradient slice directly.
    {"schedule": "two_stage", "reduce_dtype": "float32", "clip": 0.05},
    # Accumulation with every micro-batch reduced: added up in the float32 slice.
    {"schedule": "next_forward", "reduce_dtype": "float32", "micro": 3},
    # The loop edits p.grad in opt.summon_full_grads() (the reference its own p.grad):
    # edited elements take the 16-bit value written, as torch's p.grad does.
    {"schedule": "two_stage", "edit": True},
    {"schedule": "next_forward", "edit": True, "clip": 0.05},
    # float16 with loss scaling (refused without master weights: the gradients
    # would be float16), and a scale that overflows every step: all skipped.
    {"dtype": "float16", "schedule": "two_stage", "init_scale": 2.0 ** 10, "lr": 1e-3},
    {"dtype": "float16", "schedule": "next_forward", "init_scale": 2.0 ** 40, "lr": 1e-3},
]


def _name(case):
    return "-".join(f"{k}={v}" for k, v in case.items())


@pytest.fixture(scope="module")
def side_by_side():
    return run_distributed(2, master_weights_scenarios.side_by_side_many, CASES,
                           timeout_s=300)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_name(c) for c in CASES])
def test_matches_torch_ddp_with_float32_masters_bitwise(side_by_side, index):
    case = CASES[index]
    for rank, per_case in enumerate(side_by_side):
        res = per_case[index]
        assert res["apart"] == [0.0] * 5 and res["bitwise"], (rank, case, res["apart"])
        assert res["param_dtypes"] == [f"torch.{case.get('dtype', 'bfloat16')}"]
        assert res["master_dtypes"] == res["grad_dtypes"] == ["torch.float32"]
        # Sharded: each rank keeps masters of its own slice alone (the MLP has 1770
        # elements, padded in the buckets).
        assert 2 * res["master_elements"] == 2 * res["slice_elements"] \
            == res["bucket_elements"] >= 1770
        if res["full_grads_equal"] is not None:
            assert res["full_grads_equal"], (rank, case)
            assert res["norm_dtype"] == "torch.float32"
        if case.get("init_scale") == 2.0 ** 40:
            assert res["skipped"] == 5 and res["masters_read_equal"] is None
            assert res["scale"][0] == res["scale"][1] < 2.0 ** 40
        else:
            assert res["skipped"] == (1 if "inf_at" in case else 0), (rank, case)
            assert res["masters_read_equal"], (rank, case)
        if "inf_at" in case:
            assert res["rollbacks"] > 0, res
        if case == {"schedule": "two_stage", "clip": 0.05}:
            assert res["rollbacks"] > 0 and res["commits"] == 0, res
        if case == {"schedule": "two_stage"}:
            assert res["commits"] > 0 and res["rollbacks"] == 0, res
        if case == {"schedule": "two_stage", "edit": True}:
            assert res["rollbacks"] > 0, res  # the speculative steps took the unedited


def test_hierarchical_2x2_stays_close_to_torch_ddp_with_float32_masters():
    # Four ranks sum in another order than the reference's all-reduce: float32
    # roundings apart, which can flip a bfloat16 rounding (a place is 2^-8 relative).
    case = {"schedule": "two_stage", "reduce_dtype": "float32", "local_size": 2,
            "clip": 0.05}
    for rank, res in enumerate(run_distributed(4, master_weights_scenarios.side_by_side,
                                               case, timeout_s=300)):
        assert max(res["apart"]) <= 2e-2, (rank, res["apart"])
        assert res["master_dtypes"] == res["grad_dtypes"] == ["torch.float32"]
        # A quarter of every bucket's elements (padded) on each rank.
        assert 4 * res["master_elements"] == res["bucket_elements"] >= 1770


def test_writing_the_masters_after_a_speculative_step_raises():
    for rank, message in enumerate(run_distributed(
            2, master_weights_scenarios.decayed_after_speculation)):
        assert "was changed in place between backward and opt.step()" in message, \
            (rank, message)


def test_small_updates_add_up_through_master_weights():
    # AdamW at lr 1e-4 for 20 steps: in bfloat16 most updates fall below half a
    # place of their weight and vanish.
    for rank, moved in enumerate(run_distributed(2, master_weights_scenarios.small_updates)):
        assert moved[False] < 0.3 and moved[True] > 2 * moved[False], (rank, moved)


def test_checkpoints_keep_the_master_weights():
    for rank, by_how in enumerate(run_distributed(2, master_weights_scenarios.resumed_both,
                                                  timeout_s=300)):
        full, shard = by_how["full"], by_how["shard"]
        assert full["keys"] == ["exp_avg", "exp_avg_sq", "master_param", "step"]
        assert full["master_dtype"] == "torch.float32" and full["master_rounds_to_param"]
        assert "master_weights" in shard["keys"] and shard["master_rounds_to_param"]
        for how, res in by_how.items():
            # Resumed from the checkpoint: bit for bit the run that went on. Without
            # its master weights the masters restart from the rounded parameters.
            assert res["with masters"] and not res["without masters"], (rank, how, res)
            # Loaded into the running optimizer, whose masters held later values.
            assert not res["without masters, same optimizer"], (rank, how, res)
            assert res["same optimizer as a fresh one"], (rank, how, res)


def test_same_bits_at_any_size_and_offset():
    # The CPU's test for writes to the parameters: 64-bit words where aligned, else
    # 16-bit ones; a changed last element and -0.0 against 0.0 both count.
    import torch
    from fgpsdp_runtime.slice_pieces import same_bits
    base = torch.arange(1, 24, dtype=torch.bfloat16)
    for lo, hi in [(0, 8), (1, 9), (0, 7), (3, 22), (4, 20)]:
        for at in (2, 4):  # b aligned otherwise, and alike
            a = base[lo:hi]
            b = torch.zeros(30, dtype=torch.bfloat16)[at:at + a.numel()]
            b.copy_(a)
            assert same_bits(a, a.clone()) and same_bits(a, b), (lo, hi, at)
            b[-1] = -b[-1]
            assert not same_bits(a, b), (lo, hi, at)
    assert not same_bits(torch.zeros(3, dtype=torch.bfloat16),
                          -torch.zeros(3, dtype=torch.bfloat16))
