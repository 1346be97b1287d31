"""A user's post-accumulate-grad hooks see and edit the local gradient before it is
reduced, whether registered before or after wrapping, as under torch DDP.

Before, the reducer hooked the parameter tensors itself, so a hook registered after
wrapping ran after the gradient had been taken into its bucket: it saw ``None``.
"""
import pytest

from fgpsdp_runtime.ddp_options import SCHEDULES

from . import autograd_scenarios
from .dist_harness import run_calls

CASES = [(autograd_scenarios.user_grad_hooks_side_by_side, schedule, registered)
         for schedule in SCHEDULES for registered in ("before", "after")]


@pytest.fixture(scope="module")
def results():
    return run_calls(2, CASES, timeout_s=300)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[1]}-{c[2]}" for c in CASES])
def test_gradient_hooks_run_before_the_reduction_as_under_torch_ddp(results, case):
    for outcome in results[case]:
        assert outcome["saw_none"] == 0
        assert outcome["diff"] == 0.0, outcome


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gradients_the_loop_sets_are_reduced_at_the_step(schedule):
    # p.grad = g after torch.autograd.grad: reduced as no_sync()'s (a documented
    # difference from torch DDP, which would leave the ranks apart).
    for diff in run_calls(2, [(autograd_scenarios.gradients_assigned_by_the_loop,
                               schedule)], timeout_s=120).values():
        assert diff == [0.0, 0.0], diff
