"""Nothing the runtime holds grows over a run: 200 steps of each schedule with clipping
that triggers on some steps (two_stage's speculative steps commit and roll back),
no_sync() accumulation, eval forwards and state_dict() calls. Live tensors, their
storage bytes, threads, file descriptors and timeline spans (timeline off) are the same
at step 199 as at step 50 (after helper h81's leak hunt, which found none)."""
import gc
import os
import threading

import pytest
import torch
from torch import nn

from .dist_harness import run_distributed


def _held():
    gc.collect()
    tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    storages = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors}
    return {"tensors": len(tensors), "storage_bytes": sum(n for _, n in storages),
            "threads": threading.active_count(), "fds": len(os.listdir("/proc/self/fd"))}


def _train(rank, world_size, schedule, overlap_plan):
    import fgpsdp_runtime as fgp
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                           nn.Linear(128, 4))
    model = fgp.DistributedDataParallel(module, bucket_cap_mb=0.02, schedule=schedule,
                                        overlap_plan=overlap_plan)
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3, max_grad_norm=5.0)
    gen = torch.Generator().manual_seed(rank)
    held = []
    for step in range(200):
        x, y = torch.randn(8, 64, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        scale = 50.0 if step % 3 == 0 else 1.0  # these steps clip
        with model.no_sync():
            (nn.functional.cross_entropy(model(x), y) * scale).backward()
        (nn.functional.cross_entropy(model(x), y) * scale).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            model(x)
        if step % 20 == 0:
            model.state_dict()
            opt.state_dict()
        if step in (50, 199):
            model.synchronize()
            held.append(dict(_held(), spans=len(model.timeline.spans())))
    speculated = None if model.scheduler is None else (model.scheduler.commits,
                                                       model.scheduler.rollbacks)
    return held, speculated


@pytest.mark.parametrize("schedule,overlap_plan", [
    ("serial", "auto"), ("overlap_backward", "auto"), ("next_forward", "auto"),
    ("two_stage", "auto"), ("two_stage", "layout")])
def test_nothing_grows_over_steps(schedule, overlap_plan):
    for (early, late), speculated in run_distributed(2, _train, schedule, overlap_plan,
                                                     timeout_s=300):
        if overlap_plan == "layout":
            assert min(speculated) > 0, speculated  # commits and rollbacks both happened
        assert late["storage_bytes"] == early["storage_bytes"], (early, late)
        assert late["threads"] == early["threads"] and late["fds"] <= early["fds"], (early, late)
        assert late["spans"] == early["spans"] == 0, (early, late)
        assert abs(late["tensors"] - early["tensors"]) <= 8, (early, late)  # handles in flight
