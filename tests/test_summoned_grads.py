"""opt.summon_full_grads(): p.grad holds the whole reduced gradient inside the block,
and the block's edits reach the step, as a torch DDP loop's edits of p.grad do (CPU,
gloo)."""
import functools

import pytest
import torch

from .dist_harness import run_calls
from .summoned_grad_scenarios import (an_expert_frozen_on_one_rank, blocks_that_change_nothing,
                                      calls_inside_the_block, edits_beside_torch_ddp,
                                      error_in_the_block,
                                      ignored_gradients_edited_after_a_read,
                                      masters_partly_edited, refusals, some_parameters)

SCHEDULES = ("serial", "overlap_backward", "next_forward", "two_stage")
# The tied embedding, parameters no backward reaches, channels_last layouts.
MODELS = ("mlp", "tied", "unused", "channels_last")
CLIPS = ("none", "ours", "torch_inside")
EDIT_CALLS = [(edits_beside_torch_ddp, s, m, c) for s in SCHEDULES for m in MODELS
              for c in CLIPS]
# Calls that measure the norm, after which the loop changes an expert's gradient.
WHERE_MEASURED = ("after_read", "after_full_grad", "after_clip", "after_unscale", "in_block")
REFUSALS = ("join", "set_to_none", "stranger", "different")


@functools.lru_cache(maxsize=None)
def two_ranks():
    return run_calls(2, EDIT_CALLS
                     + [(blocks_that_change_nothing, b) for b in ("none", "read", "unwritten")]
                     + [(some_parameters,), (error_in_the_block,), (masters_partly_edited,),
                        (calls_inside_the_block,)]
                     + [(ignored_gradients_edited_after_a_read, w, s)
                        for w in WHERE_MEASURED for s in ("serial", "two_stage")]
                     + [(an_expert_frozen_on_one_rank, c) for c in ("clip", "grad_norms")]
                     + [(refusals, case) for case in REFUSALS],
                     timeout_s=600)


@functools.lru_cache(maxsize=None)
def two_nodes_of_two():
    return run_calls(4, [(edits_beside_torch_ddp, s, "mlp", "ours", 2) for s in SCHEDULES],
                     timeout_s=600)


@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_edits_in_the_block_train_bitwise_as_torch_ddp(schedule, model, clip):
    """Masks, noise and a replaced p.grad, each step, beside torch DDP's loop editing its
    p.grad alike: inside the block p.grad is torch DDP's bit for bit (layout too, None
    where that is None), and the parameters after every step are bitwise torch DDP's
    (with the clip of ours: within rounding, its norm summed in float64 as the reference
    does, and bitwise before the clip's step). torch's own clip inside the block is
    torch DDP's clip: bitwise, and no warning that it clipped nothing."""
    for rank, res in enumerate(two_ranks()[(edits_beside_torch_ddp, schedule, model, clip)]):
        assert res["mismatches"] == [], f"rank {rank}"
        assert res["grads_inside_bits"] == 0, f"rank {rank}"
        assert not res["after"], f"rank {rank}: a p.grad left set after the block"
        assert res["warnings"] == [], f"rank {rank}"
        assert res["differences"] == [0, 0, 0], f"rank {rank}: {res['largest']}"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_edits_in_the_block_on_two_nodes_of_two(schedule):
    """Hierarchical 2x2, where a rank's slice is not its rank's chunk of the bucket: the
    block's p.grad and its edits land where they belong (within the rounding of four
    ranks' sums in another order)."""
    for rank, res in enumerate(two_nodes_of_two()[(edits_beside_torch_ddp, schedule, "mlp",
                                                   "ours", 2)]):
        assert res["mismatches"] == [], f"rank {rank}"
        assert res["largest"] <= 1e-6, f"rank {rank}"


def test_a_block_that_changes_nothing_changes_nothing():
    """Under two_stage with committed speculative steps: a block that only reads, and
    one whose edits are dropped (writeback=False), train bitwise as no block, and no
    speculative step is rolled back for them; the read saw each step's gradient."""
    results = two_ranks()
    for rank in range(2):
        none = results[(blocks_that_change_nothing, "none")][rank]
        assert none["commits"] > 0 and none["rollbacks"] == 0, none
        for block in ("read", "unwritten"):
            res = results[(blocks_that_change_nothing, block)][rank]
            assert all(torch.equal(a, b) for a, b in zip(res["params"], none["params"])), block
            assert (res["commits"], res["rollbacks"]) == (none["commits"], 0), block
        norms = results[(blocks_that_change_nothing, "read")][rank]["norms"]
        assert len(norms) == 4 and all(n > 0 for n in norms)


