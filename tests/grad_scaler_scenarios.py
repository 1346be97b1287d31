"""Loss scaling: fgpsdp + ShardedGradScaler beside torch DDP + torch.amp.GradScaler.

Imported by the spawned ranks (module-level functions only).
"""
from __future__ import annotations

import copy
import math
import warnings

import torch
from torch import nn

import fgpsdp_runtime as fgp

from .scenarios import MLP, make_batch, reference_clip_


class ClassMixingWrapper:
    """PyTorch Lightning's LightningOptimizer (what ``self.optimizers()`` gives in manual
    optimization): its class mixes the optimizer's in, so the optimizer's methods run
    on it; it reads missing attributes from the optimizer and keeps what is written."""

    def __init__(self, optimizer):
        self._optimizer = optimizer
        self.__class__ = type("Wrapping" + type(optimizer).__name__,
                              (ClassMixingWrapper, type(optimizer)), {})

    def __getattr__(self, name):
        return getattr(self._optimizer, name)


def scaled_side_by_side(rank: int, world_size: int, case: dict) -> dict:
    """Train both on the same data with a loss scale that overflows at first.

    case keys: ``schedule``; ``precision`` "float32" or "autocast_float16"
    (CPU autocast, from a scale that overflows float16 in the first
    backwards); ``clip`` None, "optimizer" (``max_grad_norm``), "manual"
    (``scaler.unscale_`` then ``opt.clip_grad_norm_``, the AMP recipe) or "value"
    (``scaler.unscale_`` then ``opt.clip_grad_value_``) or "before_unscale" (the clip
    first, on gradients still scaled, as PyTorch Lightning's MixedPrecision plugin
    leaves it for this optimizer; torch DDP's clip too);
    ``rank0_overflows_at``: a step whose loss is inf on rank 0 only (the
    inf lands in some ranks' slices only); ``enabled``; ``loop_skips``: with
    clip "manual", the loop itself skips ``scaler.step`` when the norm is not
    finite (torch allows it: ``update()`` reads the flag ``unscale_`` noted);
    ``eval_forward``: a no_grad forward (logging) between the clip and the step;
    ``through_a_wrapper``: the loop's unscale_, clip and zero_grad go through a
    ClassMixingWrapper, and the step to the optimizer itself (as Lightning's manual
    optimization does).
    """
    schedule = case["schedule"]
    clip = case.get("clip")
    autocast = case.get("precision", "float32") == "autocast_float16"
    steps = case.get("steps", 8)
    torch.manual_seed(0)
    base = MLP()
    reference = copy.deepcopy(base)
    # overlap_plan="layout": two_stage speculates from the first step, before
    # the scaler is known, so the undo of those steps is exercised.
    kw = {"overlap_plan": "layout"} if schedule == "two_stage" else {}
    ours = fgp.DistributedDataParallel(base, schedule=schedule, bucket_cap_mb=0.0001, **kw)
    ref = nn.parallel.DistributedDataParallel(reference)
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2,
                               max_grad_norm=1.0 if clip == "optimizer" else None)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    front = ClassMixingWrapper(opt) if case.get("through_a_wrapper") else opt
    scaler_kw = {"init_scale": 2.0 ** (20 if autocast else 16), "growth_interval": 2,
                 "enabled": case.get("enabled", True)}
    scaler = fgp.ShardedGradScaler("cpu", **scaler_kw)
    ref_scaler = torch.amp.GradScaler("cpu", **scaler_kw)
    scales, ref_scales, norms, ref_norms, step_warnings = [], [], [], [], []
    hook_calls = {"ours": 0, "ref": 0}  # step hooks (an EMA, say) run on taken steps only
    opt.register_step_post_hook(lambda *_: hook_calls.__setitem__("ours", hook_calls["ours"] + 1))
    ref_opt.register_step_post_hook(lambda *_: hook_calls.__setitem__("ref", hook_calls["ref"] + 1))
    for step in range(steps):
        x, y = make_batch("mlp", step, 0, rank)
        overflow = math.inf if step == case.get("rank0_overflows_at") and rank == 0 else 1.0
        for model, sc in ((ours, scaler), (ref, ref_scaler)):
            with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
                out = model(x)
            sc.scale(nn.functional.mse_loss(out.float(), y) * overflow).backward()
        if clip == "before_unscale":  # (the warning said at the step's unscale_)
            norms.append(float(opt.clip_grad_norm_(1.0)))
            ref_norms.append(reference_clip_(ref.parameters(), 1.0))
        if clip == "manual":
            scaler.unscale_(front)
            norms.append(float(front.clip_grad_norm_(1.0)))
        if clip == "value":  # clamps an overflow's inf: the step must still be skipped
            scaler.unscale_(opt)
            opt.clip_grad_value_(0.5)
        ref_scaler.unscale_(ref_opt)
        if clip == "value":
            torch.nn.utils.clip_grad_value_(ref.parameters(), 0.5)
        elif clip not in (None, "before_unscale"):
            ref_norms.append(reference_clip_(ref.parameters(), 1.0))
        if case.get("eval_forward"):  # the step then measures the gradients again
            with torch.no_grad():
                for model in (ours, ref):
                    model(x)
        skip = case.get("loop_skips") and not math.isfinite(ref_norms[-1])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if not skip:
                scaler.step(opt)
        step_warnings += [str(w.message) for w in caught]
        if not skip:
            ref_scaler.step(ref_opt)
        scaler.update()
        ref_scaler.update()
        scales.append(scaler.get_scale())
        ref_scales.append(ref_scaler.get_scale())
        front.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    ours.synchronize()
    diff = max(float((a.detach() - b.detach()).abs().max())
               for a, b in zip(ours.module.parameters(), ref.module.parameters()))
    first = scaler_kw["init_scale"] if scaler_kw["enabled"] else 1.0
    ref_skipped = sum(1 for before, after in zip([first] + ref_scales, ref_scales)
                      if after < before)  # a skipped step backs the scale off
    return {"diff_to_ddp": diff, "scales": scales, "ref_scales": ref_scales,
            "skipped": opt.skipped_steps, "ref_skipped": ref_skipped,
            "norms": norms, "ref_norms": ref_norms,
            "step_warnings": step_warnings, "hook_calls": hook_calls,
            "rollbacks": ours.scheduler.rollbacks if ours.scheduler else 0,
            "commits": ours.scheduler.commits if ours.scheduler else 0,
            "speculation_stopped": ours.scheduler.stopped_because if ours.scheduler else None,
            "scaler_state": scaler.state_dict(), "ref_scaler_state": ref_scaler.state_dict(),
            "written_on_the_wrapper": sorted(vars(front)) if front is not opt else None}


