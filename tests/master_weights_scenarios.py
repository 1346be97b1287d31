"""16-bit parameters stepped through float32 master weights (``master_weights=True``)
beside torch DDP on the same 16-bit model with a float32 master copy of every
parameter, stepped by the same optimizer and rounded back after each step (the
mixed-precision loop of DeepSpeed's bf16 mode and Megatron's float16 optimizer).

On 2 ranks both sides add the same two 16-bit gradient halves once, so the
gradients, their float32 copies and every step after them are the same bit for
bit. Imported by the spawned ranks (module-level functions only).
"""
from __future__ import annotations

import copy
import io
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

import fgpsdp_runtime as fgp

from .scenarios import MLP, make_batch, reference_clip_
from .summoned_grad_scenarios import edit_grads


class MasteredReference:
    """torch DDP over a 16-bit model, its optimizer over float32 copies. With
    ``reduce_in_float32``, no DDP: each rank's 16-bit gradient, halved and cast to
    float32, is all-reduced in float32 into the master's gradient (Megatron's
    grad_reduce_in_fp32)."""

    def __init__(self, module: nn.Module, lr: float, clip: Optional[float],
                 init_scale: Optional[float] = None, reduce_in_float32: bool = False):
        self.reduce_in_float32 = reduce_in_float32
        self.ddp = module if reduce_in_float32 else nn.parallel.DistributedDataParallel(module)
        self.params = list(self.ddp.parameters())
        self.masters = [p.detach().float().clone() for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=lr)
        self.clip = clip
        self.scaler = None if init_scale is None else \
            torch.amp.GradScaler("cpu", init_scale=init_scale)

    def take_gradients(self) -> None:
        """With ``reduce_in_float32``, after each backward: its gradients, reduced in
        float32, added to the masters' (one reduction per micro-batch)."""
        for p, m in zip(self.params, self.masters):
            reduced = p.grad.float().mul_(1.0 / dist.get_world_size())
            dist.all_reduce(reduced)
            m.grad = reduced if m.grad is None else m.grad.add_(reduced)
            p.grad = None

    def step(self) -> None:
        if self.reduce_in_float32:
            self.take_gradients()
        else:
            for p, m in zip(self.params, self.masters):
                m.grad = None if p.grad is None else p.grad.float()
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        if self.scaler is None and not all(
                bool(torch.isfinite(m.grad).all()) for m in self.masters if m.grad is not None):
            self.opt.zero_grad()  # skipped, as fgpsdp skips a step of inf/NaN norm
            self.ddp.zero_grad()
            return
        if self.clip is not None:
            reference_clip_(self.masters, self.clip)
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)
        self.opt.zero_grad()
        self.ddp.zero_grad()

    def decay_masters(self) -> None:
        """The loop's weight decay on the optimizer's own tensors: the masters here."""
        with torch.no_grad():
            for m in self.masters:
                m.mul_(0.9)

    def clamp_params(self, bound: float) -> None:
        """A WGAN's weight clamp on the parameters: each master takes the clamped
        value where its parameter changed (fgpsdp's follow writes so)."""
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                clamped = p.clamp(-bound, bound)
                changed = clamped != p
                p.copy_(clamped)
                m[changed] = clamped[changed].float()

    def write(self, index: int, value: float) -> None:
        """The loop writes a parameter: the master follows (fgpsdp's master does)."""
        with torch.no_grad():
            self.params[index].fill_(value)
            self.masters[index].copy_(self.params[index])


def _largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.detach().double() - y.detach().double()).abs().max())
               for x, y in zip(a, b))


def _bits_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(x.dtype == y.dtype and torch.equal(x.detach().view(torch.uint8),
                                                  y.detach().view(torch.uint8))
               for x, y in zip(a, b))


def _loss(model: nn.Module, step: int, rank: int, dtype: torch.dtype,
          micro: int = 0) -> torch.Tensor:
    x, y = make_batch("mlp", step, micro, rank)
    return nn.functional.mse_loss(model(x.to(dtype)).float(), y)


