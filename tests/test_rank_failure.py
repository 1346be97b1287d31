"""A rank that dies mid-step: the survivors fail fast, as under torch DDP, instead of
waiting out the process groups' timeout (gloo closes the dead rank's connections)."""
import json
import os
import time

import pytest
import torch

from .dist_harness import run_distributed

_PG_TIMEOUT_S = 60.0


class _DiesInBackward(torch.autograd.Function):
    """Identity whose backward ends this process (as SIGKILL would: no cleanup)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        os._exit(1)


def _one_rank_dies(rank, world, where, schedule, report_dir):
    import fgpsdp_runtime as fgp

    torch.manual_seed(0)
    layers = [torch.nn.Linear(32, 32) for _ in range(4)]
    model = fgp.DistributedDataParallel(torch.nn.Sequential(*layers), bucket_cap_mb=0.005,
                                        schedule=schedule)
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2, max_grad_norm=1.0)
    dies = rank == world - 1
    start = time.monotonic()
    try:
        for step in range(6):
            x = torch.randn(8, 32)
            if dies and step == 3 and where == "forward":
                os._exit(1)
            start = time.monotonic()
            out = model(x)
            if dies and step == 3 and where == "backward":
                out = _DiesInBackward.apply(out)
            out.square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        model.synchronize()
        outcome = {"raised": None}
    except Exception as error:  # noqa: BLE001 - the survivor's view is the result
        outcome = {"raised": type(error).__name__, "message": str(error)[:300]}
    outcome["seconds"] = time.monotonic() - start
    with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("schedule", ["two_stage", "next_forward"])
def test_survivors_fail_fast_when_a_rank_dies(tmp_path, where, schedule):
    with pytest.raises(RuntimeError, match="rank 2 died without a result"):
        run_distributed(3, _one_rank_dies, where, schedule, str(tmp_path),
                        pg_timeout_s=_PG_TIMEOUT_S, timeout_s=2 * _PG_TIMEOUT_S)
    for rank in (0, 1):
        outcome = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert outcome["raised"], (rank, outcome)
        # gloo's connection errors come within seconds; a hang would be the timeout.
        assert outcome["seconds"] < _PG_TIMEOUT_S / 3, (rank, outcome)
