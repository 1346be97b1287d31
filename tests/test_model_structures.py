"""Model structures the other suites do not build, beside torch DDP (see
structure_scenarios.py), on 2 and 3 ranks, under two_stage speculating with clipping
that rolls some steps back, and under next_forward."""
import pytest

from .dist_harness import run_distributed
from .structure_scenarios import STRUCTURES, every_structure, trained_apart


@pytest.mark.parametrize("world_size", [2, 3])
def test_structures_train_as_torch_ddp(world_size):
    per_rank = run_distributed(world_size, every_structure, timeout_s=600)
    problems, committed, rolled_back = [], 0, 0
    for rank, results in enumerate(per_rank):
        assert set(results) == {(n, s) for n in STRUCTURES for s in ("two_stage", "next_forward")}
        for key, result in results.items():
            if key[1] == "two_stage":
                commits, rollbacks = result["speculated"]
                committed, rolled_back = committed + commits, rolled_back + rollbacks
                if commits + rollbacks == 0:
                    problems.append((key, rank, "no speculative step"))
            for name, (relative, moved_ref, moved, same_strides) in result["params"].items():
                # Within float rounding of torch DDP, moved where DDP's moved (a frozen
                # or unused parameter stays), laid out as DDP's.
                if relative > 1e-5 or (moved_ref > 0) != (moved > 0) or not same_strides:
                    problems.append((key, rank, name, relative, moved_ref, moved))
    assert not problems, problems[:10]
    assert committed > 0 and rolled_back > 0, (committed, rolled_back)


@pytest.mark.parametrize("schedule", ["next_forward", "two_stage"])
def test_a_branch_reading_a_skipped_module_in_its_place_reads_the_updated_values(schedule):
    # Before: the forwards that read mid's weight without calling mid read it while
    # its all-gather was still landing (the old values), under both schedules.
    for rank, res in enumerate(run_distributed(2, trained_apart, schedule, timeout_s=300)):
        assert res["diff"] == 0.0 and res["steps_differing"] == [], (rank, res)
        assert res["deviations"] > 0, (rank, res)  # the branch was taken, and seen
