"""opt.grad_norms(), opt.full_grad(p) and opt.full_state(p): the reduced gradient and
the optimizer state per parameter, as torch DDP's p.grad and a torch optimizer's
opt.state[p] hold them (CPU, gloo)."""
import functools
import math

import pytest
import torch

from .dist_harness import RankError, run_calls, run_distributed
from .grad_read_scenarios import (different_reads, frozen_parameter_state, full_grad_refusals,
                                  grads_beside_torch_ddp, grads_under_join,
                                  norms_of_a_non_finite_gradient, read_after_a_no_sync_backward,
                                  reads_beside_no_sync, torch_clip_beside_a_read)

SCHEDULES = ("serial", "overlap_backward", "next_forward", "two_stage")
# The tied embedding, parameters no backward reaches, frozen ones beside BatchNorm,
# channels_last / column-major layouts, and a parameter of no elements.
MODELS = ("mlp", "tied", "unused", "bn_frozen", "channels_last", "empty_parameter")
FLAT_CALLS = [(grads_beside_torch_ddp, s, m) for s in SCHEDULES for m in MODELS]
UNREAD_CALLS = [(grads_beside_torch_ddp, s, m, 0, False) for s in SCHEDULES for m in MODELS]
JOIN_CALLS = [(grads_under_join, s) for s in SCHEDULES]
NO_SYNC_CALLS = [(reads_beside_no_sync, s, j, r) for s in SCHEDULES for j in (False, True)
                 for r in (True, False)]


@functools.lru_cache(maxsize=None)
def two_ranks():
    return run_calls(2, FLAT_CALLS + UNREAD_CALLS + JOIN_CALLS + NO_SYNC_CALLS
                     + [(full_grad_refusals,), (frozen_parameter_state,),
                        (norms_of_a_non_finite_gradient,), (torch_clip_beside_a_read, "norms"),
                        (torch_clip_beside_a_read, "one full_grad")],
                     timeout_s=600)


@functools.lru_cache(maxsize=None)
def two_nodes_of_two():
    return run_calls(4, [(grads_beside_torch_ddp, s, "mlp", 2) for s in SCHEDULES],
                     timeout_s=600)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gradients_read_bitwise_as_torch_ddp_on_two_ranks(schedule, model):
    """After backward, a clip, the step and zero_grad(): full_grad(p) is torch DDP's
    p.grad bit for bit (shape, strides and dtype too), or None where that is;
    grad_norms() names the parameters with a gradient and their norms; full_state(p)
    holds torch's optimizer state for p."""
    for rank, res in enumerate(two_ranks()[(grads_beside_torch_ddp, schedule, model)]):
        assert res["mismatches"] == [], f"rank {rank}"
        assert res["bit_differences"] == 0, f"rank {rank}"  # -0.0 and NaN bits included
        # Every parameter read through model.module between backward and step, for
        # full_grad(): not torch's clip, so no warning about it.
        assert res["warnings"] == [], f"rank {rank}"
        # full_state() after each step: bitwise torch's before the clip of step 1
        # (whose norm is summed in float64), within rounding after.
        assert res["state_differences"][0] == 0.0, f"rank {rank}"
        assert max(res["state_differences"]) <= 1e-6, f"rank {rank}"
    # The reads change nothing the steps compute: bitwise the run without them.
    unread = two_ranks()[(grads_beside_torch_ddp, schedule, model, 0, False)]
    for rank, (res, other) in enumerate(zip(two_ranks()[(grads_beside_torch_ddp, schedule, model)],
                                            unread)):
        assert all(torch.equal(a, b) for a, b in zip(res["params"], other["params"])), \
            f"rank {rank}"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gradients_read_as_torch_ddp_on_two_nodes_of_two(schedule):
    """Hierarchical 2x2: the same reads, within float rounding (four ranks' sums in
    another order)."""
    for rank, res in enumerate(two_nodes_of_two()[(grads_beside_torch_ddp, schedule, "mlp", 2)]):
        assert res["mismatches"] == [], f"rank {rank}"
        assert res["largest_difference"] <= 1e-6, f"rank {rank}"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gradients_read_under_join_as_torch_ddps(schedule):
    """Uneven inputs: the active rank reads while the other has joined (which
    takes its part in both collectives); the same values as under torch DDP's join."""
    for rank, res in enumerate(two_ranks()[(grads_under_join, schedule)]):
        assert res["mismatches"] == [], f"rank {rank}"
        assert res["reads"] == (2, 4)[rank]