def scaled_many(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Several cases in one set of processes (spawning costs seconds)."""
    return [scaled_side_by_side(rank, world_size, case) for case in cases]


class _TwoDtypes(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2).double()

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).double())


def calls_as_torchs(rank: int, world_size: int) -> dict:
    """Three calls beside torch's: clip_grad_norm_'s total on a float32 + float64
    model (torch's dtype: the gradients' dtypes promoted), clip_grad_value_ with
    ``foreach=``, and the scaler's step when no parameter has a gradient (torch's
    AssertionError)."""
    out = {}
    torch.manual_seed(0)
    base = _TwoDtypes()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ours = fgp.DistributedDataParallel(base, bucket_cap_mb=0.0001)
    opt = fgp.ShardedOptimizer(ours, torch.optim.SGD, lr=0.1)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
    for model in (ours, ref):
        model(x).sum().backward()
    total = opt.clip_grad_norm_(1e9)
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    out["norm"] = (total.dtype, ref_total.dtype, abs(float(total) - float(ref_total)))
    try:
        opt.clip_grad_value_(1e9, foreach=True)
        out["clip_value_foreach"] = "ok"
    except TypeError as error:
        out["clip_value_foreach"] = f"TypeError: {error}"
    opt.step()
    opt.zero_grad()
    said = []
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_opt.zero_grad()
    for optimizer, scaler in ((opt, fgp.ShardedGradScaler("cpu")),
                              (ref_opt, torch.amp.GradScaler("cpu"))):
        scaler.scale(torch.ones(()))  # no backward: no gradient in this step
        try:
            scaler.step(optimizer)
            said.append("stepped")
        except AssertionError as error:
            said.append(f"AssertionError: {error}")
    out["scaler_without_gradients"] = said
    return out