def side_by_side(rank: int, world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    """case: ``dtype`` (bfloat16 / float16), ``schedule``, ``clip``, ``lr``, ``steps``;
    ``write_at``: a step before which the loop writes a parameter on both sides;
    ``init_scale``: float16 loss scaling from that scale (ShardedGradScaler beside
    torch's GradScaler); ``decay``: "before_step" or "after_step", the loop multiplies
    the optimizer's tensors (``opt.param_groups``' ones) by 0.9 in place, a hand-written
    weight decay, "after_step_data" through ``p.data``; ``clamp``: after every step the
    loop clamps the model's parameters to +-clamp through ``p.data``, a WGAN's weight
    clipping; ``inf_at``: a step whose loss is inf on rank 0, skipped on both sides, its
    speculative steps undone; ``reduce_dtype``: "float32", the reference all-reduces
    float32 copies of the gradients; ``micro``: micro-batches per step, each reduced
    (with reduce_dtype "float32": added up in float32 on both sides); ``local_size``:
    hierarchical; ``edit``: after backward both sides edit p.grad alike (fgpsdp's in
    ``opt.summon_full_grads()``). Returns the
    differences after every step and what the optimizer kept."""
    dtype = getattr(torch, case.get("dtype", "bfloat16"))
    schedule = case.get("schedule", "two_stage")
    lr = case.get("lr", 1e-2)
    torch.manual_seed(0)
    base = MLP().to(dtype)
    reference = MasteredReference(copy.deepcopy(base), lr, case.get("clip"),
                                  init_scale=case.get("init_scale"),
                                  reduce_in_float32=case.get("reduce_dtype") == "float32")
    kw = {"overlap_plan": "layout"} if schedule == "two_stage" else {}
    if "reduce_dtype" in case:
        kw["reduce_dtype"] = getattr(torch, case["reduce_dtype"])
    if "local_size" in case:
        kw["topology"] = fgp.Topology(local_size=case["local_size"])
    ours = fgp.DistributedDataParallel(base, schedule=schedule, bucket_cap_mb=0.0001, **kw)
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=lr, max_grad_norm=case.get("clip"),
                               master_weights=True)
    scaler = None if "init_scale" not in case else \
        fgp.ShardedGradScaler("cpu", init_scale=case["init_scale"])
    # (None: not compared; the reference's p.grad is not the reduced gradient there.)
    apart, full_grads_equal, norm_dtype = [], None, None
    for step in range(case.get("steps", 5)):
        if step == case.get("write_at"):
            with torch.no_grad():
                list(ours.module.parameters())[2].fill_(0.375)
            reference.write(2, 0.375)
        for micro in range(1, case.get("micro", 1)):  # all but the last
            _loss(ours, step, rank, dtype, micro).backward()
            _loss(reference.ddp, step, rank, dtype, micro).backward()
            reference.take_gradients()
        loss = _loss(ours, step, rank, dtype)
        ref_loss = _loss(reference.ddp, step, rank, dtype)
        if step == case.get("inf_at") and rank == 0:
            loss, ref_loss = loss * float("inf"), ref_loss * float("inf")
        if scaler is not None:
            scaler.scale(loss).backward()
            reference.scaler.scale(ref_loss).backward()
        else:
            loss.backward()
            ref_loss.backward()
        if step == 0 and scaler is None and not reference.reduce_in_float32 \
                and case.get("inf_at") != 0:
            # The reduced gradient, read whole: float32, as the masters step with.
            read = [opt.full_grad(p) for p in ours.module.parameters()]
            full_grads_equal = _bits_equal(read, [p.grad.float() for p in reference.params])
            # (inf: measures, clips nothing) In the gradients' dtype, as torch's clip.
            norm_dtype = str(opt.clip_grad_norm_(float("inf")).dtype)
        if case.get("edit"):  # each side's p.grad, alike (ours in summon_full_grads())
            with opt.summon_full_grads():
                edit_grads(ours.module, step)
            edit_grads(reference.ddp.module, step)
        if case.get("decay") == "before_step":
            _decay_pieces(opt)
            reference.decay_masters()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        reference.step()
        if case.get("decay") in ("after_step", "after_step_data"):
            _decay_pieces(opt, through_data=case["decay"] == "after_step_data")
            reference.decay_masters()
        if "clamp" in case:
            for p in ours.module.parameters():
                p.data.clamp_(-case["clamp"], case["clamp"])
            reference.clamp_params(case["clamp"])
        ours.synchronize()
        apart.append(_largest_difference(list(ours.module.parameters()), reference.params))
    masters = opt._slice_pieces.masters
    # opt.full_state(p) holds the master weights whole, as the checkpoint does.
    states = [opt.full_state(p).get("master_param") for p in ours.module.parameters()]
    return {
        "masters_read_equal": None if states[0] is None else
        _bits_equal(states, reference.masters),
        "apart": apart,
        "bitwise": _bits_equal(list(ours.module.parameters()), reference.params),
        "full_grads_equal": full_grads_equal,
        "norm_dtype": norm_dtype,
        "master_dtypes": sorted({str(m.dtype) for m in masters.values()}),
        "grad_dtypes": sorted({str(s.grad_shard.dtype) for s in ours.buckets}),
        "param_dtypes": sorted({str(p.dtype) for p in ours.module.parameters()}),
        "master_elements": sum(m.numel() for m in masters.values()),
        "slice_elements": sum(s.layout.shard_numel for s in ours.buckets),
        "bucket_elements": sum(s.layout.padded_numel for s in ours.buckets),
        "rollbacks": ours.scheduler.rollbacks if ours.scheduler is not None else None,
        "commits": ours.scheduler.commits if ours.scheduler is not None else None,
        "skipped": opt.skipped_steps,
        "scale": None if scaler is None else (scaler.get_scale(), reference.scaler.get_scale()),
    }


