"""reduce_dtype: gradients packed, reduced and sent in another dtype than the parameters'.

Compared with torch DDP running a communication hook that casts its buckets
to the same dtype, divides there and all-reduces (torch's bf16_compress_hook
for bfloat16): on 2 ranks the one addition per element rounds the same way,
so the parameters must be equal bit for bit.
"""
import pytest

from . import reduce_dtype_scenarios
from .dist_harness import run_distributed

TWO_RANK_CASES = [
    {"reduce_dtype": "bfloat16", "schedule": "serial"},
    {"reduce_dtype": "bfloat16", "schedule": "overlap_backward"},
    {"reduce_dtype": "bfloat16", "schedule": "next_forward", "micro": 2, "accumulate": "no_sync"},
    {"reduce_dtype": "bfloat16", "schedule": "two_stage"},
    {"reduce_dtype": "bfloat16", "schedule": "two_stage", "clip": 1.0},
    # The profile plan from step 4 on, its link fitted to half-size reduce-scatters.
    {"reduce_dtype": "bfloat16", "schedule": "two_stage", "plan": "auto"},
    {"reduce_dtype": "bfloat16", "schedule": "two_stage", "micro": 2, "accumulate": "synced"},
    # Megatron's grad_reduce_in_fp32: bfloat16 parameters, float32 reduction.
    {"reduce_dtype": "float32", "param_dtype": "bfloat16", "schedule": "two_stage"},
    # bfloat16 gradients clipped: the coefficient applied at float32 precision, as
    # torch's clip_grad_norm_ does (a Python float was rounded to bfloat16 first).
    {"reduce_dtype": "bfloat16", "param_dtype": "bfloat16", "schedule": "next_forward",
     "clip": 0.05},
]
FOUR_RANK_CASES = [
    {"reduce_dtype": "bfloat16", "schedule": "two_stage", "local_size": 2},
]


def _name(case):
    return "-".join(f"{k}={v}" for k, v in case.items())


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(2, reduce_dtype_scenarios.reduced_many, TWO_RANK_CASES,
                           timeout_s=300)


@pytest.mark.parametrize("index", range(len(TWO_RANK_CASES)),
                         ids=[_name(c) for c in TWO_RANK_CASES])
def test_matches_torch_ddp_with_the_same_reduction_bitwise(two_ranks, index):
    case = TWO_RANK_CASES[index]
    # Several reduced backwards per step: torch DDP reduces the gradient it has
    # accumulated so far again (re-rounding it to bfloat16 each time), fgpsdp
    # only the new one, adding in float32 (3.4e-4 apart after 5 steps).
    tolerance = 1e-3 if case.get("accumulate") == "synced" else 0.0
    for rank, per_case in enumerate(two_ranks):
        res = per_case[index]
        assert res["diff_to_ddp"] <= tolerance, (rank, case, res["diff_to_ddp"])
        assert res["send_dtypes"] == [f"torch.{case['reduce_dtype']}"]
        assert res["grad_dtypes"] == [f"torch.{case.get('param_dtype', 'float32')}"]
        if case.get("plan") == "auto":
            assert res["plan_source"] == "profile", (rank, res["plan_source"])


def test_bfloat16_reduction_halves_the_reduce_scatter_bytes(two_ranks):
    for per_case in two_ranks:
        flat = per_case[TWO_RANK_CASES.index(
            {"reduce_dtype": "bfloat16", "schedule": "serial"})]["comm_stats"]["flat"]
        assert flat["reduce_scatter"] * 2 == flat["all_gather"] > 0


def test_hierarchical_bfloat16_reduction_stays_close_to_torch_ddp():
    # Four ranks sum in another order than torch DDP's ring, in bfloat16.
    for rank, per_case in enumerate(run_distributed(
            4, reduce_dtype_scenarios.reduced_many, FOUR_RANK_CASES, timeout_s=300)):
        res = per_case[0]
        assert res["diff_to_ddp"] <= 1e-3, (rank, res["diff_to_ddp"])
        inter = res["comm_stats"]["inter"]
        assert inter["reduce_scatter"] * 2 == inter["all_gather"] > 0


