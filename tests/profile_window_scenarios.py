"""Rank functions for tests/test_plan_profiler.py: loops that do unusual things while
``overlap_plan="auto"`` profiles (steps 2-3), and gradient accumulation without
no_sync() under two_stage."""
import contextlib
import time

import torch
from torch import nn

import fgpsdp_runtime as fgp
from fgpsdp_runtime import comm


class SlowBackward(torch.autograd.Function):
    """Identity whose backward first calls ``pause`` (a host sleep; on CUDA a GPU
    sleep, which the host does not wait for): buckets are ready at distinct times."""

    @staticmethod
    def forward(ctx, x, pause):
        ctx.pause = pause
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.pause()
        return grad, None


def _host_pause() -> None:
    time.sleep(0.003)


class SlowNet(nn.Module):
    """``pause`` in backward before each layer; ``forward_pause`` (if given) in
    forward before each layer: a forward the all-gathers outpace."""

    def __init__(self, layers: int = 4, width: int = 64, pause=_host_pause, forward_pause=None):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.pause = pause
        self.forward_pause = forward_pause

    def forward(self, x):
        for layer in self.layers:
            if self.forward_pause is not None:
                self.forward_pause()
            x = SlowBackward.apply(torch.tanh(layer(x)), self.pause)
        return x.square().mean()


def _batch(step: int, micro: int, rank: int) -> torch.Tensor:
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(1000 * step + 10 * micro + rank))


def _long_pause() -> None:
    # Longer than an all-gather of a 17 KB bucket here (a few ms; 20 ms when slowed)
    time.sleep(0.04)


@contextlib.contextmanager
def slow_all_gathers(seconds: float):
    """Every all-gather first sleeps on its link worker: a link the forward outpaces."""
    original = comm._Exchange._collective

    def collective(phase, *args):
        run = original(phase, *args)
        if phase != "all_gather":
            return run

        def slowly():
            time.sleep(seconds)
            return run()
        return slowly
    comm._Exchange._collective = staticmethod(collective)
    try:
        yield
    finally:
        comm._Exchange._collective = staticmethod(original)


def _train(rank: int, case: str, schedule: str, overlap_plan: str, steps: int,
           max_grad_norm=None) -> dict:
    slow = case in ("slow_all_gathers", "slow_forward_on_rank_0")
    with slow_all_gathers(0.02) if slow else contextlib.nullcontext():
        return _train_as_is(rank, case, schedule, overlap_plan, steps, max_grad_norm)


