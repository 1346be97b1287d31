"""A DataLoader with worker processes feeding the loop: workers forked at every
epoch's start and for every evaluation, while the last step's all-gathers are still
running, train as under torch DDP and exit cleanly (2 ranks on one node: the
shared-memory exchange)."""
import pytest

from . import dataloader_scenarios
from .dist_harness import run_distributed

CASES = {
    # Workers forked anew at each epoch, under every schedule.
    "fresh": (False, ["serial", "overlap_backward", "next_forward", "two_stage"]),
    # Training workers kept across epochs (forked once, before the first step).
    "persistent": (True, ["next_forward", "two_stage"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_worker_processes_train_as_under_torch_ddp(case):
    persistent_workers, schedules = CASES[case]
    for rank, per_schedule in enumerate(run_distributed(
            2, dataloader_scenarios.train_from_worker_processes_by_schedule, schedules,
            persistent_workers, timeout_s=240)):
        for schedule, res in per_schedule.items():
            assert res["param_diff"] == 0.0, (rank, schedule, res)
            for ours, theirs in res["eval_losses"]:
                assert ours == theirs, (rank, schedule, res["eval_losses"])
        assert per_schedule["two_stage"]["speculated"] > 0, rank  # stage 1 ran
        # The schedules whose all-gathers land in the next forward forked workers
        # beside them (the evaluation loader's, at least, after every epoch).
        for schedule in ("next_forward", "two_stage"):
            assert per_schedule[schedule]["forks_beside_all_gathers"] >= 3, (
                rank, schedule, per_schedule[schedule]["forks_beside_all_gathers"])