THREE_RANK_CASES = [
    {"reduce_dtype": "bfloat16", "schedule": "serial"},
    {"reduce_dtype": "bfloat16", "schedule": "serial", "hook": "scaled first"},
    {"reduce_dtype": "bfloat16", "schedule": "two_stage", "hook": "scaled first"},
]


def test_from_three_ranks_bfloat16_reduction_rounds_as_scaled_before_the_cast():
    """1/N is exact on 2 ranks; from 3 on, fgpsdp's gradients are scaled in their own
    dtype before the cast to bfloat16 and summed in float32, where torch's
    bf16_compress_hook casts, then divides and sums in bfloat16: one bfloat16
    rounding apart (docs/semantics.md says so). With a hook that rounds as fgpsdp does,
    bitwise."""
    for rank, per_case in enumerate(run_distributed(
            3, reduce_dtype_scenarios.reduced_many, THREE_RANK_CASES, timeout_s=300)):
        torchs_hook, scaled_first, two_stage = per_case
        # AdamW moves an element by up to its lr (1e-2) a step whatever the
        # gradient's size: a rounding apart can flip a small gradient's update.
        assert 0.0 < torchs_hook["diff_to_ddp"] <= 5 * 1e-2, (rank, torchs_hook["diff_to_ddp"])
        assert scaled_first["diff_to_ddp"] == 0.0, (rank, scaled_first["diff_to_ddp"])
        assert two_stage["diff_to_ddp"] == 0.0, (rank, two_stage["diff_to_ddp"])


# torch's own hooks registered on fgpsdp's wrapper (built without reduce_dtype) and on
# torch DDP alike: allreduce_hook, fp16/bf16_compress_hook and the compress wrappers of
# allreduce_hook set the dtype gradients travel in. "scaled first": torch DDP's side
# runs a hook that rounds as fgpsdp does (1/N in the gradients' dtype, then the cast).
HOOK_CASES = [
    {"hook": "bf16_compress_hook"},
    {"hook": "bf16_compress_hook", "schedule": "next_forward", "clip": 1.0},
    {"hook": "bf16_compress_wrapper(allreduce_hook)", "schedule": "serial", "state": "group"},
    {"hook": "fp16_compress_hook", "reference": "scaled first"},
    {"hook": "fp16_compress_wrapper(allreduce_hook)", "reference": "scaled first"},
    {"hook": "fp16_compress_hook", "param_dtype": "bfloat16"},
    {"hook": "allreduce_hook"},
    {"hook": "fp16_compress_hook"},
]


@pytest.fixture(scope="module")
def hooked():
    return run_distributed(2, reduce_dtype_scenarios.hooked_many, HOOK_CASES, timeout_s=300)


@pytest.mark.parametrize("index", range(len(HOOK_CASES) - 1),
                         ids=[_name(c) for c in HOOK_CASES[:-1]])
def test_torchs_hook_registered_matches_torch_ddp_bitwise(hooked, index):
    case = HOOK_CASES[index]
    wire = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}.get(
        case["hook"][:4], f"torch.{case.get('param_dtype', 'float32')}")
    for rank, per_case in enumerate(hooked):
        res = per_case[index]
        assert res["diff_to_ddp"] == 0.0, (rank, case, res["diff_to_ddp"])
        assert res["send_dtypes"] == [wire], (rank, case, res["send_dtypes"])
        flat = res["comm_stats"]["flat"]
        # float32 parameters: a 2-byte wire halves the reduce-scatter's bytes.
        if case.get("param_dtype") is None and wire != "torch.float32":
            assert flat["reduce_scatter"] * 2 == flat["all_gather"] > 0, (rank, case, flat)
        else:
            assert flat["reduce_scatter"] == flat["all_gather"] > 0, (rank, case, flat)


def test_torchs_fp16_compress_hook_rounds_small_gradients_once_where_torch_rounds_twice(hooked):
    """torch's fp16_compress_hook casts to float16, then divides by N; fgpsdp scales
    first. Gradients below float16's normal range (6.1e-5 x N) are rounded again by
    torch's division: a few ulps apart after 5 steps (bitwise with the "scaled first"
    reference above)."""
    for rank, per_case in enumerate(hooked):
        res = per_case[len(HOOK_CASES) - 1]
        assert 0.0 < res["diff_to_ddp"] <= 1e-4, (rank, res["diff_to_ddp"])
        assert res["send_dtypes"] == ["torch.float16"]