def _decay_pieces(opt: fgp.ShardedOptimizer, through_data: bool = False) -> None:
    with torch.no_grad():
        for group in opt.param_groups:
            for p in group["params"]:
                (p.data if through_data else p).mul_(0.9)


def side_by_side_many(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    return [side_by_side(rank, world_size, case) for case in cases]


def _build(master_weights: bool, lr: float = 1e-2):
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(MLP().to(torch.bfloat16), bucket_cap_mb=0.0001,
                                        overlap_plan="layout")
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=lr, master_weights=master_weights)
    return model, opt


def _train(model, opt, rank: int, steps: range) -> None:
    for step in steps:
        _loss(model, step, rank, torch.bfloat16).backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()


def small_updates(rank: int, world_size: int) -> dict[str, Any]:
    """An lr whose updates are below half a bfloat16 place of most weights: stepped in
    bfloat16 they vanish; through master weights they add up."""
    moved = {}
    for master_weights in (False, True):
        model, opt = _build(master_weights, lr=1e-4)
        before = [p.detach().clone() for p in model.module.parameters()]
        _train(model, opt, rank, range(20))
        changed = sum(int((p.detach() != b).sum()) for p, b in zip(model.module.parameters(),
                                                                    before))
        moved[master_weights] = changed / sum(b.numel() for b in before)
    return moved


def resumed(rank: int, world_size: int, how: str) -> dict[str, Any]:
    """3 steps, a checkpoint (``how``: "full", full_state_dict(); "shard", state_dict()),
    3 more; against a second pair loaded from the checkpoint after those 3 steps, a
    third loaded from it without its master weights (their extra bits lost), and the
    first pair itself loaded from it without them (then 3 steps again)."""
    model, opt = _build(True)
    _train(model, opt, rank, range(3))
    for p in model.module.parameters():  # written since the step: saved as written
        p.data.clamp_(-0.1, 0.1)
    saved_model = copy.deepcopy(model.module.state_dict())
    saved = opt.full_state_dict() if how == "full" else opt.state_dict()
    if how == "shard":
        saved = copy.deepcopy(saved)  # (its master weights are the live tensors)
        rounds_to_param = all(
            torch.equal(master.to(torch.bfloat16), model.buckets[b].param_shard)
            for b, master in saved["master_weights"].items())
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    _train(model, opt, rank, range(3, 6))
    finals = {"uninterrupted": [p.detach().clone() for p in model.module.parameters()]}
    out = {"keys": sorted(saved["state"][0]) if how == "full" else sorted(saved)}
    if how == "shard":
        out["master_rounds_to_param"] = rounds_to_param
    if how == "full":
        out["master_dtype"] = str(saved["state"][0]["master_param"].dtype)
        out["master_rounds_to_param"] = all(
            torch.equal(saved["state"][i]["master_param"].to(torch.bfloat16), p)
            for i, p in enumerate(saved_model.values()))
    for variant in ("with masters", "without masters", "without masters, same optimizer"):
        if variant.endswith("same optimizer"):  # 3 steps on from the checkpoint
            again, again_opt = model, opt
        else:
            again, again_opt = _build(True)
        again.module.load_state_dict(saved_model)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        if variant.startswith("without masters"):
            if how == "full":
                for entry in loaded["state"].values():
                    entry.pop("master_param")
            else:
                loaded.pop("master_weights")
        again_opt.load_state_dict(loaded)
        _train(again, again_opt, rank, range(3, 6))
        finals[variant] = [p.detach().clone() for p in again.module.parameters()]
    uninterrupted = finals.pop("uninterrupted")
    for variant, params in finals.items():
        out[variant] = _bits_equal(params, uninterrupted)
    # A running optimizer loaded without master weights goes on as a fresh one does.
    out["same optimizer as a fresh one"] = _bits_equal(
        finals["without masters, same optimizer"], finals["without masters"])
    return out


def resumed_both(rank: int, world_size: int) -> dict[str, dict]:
    return {how: resumed(rank, world_size, how) for how in ("full", "shard")}


def decayed_after_speculation(rank: int, world_size: int) -> str:
    """The optimizer's tensors written between backward and step under two_stage, after
    the speculative steps (the layout plan speculates from the first step): raises,
    as a write to the parameters there does, instead of landing a step late."""
    model, opt = _build(True)
    _loss(model, 0, rank, torch.bfloat16).backward()
    model.scheduler.finish_stage1()  # (else a write may come before the speculative step)
    if not model.scheduler.speculated:
        return "nothing speculated"
    _decay_pieces(opt)
    try:
        opt.step()
    except RuntimeError as error:
        return str(error)
    return "no error"