def test_full_grad_refuses_what_is_not_a_bucketed_parameter():
    for said in two_ranks()[(full_grad_refusals,)]:
        assert "not a parameter of the wrapped model" in said["other"]
        assert "slice pieces in opt.param_groups" in said["piece"]
        assert "_ddp_params_and_buffers_to_ignore" in said["ignored"]
        assert "takes a parameter of the model, got str" in said["not a tensor"]
        assert said["frozen"] is None


def _raises_on_both_ranks(fn, argument: str, error: str, words: str) -> None:
    with pytest.raises(RankError) as raised:
        run_distributed(2, fn, argument, timeout_s=120)
    messages = raised.value.messages()
    assert len(messages) == 2
    assert all(error in m and words in m for m in messages.values()), messages


@pytest.mark.parametrize("other", ["parameter", "norms", "frozen", "stranger"])
def test_different_reads_on_different_ranks_raise_on_every_rank(other):
    _raises_on_both_ranks(different_reads, other, "ValueError", "the ranks made different reads")


@pytest.mark.parametrize("read", ["norms", "full_grad"])
def test_a_read_after_a_no_sync_backward_raises_on_every_rank(read):
    _raises_on_both_ranks(read_after_a_no_sync_backward, read, "RuntimeError",
                          "after a backward under no_sync()")


@pytest.mark.parametrize("under_join", [False, True], ids=["plain", "under_join"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_refused_read_after_no_sync_changes_nothing(schedule, under_join):
    """The read after a no_sync() backward is refused on every rank, also under
    model.join() (whose announcement would have reduced those gradients first, apart
    from the rest of the accumulation); after zero_grad(set_to_none=False) it reads
    zeros; and the run ends bitwise where the one without reads does."""
    read = two_ranks()[(reads_beside_no_sync, schedule, under_join, True)]
    unread = two_ranks()[(reads_beside_no_sync, schedule, under_join, False)]
    for rank, (res, other) in enumerate(zip(read, unread)):
        refusals = [s for s in res["said"] if s not in ("read", "zeros")]
        assert len(refusals) == 3 and all("after a backward under no_sync()" in s
                                          for s in refusals), f"rank {rank}: {res['said']}"
        assert res["said"].count("zeros") == 1, f"rank {rank}: {res['said']}"
        assert all(torch.equal(a, b) for a, b in zip(res["params"], other["params"])), \
            f"rank {rank}"


def test_full_state_of_a_frozen_parameter_is_what_torch_gives_it_at_construction():
    for res in two_ranks()[(frozen_parameter_state,)]:
        assert res["keys"] == res["ref_keys"] == ["step", "sum"]
        assert res["equal"]


def test_grad_norms_name_the_parameter_whose_gradient_is_not_finite():
    for norms in two_ranks()[(norms_of_a_non_finite_gradient,)]:
        assert math.isinf(norms["1.weight"])
        assert all(math.isfinite(v) for name, v in norms.items() if name != "1.weight")


@pytest.mark.parametrize("read", ["norms", "one full_grad"])
def test_a_read_does_not_silence_the_warning_about_torchs_clip(read):
    """Only full_grad() of every parameter explains a walk over them: a loop that
    logs grad_norms(), or reads one gradient, and clips with torch's clip over
    model.parameters() (clipping nothing) is warned."""
    for said in two_ranks()[(torch_clip_beside_a_read, read)]:
        assert any("read between backward and opt.step()" in s for s in said), said