def _train_as_is(rank: int, case: str, schedule: str, overlap_plan: str, steps: int,
                 max_grad_norm=None) -> dict:
    torch.manual_seed(0)
    # One Linear(64, 64) per bucket: 4 buckets. The cases about stage 1's size
    # take a long backward, so that every exchange but the last fits in it.
    long_backward = case in ("slow_forward", "no_undo_memory", "slow_all_gathers",
                             "slow_forward_on_rank_0")
    # slow_forward_on_rank_0: rank 0's forward outpaces the slowed all-gathers, rank 1's
    # waits for each.
    slow_forward = case == "slow_forward" or (case == "slow_forward_on_rank_0" and rank == 0)
    net = SlowNet(pause=_long_pause if long_backward else _host_pause,
                  forward_pause=_long_pause if slow_forward else None)
    model = fgp.DistributedDataParallel(net, bucket_cap_mb=0.015, schedule=schedule,
                                        overlap_plan=overlap_plan,
                                        speculation_memory_mb=0.0 if case == "no_undo_memory"
                                        else None)
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2, max_grad_norm=max_grad_norm)
    for step in range(1, steps + 1):
        if case == "user_timeline" and step == 2:
            model.timeline.enable()  # inside the profile's window
        # A plan of the caller's, before the window (step 1) or inside it (step 3):
        # kept, the profile ends there (it used to replace the plan after step 3).
        if (case, step) in (("hand_plan_before_window", 1), ("hand_plan_in_window", 3)) \
                and schedule == "two_stage":
            model.set_overlap_plan(fgp.OverlapPlan(stage1=(0, 1, 2), stage2=(3,), lookahead=4,
                                                   source="by hand"))
        all_no_sync = ((case == "no_sync_step" and step == 3)
                       or (case == "no_sync_window" and step in (2, 3))
                       or case == "always_no_sync")
        accumulate_synced = case == "accumulate_synced" and step <= 4
        if all_no_sync:  # reduced at the step
            for micro in range(2):
                with model.no_sync():
                    model(_batch(step, micro, rank)).backward()
        elif accumulate_synced:  # every micro-batch reduced in its backward
            for micro in range(2):
                model(_batch(step, micro, rank)).backward()
        else:
            model(_batch(step, 0, rank)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.synchronize()
    out = {"params": [p.detach().clone() for p in model.module.parameters()],
           "n_buckets": len(model.bucket_layouts)}
    if model.scheduler is not None:
        out.update(plan=model.plan.to_json(), commits=model.scheduler.commits,
                   rollbacks=model.scheduler.rollbacks,
                   timeline_enabled=model.timeline.enabled,
                   timeline_spans=len(model.timeline.spans()),
                   local_forward_wait_s=dict(model.plan_profiler.local_forward_wait_s)
                   if model.plan_profiler is not None else {})
    return out


def profile_window(rank: int, world_size: int, case: str, overlap_plan: str = "auto",
                   steps: int = 6) -> dict:
    """The case under two_stage, and the same loop under serial (bitwise the same
    parameters, the project's promise)."""
    ours = _train(rank, case, "two_stage", overlap_plan, steps)
    serial = _train(rank, case, "serial", overlap_plan, steps)
    ours["equal_to_serial"] = all(torch.equal(a, b)
                                  for a, b in zip(ours.pop("params"), serial["params"]))
    return ours


def speculation_budget_elsewhere(rank: int, world_size: int) -> list[str]:
    """speculation_memory_mb where no auto plan is derived: said, not silently dropped."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fgp.DistributedDataParallel(SlowNet(), schedule="next_forward", speculation_memory_mb=64)
        fgp.DistributedDataParallel(SlowNet(), overlap_plan="layout", speculation_memory_mb=64)
        fgp.DistributedDataParallel(SlowNet(), speculation_memory_mb=64)  # auto: bounds it
    return [str(w.message) for w in caught if "speculation_memory_mb" in str(w.message)]


class _LateLayerNet(nn.Module):
    """``late`` joins the forward at step 4: the optimizer has no state for it before."""

    def __init__(self):
        super().__init__()
        self.a, self.late, self.b = (nn.Linear(64, 64) for _ in range(3))
        self.use_late = False

    def forward(self, x):
        x = torch.tanh(self.a(x))
        if self.use_late:
            x = torch.tanh(self.late(x))
        return self.b(x).square().mean()


def undo_bytes_before_state_exists(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    net = _LateLayerNet()
    model = fgp.DistributedDataParallel(net, bucket_cap_mb=0.015, find_unused_parameters=True)
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    sizes = {}
    for step in range(1, 7):
        net.use_late = step > 3
        model(_batch(step, 0, rank)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step in (3, 6):
            sizes[step] = opt.undo_record_bytes()
    late = {b for b, layout in enumerate(model.bucket_layouts)
            for span in layout.spans if model._param_names[span.param_index].startswith("late")}
    return {"step3": sizes[3], "step6": sizes[6], "late_buckets": sorted(late)}


def joined_before_the_window(rank: int, world_size: int) -> dict:
    """Rank 0 runs out of data after step 1 (under ``model.join()``); rank 1 trains 6
    steps, with a forward slower than the (slowed) all-gathers: it waits for none
    but the first in forward order. Rank 0's shadowed forwards compute nothing and
    wait for every all-gather in full: those waits must not shape the plan."""
    torch.manual_seed(0)
    with slow_all_gathers(0.02):
        net = SlowNet(pause=_long_pause, forward_pause=_long_pause)
        model = fgp.DistributedDataParallel(net, bucket_cap_mb=0.015)
        opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
        with model.join():
            for step in range(1, (1 if rank == 0 else 6) + 1):
                model(_batch(step, 0, rank)).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        model.synchronize()
    return {"plan": model.plan.to_json(),
            "local_forward_wait_s": dict(model.plan_profiler.local_forward_wait_s)}