def test_edits_roll_back_two_stages_speculative_steps():
    """An edit after two_stage's speculative steps undoes them (they took the gradient
    before the edit), and the step redoes them with the edited gradient: bitwise torch
    DDP (test above), with rollbacks."""
    for res in two_ranks()[(edits_beside_torch_ddp, "two_stage", "mlp", "none")]:
        assert res["rollbacks"] > 0


def test_some_parameters():
    for rank, res in enumerate(two_ranks()[(some_parameters,)]):
        # Linear 0's weight and (frozen) bias, linear 2's weight and bias.
        assert res["held"] == [False, False, True, False], f"rank {rank}"
        assert all(res["equal"]), f"rank {rank}"


def test_an_error_in_the_block_leaves_the_gradient_as_it_was():
    for rank, res in enumerate(two_ranks()[(error_in_the_block,)]):
        assert res[True]["said"] == "\"the loop's own error\"", f"rank {rank}"
        assert not any(res[True]["after"]), f"rank {rank}"
        assert all(torch.equal(a, b) for a, b in zip(res[True]["params"], res[False]["params"]))


def test_master_weights_keep_the_float32_values_the_block_leaves():
    """Under master_weights the block's p.grad is the float32 slice rounded to bfloat16;
    after a clip (values bfloat16 cannot hold) the elements it zeroes are 0 and every
    other element keeps its float32 value bit for bit (edits against torch DDP with
    float32 masters: tests/test_master_weights.py)."""
    for rank, res in enumerate(two_ranks()[(masters_partly_edited,)]):
        assert res["dtypes"] == ["torch.bfloat16"], f"rank {rank}"
        assert res["grad_dtype"] == "torch.float32"
        assert not res["representable_before"], f"rank {rank}: the case tests nothing"
        assert res["zeroed"] and res["kept"], f"rank {rank}"


@pytest.mark.parametrize("case,expected", [
    ("join", "RuntimeError: fgpsdp: opt.summon_full_grads() is not supported inside "
             "model.join()"),
    ("set_to_none", "RuntimeError: fgpsdp: summon_full_grads(): p.grad of '1.bias' was set "
                    "to None in the block"),
    ("stranger", "ValueError: fgpsdp: opt.summon_full_grads() is a collective, and the "
                 "ranks made different reads"),
    ("different", "ValueError: fgpsdp: opt.summon_full_grads() is a collective, and the "
                  "ranks named other parameters"),
])
def test_refusals(case, expected):
    """Each raises on every rank (ranks naming other parameters, or one naming a tensor
    not of the model, in the read's agreement, before any gradient is gathered), and
    leaves no p.grad set."""
    for rank, said in enumerate(two_ranks()[(refusals, case)]):
        assert said.startswith(expected), f"rank {rank}: {said}"


def test_calls_that_read_or_change_the_slices_are_refused_inside_the_block():
    """The optimizer's clips, the scaler's unscale_, step, zero_grad, the reads, a nested
    block and a forward raise inside the block, saying so (the block's end would write
    its copies over what they did); the loop then goes on as torch DDP's."""
    for rank, res in enumerate(two_ranks()[(calls_inside_the_block,)]):
        for call, said in res["said"].items():
            assert said.startswith("fgpsdp: ") and \
                "inside `with opt.summon_full_grads():`" in said, (rank, call, said)
        assert not res["leftover"] and res["equal"], rank


@pytest.mark.parametrize("schedule", ("serial", "two_stage"))
@pytest.mark.parametrize("where", WHERE_MEASURED)
def test_ignored_gradients_edited_after_the_norm_was_measured(where, schedule):
    """clip_ignored_parameters: an expert's gradient changed after a read or in a block
    (both measure the norm) counts in the step's clip, as in torch DDP's."""
    for rank, largest in enumerate(
            two_ranks()[(ignored_gradients_edited_after_a_read, where, schedule)]):
        assert largest <= 1e-6, f"rank {rank}: {largest}"


@pytest.mark.parametrize("call", ("clip", "grad_norms"))
def test_an_expert_frozen_on_one_rank_measures_alike(call):
    """clip_ignored_parameters with one rank's expert frozen after wrapping: every rank
    measures the norm again alike (no rank waits in an all-reduce the others skip), and
    each step's norm is the same on both."""
    norms = two_ranks()[(an_expert_frozen_on_one_rank, call)]
    assert len(norms[0]) == 3 and norms[0] == norms[1]
