"""Parameters in buckets start 64-byte aligned, as torch allocates them: torch's CPU
kernels round differently on misaligned data, which broke bitwise parity with DDP."""
import copy

import pytest
import torch
import torch.nn as nn

from .dist_harness import run_distributed


def _train(rank: int, world_size: int, schedule: str) -> bool:
    import fgpsdp_runtime as fgp
    torch.manual_seed(0)
    # Bucket order is backward's: the 1-element bias first, so without alignment the
    # Linear(64, 1) weight starts 4 bytes in, and its gemv forward (batches of 5) rounds
    # differently from torch DDP's separately allocated weight.
    base = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ours = fgp.DistributedDataParallel(base, schedule=schedule)
    opt = fgp.ShardedOptimizer(ours, torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(5, 16, generator=g), torch.randn(5, 1, generator=g)
        for model, o in ((ours, opt), (ref, ref_opt)):
            ((model(x) - y) ** 2).mean().backward()
            o.step()
            o.zero_grad()
    ours.synchronize()
    return all(torch.equal(a, b) for a, b in zip(ours.module.parameters(),
                                                 ref.module.parameters()))


@pytest.mark.parametrize("schedule", ["two_stage", "serial"])
def test_misaligned_gemv_weight_trains_bitwise(schedule):
    assert run_distributed(2, _train, schedule) == [True, True]
