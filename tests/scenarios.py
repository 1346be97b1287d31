"""Small models and a training loop run side by side with torch DDP.

Imported by the spawned ranks, so everything here must be importable at
module level (no fixtures, no closures).
"""
from __future__ import annotations

import copy
import math
import os
import threading
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

import fgpsdp_runtime as fgp
from fgpsdp_runtime.plan import OverlapPlan

from .profile_window_scenarios import SlowBackward, slow_all_gathers


class MLP(nn.Module):
    # Odd sizes so that parameters straddle slices at odd offsets.
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(13, 37), nn.GELU(), nn.Linear(37, 29), nn.Tanh(),
                                 nn.Linear(29, 5))

    def forward(self, x):
        return self.net(x)


class TiedLM(nn.Module):
    def __init__(self, vocab=41, dim=24):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor, two modules

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(11, 19)
        self.frozen.requires_grad_(False)
        # No bias before BatchNorm: its gradient is zero up to rounding, and
        # Adam turns rounding noise into full-size steps of either sign.
        self.body = nn.Linear(19, 23, bias=False)
        self.bn = nn.BatchNorm1d(23)
        self.out = nn.Linear(23, 5)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.body(torch.relu(self.frozen(x))))))


class BranchyNet(nn.Module):
    """`never` is never used; `rank0_only` only on rank 0 (data-dependent control flow)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(13, 17)
        self.rank0_only = nn.Linear(17, 17)
        self.never = nn.Linear(17, 3)
        self.out = nn.Linear(17, 5)

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        if dist.get_rank() == 0:
            h = h + self.rank0_only(h)
        return self.out(h)


class AttentionNet(nn.Module):
    """nn.MultiheadAttention reads out_proj.weight without calling out_proj."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(13, 16)
        # No in-projection bias: the key bias has a zero gradient up to rounding
        # (softmax ignores a shift), which Adam would amplify into noise.
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True, bias=False)
        self.out = nn.Linear(16, 5)

    def forward(self, x):
        h = self.inp(x).view(2, 4, 16)
        h, _ = self.attn(h, h, h, need_weights=False)
        return self.out(h.reshape(8, 16))


class OrderChangeNet(nn.Module):
    """The module order changes every step (stale weights hide here: Megatron-LM #950)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(13, 13)
        self.b = nn.Linear(13, 13)
        self.out = nn.Linear(13, 5)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        first, second = (self.a, self.b) if self.calls % 2 else (self.b, self.a)
        return self.out(torch.tanh(second(torch.tanh(first(x)))))


class CheckpointedNet(nn.Module):
    """Activation checkpointing: the middle blocks' forwards run again inside backward."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(13, 19)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(19, 19), nn.Tanh())
                                    for _ in range(3))
        self.out = nn.Linear(19, 5)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
        return self.out(h)


class ReentrantCheckpointedNet(CheckpointedNet):
    """Reentrant checkpointing with the head inside the last segment: the first
    gradients of a backward arrive in a checkpoint's nested backward, whose end
    is not the backward's."""

    def _last_segment(self, h):
        return self.out(self.blocks[-1](h))

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks[:-1]:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True)
        return torch.utils.checkpoint.checkpoint(self._last_segment, h, use_reentrant=True)


class PreHookNet(nn.Module):
    """Forward pre-hooks registered before wrapping read their module's parameters
    (as torch.nn.utils.weight_norm's and pruning's do; weight_norm itself cannot be
    deep-copied for the reference model)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(13, 19)
        self.out = nn.Linear(19, 5)
        for layer in (self.inp, self.out):
            layer.register_forward_pre_hook(
                lambda module, args: (args[0] * module.weight.detach().abs().mean(),))

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)))


class ParentReadsNet(nn.Module):
    """The parent reads a submodule's weight before calling that submodule."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(13, 19)
        self.out = nn.Linear(19, 5)

    def forward(self, x):
        scale = self.out.weight.norm()  # before self.out runs (and waits for its bucket)
        return self.out(torch.tanh(self.inp(x))) / scale


class ChannelsLastNet(nn.Module):
    """Convolutions in channels_last (a depthwise one, whose weight has a size-1 dim,
    and a 1x1 one) and a column-major head weight: layouts the wrapper must keep, as
    torch DDP does."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.depthwise = nn.Conv2d(6, 6, 3, padding=1, groups=6)
        self.pointwise = nn.Conv2d(6, 7, 1)
        self.head = nn.Linear(7, 5)
        with torch.no_grad():
            self.head.weight = nn.Parameter(self.head.weight.t().contiguous().t())
        self.to(memory_format=torch.channels_last)

    def forward(self, x):
        h = torch.relu(self.depthwise(torch.relu(self.conv(x))))
        h = torch.relu(self.pointwise(h))
        return self.head(h.mean(dim=(2, 3)))


MODELS = {"mlp": MLP, "tied": TiedLM, "bn_frozen": BatchNormNet, "unused": BranchyNet,
          "attention": AttentionNet, "order_change": OrderChangeNet,
          "checkpointed": CheckpointedNet, "checkpointed_reentrant": ReentrantCheckpointedNet,
          "pre_hooks": PreHookNet,
          "parent_reads": ParentReadsNet, "channels_last": ChannelsLastNet}


def make_batch(model_name: str, step: int, micro: int, rank: int):
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    if model_name == "tied":
        tokens = torch.randint(0, 41, (6, 7), generator=g)
        target = torch.randint(0, 41, (6, 7), generator=g)
        return tokens, target
    if model_name == "channels_last":
        x = torch.randn(4, 3, 6, 5, generator=g).to(memory_format=torch.channels_last)
        return x, torch.randn(4, 5, generator=g)
    in_dim = 11 if model_name == "bn_frozen" else 13
    x = torch.randn(8, in_dim, generator=g)
    y = torch.randn(8, 5, generator=g)
    return x, y


def loss_fn(model_name: str, out, target):
    if model_name == "tied":
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    return nn.functional.mse_loss(out, target)


def make_groups(params_named, optimizer: str):
    if optimizer in ("adamw_groups", "step_counters", "step_counters_with_gradients"):
        decay = [p for n, p in params_named if p.ndim >= 2]
        no_decay = [p for n, p in params_named if p.ndim < 2]
        return [{"params": decay, "weight_decay": 0.1},
                {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3}]
    return [{"params": [p for _, p in params_named]}]


class StepCountingSGD(torch.optim.Optimizer):
    """Element-wise, with step counters outside its parameters' state: schedule-free
    optimizers count in ``group["k"]``, apex's capturable FusedAdam in a tensor
    ``group["step"]`` written in place (here "t"), MADGRAD in ``state["k"]`` (here
    "steps"). Every group counts every step, as those do (a rank whose slices hold
    none of a group's elements steps it too). The update depends on all three."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, {"lr": lr, "k": 0})
        for group in self.param_groups:
            group["t"] = torch.zeros(())

    @torch.no_grad()
    def step(self, closure=None):
        if "steps" not in self.state:
            self.state["steps"] = torch.zeros((), dtype=torch.long)
        meta = self.state.setdefault("meta", {"n": 0})  # a count in a dict, changed in place
        meta["n"] += 1
        boost = 1.0 + 0.5 * float(self.state["steps"]) + 0.25 * meta["n"]
        for group in self.param_groups:
            group["k"] += 1
            group["t"] += 1  # in place
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * boost / (group["k"] + float(group["t"])))
        self.state["steps"] += 1  # in place, as MADGRAD's


class AttributeCountingSGD(torch.optim.Optimizer):
    """Element-wise, counting its steps in plain numbers on the optimizer object, as
    custom optimizers do: ``self.n_steps`` set at construction warms the learning
    rate up, ``self.calls`` created at the first step scales it. And a flag there: the
    first step fills every parameter's velocity and sets ``self.ready`` (a later run
    of the same step that found it unset would zero what an earlier one stepped)."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, {"lr": lr})
        self.n_steps = 0

    @torch.no_grad()
    def step(self, closure=None):
        if not getattr(self, "ready", False):
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["velocity"] = torch.zeros_like(p)
            self.ready = True
        self.n_steps += 1
        self.calls = getattr(self, "calls", 0) + 1
        scale = min(1.0, self.n_steps / 4) * (1.0 + 0.1 * self.calls)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    velocity = self.state[p]["velocity"]
                    velocity.mul_(0.5).add_(p.grad)
                    p.add_(velocity, alpha=-group["lr"] * scale)


class TrainEvalSGD(torch.optim.Optimizer):
    """Schedule-free's modes, element-wise: it trains at a point between the iterate
    and its average z, and evaluates at the average, so ``train()`` and ``eval()``
    move the parameters; a step outside train mode raises, as schedule-free's does."""
    BETA = 0.9

    def __init__(self, params, lr=0.05):
        super().__init__(params, {"lr": lr, "train_mode": False})

    @torch.no_grad()
    def train(self):
        self._move(True, 1 - self.BETA)

    @torch.no_grad()
    def eval(self):
        self._move(False, 1 - 1 / self.BETA)

    def _move(self, to_train: bool, weight: float) -> None:
        for group in self.param_groups:
            if group["train_mode"] != to_train:
                for p in group["params"]:
                    if "z" in self.state[p]:
                        p.lerp_(self.state[p]["z"], weight)
                group["train_mode"] = to_train

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group["train_mode"]:
                raise RuntimeError("not in train mode: call optimizer.train() first")
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "z" not in state:
                    state["z"] = p.clone()
                state["z"].add_(p.grad, alpha=-group["lr"])
                p.add_(p.grad, alpha=-group["lr"] * self.BETA)


def train_eval_modes(rank: int, world_size: int, schedule: str, steps: int = 4) -> dict:
    """opt.train() / opt.eval() (schedule-free's) every other step, an evaluation
    in between, beside torch DDP + the same optimizer. Before, ShardedOptimizer had
    neither (AttributeError), and the inner optimizer's moved this rank's slices only."""
    torch.manual_seed(1234 + rank)
    base = MLP()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ours = fgp.DistributedDataParallel(base, bucket_cap_mb=0.0001, schedule=schedule,
                                       overlap_plan="layout" if schedule == "two_stage" else "auto")
    opt = fgp.ShardedOptimizer(ours, TrainEvalSGD, lr=0.05)
    ref_opt = TrainEvalSGD(ref.parameters(), lr=0.05)
    eval_diffs = []
    for step in range(steps):
        for optimizer in (opt, ref_opt):
            optimizer.train()
        x, y = make_batch("mlp", step, 0, rank)
        for model, optimizer in ((ours, opt), (ref, ref_opt)):
            loss_fn("mlp", model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        if step % 2 == 1:
            for optimizer in (opt, ref_opt):
                optimizer.eval()
            with torch.no_grad():
                eval_diffs.append(float((ours(x) - ref(x)).abs().max()))
    ours.synchronize()
    return {"param_diff": max(float((a.detach() - b.detach()).abs().max()) for a, b in
                              zip(ours.module.parameters(), ref.module.parameters())),
            "eval_diffs": eval_diffs}


def _adamw_beside_torch_ddp(base: nn.Module, schedule: str):
    """(ours, its ShardedOptimizer, torch DDP on a copy, its AdamW): small buckets, and
    under two_stage the layout plan, so that stage 1 speculates from the first step."""
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ours = fgp.DistributedDataParallel(base, bucket_cap_mb=0.0001, schedule=schedule,
                                       overlap_plan="layout" if schedule == "two_stage" else "auto")
    return (ours, fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2),
            ref, torch.optim.AdamW(ref.parameters(), lr=1e-2))


def validation_under_inference_mode_first(rank: int, world_size: int, schedule: str,
                                          steps: int = 3) -> dict:
    """A validation forward under torch.inference_mode() before the first training step
    (PyTorch Lightning's sanity check), on a model with buffers, then training, beside
    torch DDP. Before, the first buffer broadcast probed torch's API with a tensor made
    under inference mode and raised "Inference tensors do not track version counter"
    on every rank (the probe's answer is cached per process: run in a fresh one)."""
    torch.manual_seed(1234)
    base = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    ours, opt, ref, ref_opt = _adamw_beside_torch_ddp(base, schedule)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(4, 8, generator=g)
    validation = []
    for model in (ours, ref):
        model.eval()
        with torch.inference_mode():
            validation.append(model(x))
        model.train()
    for step in range(steps):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
        for model, optimizer in ((ours, opt), (ref, ref_opt)):
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    ours.synchronize()
    return {"validation_diff": float((validation[0] - validation[1]).abs().max()),
            "param_diff": param_diff(ours, ref),
            "buffer_diff": max(float((a - b).abs().max()) for a, b in
                               zip(ours.module.buffers(), ref.module.buffers()))}


def functional_calls_through_the_wrapper(rank: int, world_size: int, schedule: str,
                                         steps: int = 3) -> dict:
    """torch.func.functional_call through the wrapper, beside torch DDP: an evaluation
    with other weights (an EMA's, plain tensors) as the very first forward and at the
    end, and training with a plain forward plus one with a weight replaced by a
    function of itself (read through named_parameters(), which lands its all-gather),
    the all-gathers slowed (a forward that reads before they land reads old values).
    Before, every rank raised "parameter ... was replaced by another tensor"
    (functional_call writes its substitutes into _parameters); then (review) a first
    forward that was a functional_call recorded no wait for the substituted
    parameters, and the plain forwards read them before they landed."""
    from torch.func import functional_call
    torch.manual_seed(1234)
    base = nn.Sequential(nn.Linear(13, 37), nn.Tanh(), nn.Linear(37, 5))
    ours, opt, ref, ref_opt = _adamw_beside_torch_ddp(base, schedule)
    g = torch.Generator().manual_seed(rank)
    eval_diffs = []

    def evaluate(x):
        outputs = []
        for model in (ours, ref):
            with torch.no_grad():
                halved = {n: p.detach() * 0.5 for n, p in model.named_parameters()}
                outputs.append(functional_call(model, halved, (x,)))
        eval_diffs.append(float((outputs[0] - outputs[1]).abs().max()))

    with slow_all_gathers(0.05):
        evaluate(torch.randn(8, 13, generator=g))  # the first forward
        for step in range(steps):
            x, y = torch.randn(8, 13, generator=g), torch.randn(8, 5, generator=g)
            for model, optimizer in ((ours, opt), (ref, ref_opt)):
                out = model(x)  # first in the step: its waits are the recorded ones
                weight = dict(model.named_parameters())["module.2.weight"]
                scaled = functional_call(model, {"module.2.weight": weight * 1.5}, (x,))
                (nn.functional.mse_loss(out, y) + nn.functional.mse_loss(scaled, y)).backward()
                optimizer.step()
                optimizer.zero_grad()
        evaluate(x)  # (named_parameters() lands every all-gather: not between the steps)
        ours.synchronize()
    return {"param_diff": param_diff(ours, ref), "eval_diffs": eval_diffs,
            "commits": ours.scheduler.commits if ours.scheduler is not None else None}


def functional_call_substitutes_viewing_parameters(rank: int, world_size: int,
                                                   schedule: str, steps: int = 3) -> dict:
    """An auxiliary loss through functional_call with substitutes that view the
    parameters' memory (``p.data``: a stop-gradient on the last layer), built before
    the main forward, so its slow backward reads them after the main branch's has
    made the last layer's bucket ready. Before (review), two_stage's speculative step
    of that bucket overwrote them first (0.038 off torch DDP): the speculative steps
    must wait for the end of backward, as for a detached read in a recorded forward."""
    from torch.func import functional_call
    torch.manual_seed(1234)
    base = nn.Sequential(nn.Linear(13, 37), nn.Tanh(), nn.Linear(37, 5))
    ours, opt, ref, ref_opt = _adamw_beside_torch_ddp(base, schedule)
    g = torch.Generator().manual_seed(rank)
    x0 = torch.randn(8, 13, generator=g)
    for model in (ours, ref):
        with torch.no_grad():
            model(x0)  # the recording forward: a plain one
    for step in range(steps):
        x, y = torch.randn(8, 13, generator=g), torch.randn(8, 5, generator=g)
        for model, optimizer in ((ours, opt), (ref, ref_opt)):
            params = dict(model.named_parameters())
            substitutes = {n: params[n].data for n in ("module.2.weight", "module.2.bias")}
            aux = SlowBackward.apply(functional_call(model, substitutes, (x,)),
                                      lambda: time.sleep(0.05))
            out = model(x)
            (nn.functional.mse_loss(aux, -y) + nn.functional.mse_loss(out, y)).backward()
            optimizer.step()
            optimizer.zero_grad()
    ours.synchronize()
    return {"param_diff": param_diff(ours, ref),
            "commits": ours.scheduler.commits if ours.scheduler is not None else None}


def train_both(pairs, rank: int, steps: int, model_name: str = "mlp", start: int = 0) -> None:
    """``steps`` plain steps of each (model, optimizer) pair on the same batches, those
    of steps ``start`` to ``start + steps - 1``."""
    for step in range(start, start + steps):
        x, y = make_batch(model_name, step, 0, rank)
        for model, optimizer in pairs:
            loss_fn(model_name, model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()


def param_diff(ours, ref) -> float:
    """Largest parameter difference between two wrapped models' modules."""
    return max(float((a.detach() - b.detach()).abs().max())
               for a, b in zip(ours.module.parameters(), ref.module.parameters()))


class _GroupSpec:
    """A plain object a param group carries (no ``==`` of its own)."""


def groups_holding_objects(rank: int, world_size: int, schedule: str, steps: int = 3) -> dict:
    """Param groups that carry a submodule and a plain object, as some trainers tag
    their groups. torch keeps them as they are; before, every inner run deep-copied
    them (the group then held a copy), and a module's copy under two_stage raised
    the "copy of the module between backward and step" error."""
    torch.manual_seed(1234 + rank)
    base = MLP()
    ref_module = copy.deepcopy(base)
    ref = nn.parallel.DistributedDataParallel(ref_module)
    ours = fgp.DistributedDataParallel(base, bucket_cap_mb=0.0001, schedule=schedule,
                                       overlap_plan="layout" if schedule == "two_stage" else "auto")

    def groups(module):
        layers = [m for m in module.modules() if isinstance(m, nn.Linear)]
        return [{"params": list(layer.parameters()), "module": layer, "spec": _GroupSpec()}
                for layer in layers]

    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, param_groups=groups(base), lr=1e-2)
    ref_opt = torch.optim.AdamW(groups(ref_module), lr=1e-2)
    held = [(g["module"], g["spec"]) for g in opt.param_groups]
    train_both([(ours, opt), (ref, ref_opt)], rank, steps)
    ours.synchronize()
    return {"param_diff": param_diff(ours, ref),
            "same_objects": all(g["module"] is m and g["spec"] is s
                                for g, (m, s) in zip(opt.param_groups, held)),
            "commits": ours.scheduler.commits if ours.scheduler else None}


class GroupsWithGradientsCountingSGD(StepCountingSGD):
    """Counts a step in a group only when the step reaches one of its gradients: a
    chunk of buckets without the group's elements does not count it, another does."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if any(p.grad is not None for p in group["params"]):
                group["k"] += 1
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-group["lr"] / group["k"])


def wrapped_for(module: nn.Module, torch_ddp: bool, optimizer_class, lr: float,
                torch_kwargs: Optional[dict] = None, **ours_kwargs):
    """(model, optimizer): ``module`` under torch DDP (``torch_kwargs``) with
    ``optimizer_class`` over it, or under fgpsdp (``ours_kwargs``) with a
    ShardedOptimizer of that class: the two sides a test trains apart."""
    if torch_ddp:
        model = nn.parallel.DistributedDataParallel(module, **(torch_kwargs or {}))
        return model, optimizer_class(model.parameters(), lr=lr)
    model = fgp.DistributedDataParallel(module, **ours_kwargs)
    return model, fgp.ShardedOptimizer(model, optimizer_class, lr=lr)


def optimizer_class_and_defaults(optimizer: str):
    if optimizer == "step_counters":
        return StepCountingSGD, {"lr": 0.05}
    if optimizer == "attribute_counters":
        return AttributeCountingSGD, {"lr": 0.05}
    if optimizer == "step_counters_with_gradients":
        return GroupsWithGradientsCountingSGD, {"lr": 0.05}
    if optimizer == "adamw_groups":
        return torch.optim.AdamW, {"lr": 1e-2, "betas": (0.9, 0.95)}
    if optimizer == "adamw_tensor_betas":  # as torch allows for capturable / compiled steps
        return torch.optim.AdamW, {"lr": 1e-2, "betas": (torch.tensor(0.9), torch.tensor(0.95))}
    if optimizer == "sgd_momentum":
        return torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}
    if optimizer == "sgd_nesterov_foreach":  # its step writes the gradient in place
        return torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "foreach": True}
    if optimizer in OTHER_TORCH_OPTIMIZERS:
        return OTHER_TORCH_OPTIMIZERS[optimizer]
    raise ValueError(optimizer)


# The rest of torch.optim's elementwise optimizers, each with state of its own kind
# (a speculative step must back it up and restore it exactly).
OTHER_TORCH_OPTIMIZERS = {
    "adam_amsgrad": (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.05}),  # state made at construction
    "adamax": (torch.optim.Adamax, {"lr": 1e-2}),
    "nadam": (torch.optim.NAdam, {"lr": 1e-2}),  # mu_product: a scalar state tensor
    "radam": (torch.optim.RAdam, {"lr": 1e-2}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.5, "centered": True}),
    "rprop": (torch.optim.Rprop, {"lr": 1e-2}),  # per-element step sizes, sign of last grad
    "asgd": (torch.optim.ASGD, {"lr": 1e-2, "t0": 2}),  # eta, mu, averaged params
    "adadelta": (torch.optim.Adadelta, {"lr": 1.0}),
}


def reference_clip_(params, max_norm: float) -> float:
    """torch's clipping rule with the total accumulated in float64."""
    grads = [p.grad for p in params if p.grad is not None]
    total = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    coefficient = max_norm / (total + 1e-6)
    if coefficient < 1.0:
        for g in grads:
            g.mul_(coefficient)
    return total


def train_side_by_side(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Train fgpsdp and torch DDP on the same data; return their differences."""
    model_name = cfg.get("model", "mlp")
    optimizer = cfg.get("optimizer", "adamw_groups")
    steps = cfg.get("steps", 5)
    micro = cfg.get("accumulate", 1)
    max_norm = cfg.get("max_grad_norm")
    schedule_kw = {}
    if "local_size" in cfg:
        schedule_kw["topology"] = fgp.Topology(local_size=cfg["local_size"])
    elif cfg.get("flat"):
        schedule_kw["topology"] = "flat"
    if "schedule" in cfg:
        schedule_kw["schedule"] = cfg["schedule"]
    if "overlap_plan" in cfg:
        schedule_kw["overlap_plan"] = cfg["overlap_plan"]

    # Every rank initialises differently: the broadcast at construction must fix it.
    torch.manual_seed(1234 + rank)
    base = MODELS[model_name]()
    ref_module = copy.deepcopy(base)
    find_unused = model_name == "unused"
    ref = nn.parallel.DistributedDataParallel(ref_module, find_unused_parameters=find_unused)
    # fgpsdp needs no flag to survive unused parameters; "unused_no_flag" checks that.
    ours_find_unused = cfg.get("find_unused_parameters", find_unused)
    ours = fgp.DistributedDataParallel(base, bucket_cap_mb=cfg.get("bucket_cap_mb"),
                                       find_unused_parameters=ours_find_unused, **schedule_kw)

    if cfg.get("fixed_plan"):  # ("stage1" | "stage2", lookahead): every bucket in one stage
        stage, lookahead = cfg["fixed_plan"]
        order = ours.forward_bucket_order
        ours.set_overlap_plan(OverlapPlan(stage1=tuple(sorted(order)) if stage == "stage1" else (),
                                          stage2=order if stage == "stage2" else (),
                                          lookahead=lookahead, source="test"))

    cls, defaults = optimizer_class_and_defaults(optimizer)
    ref_named = [(n, p) for n, p in ref.module.named_parameters() if p.requires_grad]
    ours_named = [(n, p) for n, p in ours.module.named_parameters() if p.requires_grad]
    ref_opt = cls(make_groups(ref_named, optimizer),
                  **optimizer_class_and_defaults(optimizer)[1])  # tensors of its own
    opt = fgp.ShardedOptimizer(ours, cls, param_groups=make_groups(ours_named, optimizer),
                               max_grad_norm=max_norm, **defaults)
    sched = ref_sched = None
    if cfg.get("lr_scheduler"):
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)

    base_hyper = {id(o): [(g["lr"], g.get("weight_decay", 0.0)) for g in o.param_groups]
                  for o in (opt, ref_opt)}
    norms, ref_norms, losses = [], [], []
    for step in range(steps):
        for m in range(micro):
            x, y = make_batch(model_name, step, m, rank)
            last = m == micro - 1
            # "accumulate_synced": every micro-batch reduces (no no_sync()), as DDP allows.
            synced = last or cfg.get("accumulate_synced", False)
            # no_sync() around the forward and the backward, or (``no_sync_around``)
            # one of them: torch DDP decides at forward whether backward reduces.
            around = cfg.get("no_sync_around", ("forward", "backward"))

            def ctx(model, phase):
                return model.no_sync() if not synced and phase in around else _null()
            if cfg.get("no_sync_via_flag"):  # as some trainers do instead of no_sync()
                ours.require_backward_grad_sync = ref.require_backward_grad_sync = synced
                around = ()
            with ctx(ours, "forward"):
                loss = loss_fn(model_name, ours(x), y) / micro
            with ctx(ours, "backward"):
                loss.backward()
            with ctx(ref, "forward"):
                ref_loss = loss_fn(model_name, ref(x), y) / micro
            with ctx(ref, "backward"):
                ref_loss.backward()
        losses.append((float(loss.detach()), float(ref_loss.detach())))
        def set_hyperparameters():
            # A warm-up written between backward and step, after two_stage's
            # speculative steps ran with the previous values.
            for o in (opt, ref_opt):
                for g, (lr, decay) in zip(o.param_groups, base_hyper[id(o)]):
                    g["lr"], g["weight_decay"] = lr * (step + 1) / steps, decay * (step % 2)

        if cfg.get("hyperparameters_after_backward") == "before_clip":
            set_hyperparameters()
        if step == cfg.get("param_groups_replaced_after_backward_at"):
            # ... with another lr, while two_stage's speculative steps may still run
            # on the inner optimizer's copies of the old groups.
            for o in (opt, ref_opt):
                o.param_groups = [dict(g, lr=g["lr"] / 2) for g in o.param_groups]
        if cfg.get("zero_before_step"):
            # Zeroed between backward and step: the step sees zero gradients
            # (AdamW still decays and moves by its moments), or none, as under DDP.
            to_none = cfg["zero_before_step"] == "none"
            opt.zero_grad(set_to_none=to_none)
            ref_opt.zero_grad(set_to_none=to_none)
        if cfg.get("clip_value"):
            opt.clip_grad_value_(cfg["clip_value"])
            torch.nn.utils.clip_grad_value_(ref.parameters(), cfg["clip_value"])
        if cfg.get("manual_clip"):
            norms.append(float(opt.clip_grad_norm_(cfg["manual_clip"])))
            ref_norms.append(reference_clip_(ref.parameters(), cfg["manual_clip"]))
        if max_norm is not None:  # ours: in opt.step(), after any clip_grad_norm_
            ref_norms.append(reference_clip_(ref.parameters(), max_norm))
        if cfg.get("hyperparameters_after_backward") == "after_clip":
            set_hyperparameters()  # after clip_grad_norm_'s all-reduce
        if cfg.get("hyperparameters_after_backward") == "betas_in_place_after_clip":
            # A momentum schedule filling the tensor in Adam's betas tuple.
            for o in (opt, ref_opt):
                for g in o.param_groups:
                    g["betas"][0].fill_(0.9 - 0.1 * (step % 2))
        opt.step()
        ref_opt.step()
        if cfg.get("zero_grad_via") == "model":  # as DDP loops (and HF's Trainer) do
            ours.zero_grad(set_to_none=cfg.get("set_to_none", True))
            ref.zero_grad(set_to_none=cfg.get("set_to_none", True))
        else:
            opt.zero_grad(set_to_none=True)
            ref_opt.zero_grad(set_to_none=True)
        if step == cfg.get("reload_optimizer_at"):  # resuming: a checkpoint round trip
            opt.load_state_dict(opt.state_dict())
            ref_opt.load_state_dict(ref_opt.state_dict())
        if step == cfg.get("param_groups_replaced_at"):
            # New dicts for the groups (a loop rebuilding them): the steps and the
            # schedule must use these from now on, as torch's optimizer does.
            for o in (opt, ref_opt):
                o.param_groups = [dict(g) for g in o.param_groups]
        if step == cfg.get("param_group_item_replaced_at"):
            # One group's dict replaced in the list, over the same tensors with another
            # lr (opt.param_groups[0] = {...}): later steps must use it.
            for o in (opt, ref_opt):
                o.param_groups[0] = dict(o.param_groups[0], lr=o.param_groups[0]["lr"] / 2)
        if sched is not None:
            sched.step()
            ref_sched.step()
    ours.synchronize()
    ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
    state_dict_diff = max(float((ours_sd[k].double() - ref_sd[k].double()).abs().max())
                          for k in ref_sd) if list(ours_sd) == list(ref_sd) else float("inf")

    param_diff = max(float((a.detach() - b.detach()).abs().max())
                     for a, b in zip(ours.module.parameters(), ref.module.parameters()))
    buffer_diff = max([float((a.double() - b.double()).abs().max())
                       for a, b in zip(ours.module.buffers(), ref.module.buffers())] or [0.0])
    per_piece = [s for k, s in opt.state.items() if isinstance(k, torch.Tensor)]
    state_numel = sum(t.numel() for s in per_piece for t in s.values()
                      if isinstance(t, torch.Tensor) and t.ndim > 0)
    per_param_state = {k for s in per_piece for k, t in s.items()
                       if isinstance(t, torch.Tensor) and t.ndim > 0}
    return {
        "param_diff": param_diff,
        # Each parameter's memory layout as under torch DDP (channels_last kept).
        "strides_differ": [n for (n, a), b in zip(ours.module.named_parameters(),
                                                  ref.module.parameters())
                           if a.stride() != b.stride()],
        "buffer_diff": buffer_diff,
        "state_dict_diff": state_dict_diff,
        "local_numel": opt.local_numel,
        "state_numel": state_numel,
        "state_kinds": len(per_param_state),
        "norms": norms,
        "ref_norms": ref_norms,
        "losses": losses,
        "n_buckets": len(ours.bucket_layouts),
        "lrs": [g["lr"] for g in opt.param_groups],
        "inner_lrs": [g["lr"] for g in opt.optim.param_groups],  # what the steps used
        "ref_lrs": [g["lr"] for g in ref_opt.param_groups],
        "trainable": sum(p.numel() for _, p in ours_named),
        "comm_stats": ours.comm_stats(),
        "bucket_bytes": [l.padded_numel * l.element_size for l in ours.bucket_layouts],
        "slice_index": ours.slice_index,
        "params": [p.detach().clone() for p in ours.module.parameters()]
        if cfg.get("return_params") else None,
        "forward_deviations": ours._forward_waiter.deviations if ours._forward_waiter else 0,
        "reduce_scatters": ours.reducer.reduce_scatters_launched,
        "commits": ours.scheduler.commits if ours.scheduler else 0,
        "rollbacks": ours.scheduler.rollbacks if ours.scheduler else 0,
        "speculation_stopped": ours.scheduler.stopped_because if ours.scheduler else None,
        "plan": ours.plan.to_json() if ours.plan is not None else None,
    }


def train_many(rank: int, world_size: int, cfgs: dict[str, dict]) -> dict[str, dict]:
    """Several scenarios in one set of processes (spawning costs seconds)."""
    return {name: train_side_by_side(rank, world_size, cfg) for name, cfg in cfgs.items()}


def train_with_inf_gradient(rank: int, world_size: int, schedule: str) -> dict:
    """One step's loss is inf on rank 0: every rank must skip that step, under any schedule."""
    torch.manual_seed(1)
    # "layout": two_stage speculates from the first step (auto waits for its profile).
    model = fgp.DistributedDataParallel(MLP(), bucket_cap_mb=0.0001, schedule=schedule,
                                        overlap_plan="layout")
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2, max_grad_norm=1.0)
    skipped_per_step = []
    for step in range(4):
        x, y = make_batch("mlp", step, 0, rank)
        loss = loss_fn("mlp", model(x), y)
        if step == 2 and rank == 0:
            loss = loss * float("inf")
        loss.backward()
        opt.step()
        skipped_per_step.append(opt.last_step_skipped)
        opt.zero_grad()
    model.synchronize()
    return {"params": [p.detach().clone() for p in model.module.parameters()],
            "skipped": opt.skipped_steps, "skipped_per_step": skipped_per_step,
            "rollbacks": model.scheduler.rollbacks if model.scheduler else 0}


def norms_after_clip_grad_value(rank: int, world_size: int, schedule: str) -> dict:
    """clip_grad_value_ then clip_grad_norm_, beside torch DDP, where step 0's gradient
    holds an inf and a NaN (rank 0): the value clip clamps the inf and leaves the NaN,
    so torch's norm is NaN. Returns both norms per step, and the parameters."""
    torch.manual_seed(0)
    ours, opt, ref, ref_opt = _adamw_beside_torch_ddp(MLP(), schedule)
    norms = []
    for step in range(3):
        x, y = make_batch("mlp", step, 0, rank)
        for model in (ours, ref):
            loss = loss_fn("mlp", model(x), y)
            if step == 0 and rank == 0:
                w = model.module.net[0].weight.view(-1)
                # d/dw0 = inf; d/dw1 = inf - inf = NaN.
                loss = loss + w[0] * math.inf + (w[1] * math.inf - w[1] * math.inf)
            loss.backward()
        opt.clip_grad_value_(0.5)
        torch.nn.utils.clip_grad_value_(ref.parameters(), 0.5)
        norms.append((float(opt.clip_grad_norm_(1.0)),
                      reference_clip_(ref.parameters(), 1.0)))
        opt.step()  # skips a non-finite step itself
        if math.isfinite(norms[-1][1]):
            ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    ours.synchronize()
    return {"norms": norms, "params": [p.detach().clone() for p in ours.module.parameters()],
            "ref_params": [p.detach().clone() for p in ref.module.parameters()]}


def comm_stats_around_a_reset(rank: int, world_size: int) -> dict:
    """comm_stats() after one step, right after reset_comm_stats(), and after one more."""
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(MLP(), bucket_cap_mb=0.0001, schedule="serial")
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    seen = {}
    for step in range(2):
        x, y = make_batch("mlp", step, 0, rank)
        loss_fn("mlp", model(x), y).backward()
        opt.step()
        opt.zero_grad()
        seen[f"after step {step}"] = model.comm_stats()
        if step == 0:
            model.reset_comm_stats()
            seen["after the reset"] = model.comm_stats()
    return seen


def skip_on_inf_norm(rank: int, world_size: int, schedule: str, all_no_sync: bool) -> dict:
    """A loop that skips opt.step() when clip_grad_norm_ says inf (step 0: rank 0's
    loss is inf), accumulating two micro-batches per step: the first under
    no_sync(), the second synced or (``all_no_sync``) also under no_sync(), which
    fgpsdp reduces at the step. Returns the norms and the parameters."""
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(MLP(), bucket_cap_mb=0.0001, schedule=schedule)
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    norms = []
    for step in range(4):
        for m in range(2):
            x, y = make_batch("mlp", step, m, rank)
            synced = m == 1 and not all_no_sync
            with model.no_sync() if not synced else _null():
                loss = loss_fn("mlp", model(x), y) / 2
                (loss * math.inf if step == 0 and rank == 0 else loss).backward()
        norms.append(float(opt.clip_grad_norm_(1.0)))
        if math.isfinite(norms[-1]):
            opt.step()
        opt.zero_grad()
    model.synchronize()
    return {"norms": norms, "params": [p.detach().clone() for p in model.module.parameters()]}


def loop_warnings(rank: int, world_size: int, optimizer: str = "sharded",
                  zero_through: str = "optimizer") -> dict[str, int]:
    """The fgpsdp warnings of a 3-step loop: which optimizer steps, where it zeroes."""
    import warnings
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(MLP(), bucket_cap_mb=0.0001)
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2) if optimizer == "sharded" \
        else torch.optim.AdamW(model.parameters(), lr=1e-2)
    def param_grads_to_none():
        for p in model.module.parameters():
            p.grad = None
    zero = {"optimizer": opt.zero_grad, "wrapper": model.zero_grad,
            "inner module": model.module.zero_grad,
            "submodule": model.module.net.zero_grad,
            "param.grad = None": param_grads_to_none,
            "before backward": opt.zero_grad, "after a second step": opt.zero_grad}[zero_through]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            x, y = make_batch("mlp", step, 0, rank)
            if zero_through == "before backward":
                # As DCGAN's D: zeroed before its backward; after its step it gets
                # gradients again (from G's backward), which are never stepped.
                zero()
                loss_fn("mlp", model(x), y).backward()
                opt.step()
                loss_fn("mlp", model(x), y).backward()
                continue
            loss_fn("mlp", model(x), y).backward()
            opt.step()
            if zero_through == "after a second step":
                opt.step()  # the same gradients again, as torch's optimizer would
            zero()
    model.synchronize()
    messages = [str(w.message) for w in caught]
    accumulating = [w for w in caught
                    if "used gradients added to those of the previous step" in str(w.message)]
    return {"accumulating": len(accumulating),
            # Said at the loop's opt.step() line.
            "accumulating_at": sorted({os.path.basename(w.filename) for w in accumulating}),
            "no_optimizer": sum("no fgpsdp_runtime.ShardedOptimizer wraps" in m
                                for m in messages)}


class TwoModelsSharingABlock(nn.Module):
    """Two models sharing their first layer (an embedding, a backbone), held by one
    module whose forward runs either: what a parameter shared by two wrappers needs."""

    def __init__(self):
        super().__init__()
        shared = nn.Linear(13, 16)
        self.a = nn.Sequential(shared, nn.Tanh(), nn.Linear(16, 5))
        self.b = nn.Sequential(shared, nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x, which: str):
        return (self.a if which == "a" else self.b)(x)


def two_models_sharing_a_block(rank: int, world_size: int, system: str) -> list[torch.Tensor]:
    """Each model stepped in turn (its own loss, one optimizer over both); ``system``
    "torch" (torch DDP, find_unused_parameters=True) or an fgpsdp schedule."""
    torch.manual_seed(0)
    module = TwoModelsSharingABlock()
    model, opt = wrapped_for(module, system == "torch", torch.optim.AdamW, 0.05,
                             torch_kwargs={"find_unused_parameters": True}, schedule=system)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        for which in ("a", "b"):
            model(torch.randn(6, 13, generator=g), which).square().mean().backward()
            opt.step()
            opt.zero_grad()
    if system != "torch":
        model.synchronize()
    return [p.detach().clone() for p in module.parameters()]


def skip_backward_on_rank1(rank: int, world_size: int) -> list[float]:
    """Rank 1 skips backward entirely on some steps; nobody may hang."""
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(MLP(), bucket_cap_mb=0.0001)
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2, max_grad_norm=1.0)
    for step in range(4):
        x, y = make_batch("mlp", step, 0, rank)
        loss = loss_fn("mlp", model(x), y)
        if not (rank == 1 and step % 2 == 0):
            loss.backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()
    return [float(p.detach().double().sum()) for p in model.module.parameters()]


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FailingInThreadAdamW(torch.optim.AdamW):
    """AdamW whose step fails off the main thread (the two-stage scheduler's)."""

    def step(self, closure=None):
        import threading
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("injected failure in a speculative step")
        return super().step(closure)


def scheduler_thread_failure(rank: int, world_size: int) -> dict:
    """A failing speculative step must surface on the main thread, at the step;
    the loop catches it, zeroes the gradients and trains on (no speculation),
    beside torch DDP skipping that step: the next norm is the new gradient's."""
    torch.manual_seed(0)
    module = MLP()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(module))
    model = fgp.DistributedDataParallel(module, bucket_cap_mb=0.0001, overlap_plan="layout")
    opt = fgp.ShardedOptimizer(model, FailingInThreadAdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x, y = make_batch("mlp", 0, 0, rank)
    loss_fn("mlp", model(x), y).backward()
    result = {"error": None, "notes": []}
    try:
        opt.step()
    except ValueError as error:  # the optimizer's own exception, as from torch's step
        result = {"error": repr(error), "notes": getattr(error, "__notes__", [])}
    opt.zero_grad()
    norms, ref_norms = [], []
    for step in (1, 2):
        x, y = make_batch("mlp", step, 0, rank)
        loss_fn("mlp", model(x), y).backward()
        loss_fn("mlp", ref(x), y).backward()
        norms.append(float(opt.clip_grad_norm_(1.0)))
        ref_norms.append(reference_clip_(ref.parameters(), 1.0))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    model.synchronize()
    result.update(norms=norms, ref_norms=ref_norms, param_diff=max(
        float((a - b).abs().max()) for a, b in zip(module.parameters(), ref.parameters())))
    return result


class FailingOnOneRankAdamW(torch.optim.AdamW):
    """AdamW whose speculative steps (off the main thread) raise on rank 1 only, from
    the ``fail_at``-th one of step ``fail_step`` (0-based), as an out-of-memory error
    in an undo record would on one rank."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loop_steps = 0  # set by the loop
        self.fail_step, self.fail_at = 1, 1
        self._speculative_in_step = {}

    def step(self, closure=None):
        import threading
        if threading.current_thread() is not threading.main_thread():
            n = self._speculative_in_step.get(self.loop_steps, 0)
            self._speculative_in_step[self.loop_steps] = n + 1
            if (dist.get_rank() == 1 and self.loop_steps == self.fail_step
                    and n >= self.fail_at):
                raise ValueError("injected failure on rank 1")
        return super().step(closure)


def speculative_failure_on_one_rank(rank: int, world_size: int, mode: str) -> dict:
    """A speculative step raising on one rank only, part-way through stage 1, must
    not leave the ranks' collectives apart. ``mode``:

    - "step": every rank raises the failing rank's exception (a ValueError) at that
      step; the loop catches that type, zeroes and trains on, bitwise torch DDP
      skipping the step;
    - "forward_before_step": a second forward and backward between the failure and
      the step (the speculation is cancelled; the error still waits for the step).
      Such a loop speculates in its first step only: the failure is there;
    - "zero_grad_without_step": the loop drops that round with zero_grad() and no
      step: nothing raises (the failing rank warns), and the next rounds speculate
      on every rank alike, bitwise torch DDP dropping the batch too.
    """
    import warnings as _warnings
    torch.manual_seed(0)
    module = MLP()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(module))
    model = fgp.DistributedDataParallel(module, bucket_cap_mb=0.0001, overlap_plan="layout")
    opt = fgp.ShardedOptimizer(model, FailingOnOneRankAdamW, lr=1e-2)
    accumulate = mode == "forward_before_step"
    opt.optim.fail_step = 0 if accumulate else 1
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    errors, commits_at_failure = [], None
    with _warnings.catch_warnings(record=True) as seen:
        _warnings.simplefilter("always")
        for step in range(4):
            opt.optim.loop_steps = step
            for micro in range(2 if accumulate else 1):
                x, y = make_batch("mlp", step, micro, rank)
                loss_fn("mlp", model(x), y).backward()
                loss_fn("mlp", ref(x), y).backward()
            if mode == "zero_grad_without_step" and step == opt.optim.fail_step:
                opt.zero_grad()  # (a loop skipping a batch it found bad)
                ref_opt.zero_grad()
                commits_at_failure = model.scheduler.commits
                continue
            try:
                opt.step()
            except ValueError as error:  # the optimizer's own type, on every rank
                errors.append((step, str(error), getattr(error, "__notes__", [])))
                opt.zero_grad()
                ref_opt.zero_grad()
                continue
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
    model.synchronize()
    return {"errors": errors, "stage1": len(model.plan.stage1),
            "commits_after_failure": (model.scheduler.commits - commits_at_failure
                                      if commits_at_failure is not None else None),
            "dropped_warnings": [str(w.message) for w in seen if "dropped its round"
                                 in str(w.message)],
            "param_diff": max(float((a - b).abs().max())
                              for a, b in zip(module.parameters(), ref.parameters()))}


STEP_LOG: list = []


class LoggingSGD(torch.optim.SGD):
    """SGD that logs how many slice tensors had a gradient at each step."""

    def step(self, closure=None):
        STEP_LOG.append(("step", sum(p.grad is not None for g in self.param_groups
                                     for p in g["params"])))
        return super().step(closure)


def step_and_gather_order(rank: int, world_size: int, schedule: str) -> dict:
    """The order of inner optimizer steps and all-gather launches in one step."""
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(MLP(), bucket_cap_mb=0.0001, schedule=schedule,
                                        overlap_plan="layout" if schedule == "two_stage"
                                        else "auto")
    opt = fgp.ShardedOptimizer(model, LoggingSGD, lr=1e-2, max_grad_norm=1e-3)  # clips
    queue = model.queue_param_all_gather

    def logged_queue(bucket):
        STEP_LOG.append(("gather", bucket))
        queue(bucket)

    model.queue_param_all_gather = logged_queue
    for step in range(2):  # the first step speculates and rolls back; the second does not
        x, y = make_batch("mlp", step, 0, rank)
        STEP_LOG.clear()
        loss_fn("mlp", model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.synchronize()
    return {"log": list(STEP_LOG), "forward_order": list(model.forward_bucket_order)}


def traced_steps(rank: int, world_size: int, cfg: dict) -> dict:
    """Train a few steps with the timeline on for the last one; return the trace."""
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(MLP(), bucket_cap_mb=0.0001,
                                        topology=fgp.Topology(local_size=cfg["local_size"]),
                                        schedule=cfg["schedule"], overlap_plan="layout")
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    spans_before = None
    for step in range(cfg["steps"]):
        if step == cfg["steps"] - 1:
            spans_before = len(model.timeline.spans())
            model.timeline.enable()
        x, y = make_batch("mlp", step, 0, rank)
        loss_fn("mlp", model(x), y).backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()
    return {"trace": model.timeline.chrome_trace(), "spans_before": spans_before,
            "n_buckets": len(model.bucket_layouts),
            "plan": model.plan.to_json() if model.plan is not None else None}


def synchronize_between_backward_and_step(rank: int, world_size: int, schedule: str) -> dict:
    """synchronize() after backward shows the parameters before the step; training goes on exactly."""
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(MLP(), bucket_cap_mb=0.0001, schedule=schedule,
                                        overlap_plan="layout")
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    unchanged = []
    for step in range(4):
        x, y = make_batch("mlp", step, 0, rank)
        out = model(x)  # the forward has waited for every parameter of this MLP
        before_backward = [p.detach().clone() for p in model.module.parameters()]
        loss_fn("mlp", out, y).backward()
        if step == 2:
            model.synchronize()  # two_stage: undoes the stage-1 steps of this backward
            unchanged.append(all(torch.equal(a, p) for a, p in
                                 zip(before_backward, model.module.parameters())))
        opt.step()
        opt.zero_grad()
        if step == 1:
            model.synchronize()
    model.synchronize()
    return {"params": [p.detach().clone() for p in model.module.parameters()],
            "unchanged": unchanged,
            "rollbacks": model.scheduler.rollbacks if model.scheduler else 0}


def _gan_iteration(step: int, rank: int, G, D, opt_g, opt_d, gradient_penalty: bool) -> None:
    """DCGAN's loop: D is zeroed before its backward; G's backward then runs
    through D, whose gradients it adds to are never stepped (zeroed next time).
    ``gradient_penalty``: WGAN-GP's term in D's loss, the norm of D's input
    gradient at points between real and fake (torch.autograd.grad, create_graph:
    a backward through D that reaches no parameter, then one that reaches them
    twice, through the penalty's graph)."""
    criterion = nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(100 * step + rank)
    real, z = torch.randn(8, 12, generator=g), torch.randn(8, 4, generator=g)
    opt_d.zero_grad()
    fake = G(z)
    loss_d = (criterion(D(real), torch.ones(8, 1))
              + criterion(D(fake.detach()), torch.zeros(8, 1)))
    if gradient_penalty:
        mix = torch.rand(8, 1, generator=g)
        between = (mix * real + (1 - mix) * fake.detach()).requires_grad_(True)
        grad, = torch.autograd.grad(D(between).sum(), between, create_graph=True)
        loss_d = loss_d + 10 * ((grad.norm(2, dim=1) - 1) ** 2).mean()
    loss_d.backward()
    opt_d.step()
    opt_g.zero_grad()
    criterion(D(fake), torch.ones(8, 1)).backward()
    opt_g.step()


def gan_loop(rank: int, world_size: int, schedule: str, gradient_penalty: bool = False) -> dict:
    """A DCGAN loop, G and D wrapped apart, beside torch DDP doing the same; D's
    module saved on rank 0 after every iteration (between G's backward through D
    and D's next zero_grad()), and D's wrapper dropped at the end there."""
    import gc
    torch.manual_seed(0)
    g_module = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 12))
    d_module = nn.Sequential(nn.Linear(12, 16), nn.LeakyReLU(0.2), nn.Linear(16, 8),
                             nn.LeakyReLU(0.2), nn.Linear(8, 1))
    ref_g, ref_d = (nn.parallel.DistributedDataParallel(copy.deepcopy(m))
                    for m in (g_module, d_module))
    plan = {"overlap_plan": "layout"} if schedule == "two_stage" else {}
    G = fgp.DistributedDataParallel(g_module, bucket_cap_mb=0.0001, schedule=schedule, **plan)
    D = fgp.DistributedDataParallel(d_module, bucket_cap_mb=0.0001, schedule=schedule, **plan)
    opt_g, opt_d = (fgp.ShardedOptimizer(m, torch.optim.Adam, lr=1e-2) for m in (G, D))
    ref_opt_g, ref_opt_d = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ref_g, ref_d))
    saves = []
    for step in range(4):
        _gan_iteration(step, rank, G, D, opt_g, opt_d, gradient_penalty)
        _gan_iteration(step, rank, ref_g, ref_d, ref_opt_g, ref_opt_d, gradient_penalty)
        if rank == 0:  # torch DDP's idiom: one rank saves
            try:
                d_module.state_dict()
                saves.append("ok")
            except RuntimeError as error:
                saves.append(str(error))
        dist.barrier()
    scheduler = D.scheduler
    result = {"saves": saves,
              "d_commits": scheduler.commits if scheduler else 0,
              "d_stage1": len(D.plan.stage1) if scheduler else 0,
              "d_rollbacks": scheduler.rollbacks if scheduler else 0}
    time.sleep(0.2)  # the rest of a loop: stage 1 would have run by now
    del D, opt_d, scheduler
    gc.collect()
    G.synchronize()
    result["params"] = [p.detach().clone() for m in (g_module, d_module) for p in m.parameters()]
    result["reference"] = [p.detach().clone() for m in (ref_g, ref_d)
                           for p in m.module.parameters()]
    return result


def default_bucket_sizes(rank: int, world_size: int) -> dict:
    """Bucket bytes of the wrapper at its default cap, for 64 layers of 0.5 MB."""
    torch.manual_seed(0)
    module = nn.ModuleList(nn.Linear(256, 512, bias=False) for _ in range(64))
    model = fgp.DistributedDataParallel(module)
    result = {"cap_mb": model.bucket_cap_mb,
              "bucket_bytes": [l.numel * l.element_size for l in model.bucket_layouts]}
    del model  # frees the module for another wrapper
    explicit = fgp.DistributedDataParallel(module, bucket_cap_mb=2.0)
    result["explicit_bucket_bytes"] = [l.numel * l.element_size for l in explicit.bucket_layouts]
    return result


class SlowOnRank1AdamW(torch.optim.AdamW):
    """AdamW whose steps take a while on rank 1 only: rank 0's all-gathers of a
    step are still in flight when its own ``step()`` has returned."""

    def step(self, closure=None):
        if dist.get_rank() == 1:
            time.sleep(0.2)
        return super().step(closure)


def save_checkpoint_with_gathers_in_flight(rank: int, world_size: int, schedule: str,
                                           via: str) -> dict:
    """state_dict() of the module (or a submodule) right after a step, while that
    step's all-gathers are in flight, as torch DDP loops save checkpoints."""
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(MLP(), bucket_cap_mb=0.0001, schedule=schedule)
    opt = fgp.ShardedOptimizer(model, SlowOnRank1AdamW, lr=1e-2)
    for step in range(5):
        x, y = make_batch("mlp", step, 0, rank)
        loss_fn("mlp", model(x), y).backward()
        opt.step()
        opt.zero_grad()
    module = model.module.net[0] if via == "submodule" else model.module
    if via == "module on rank 0":  # torch DDP's idiom: one rank saves, the others wait
        saved = {k: v.clone() for k, v in module.state_dict().items()} if rank == 0 else None
        dist.barrier()
    else:
        saved = {k: v.clone() for k, v in module.state_dict().items()}
    model.synchronize()
    return {"saved": saved, "landed": {k: v.clone() for k, v in module.state_dict().items()}}


def load_checkpoint_with_gathers_in_flight(rank: int, world_size: int, schedule: str,
                                           via: str) -> dict:
    """Load a checkpoint (through the wrapper, its module, or a submodule) right
    after a step, while that step's all-gathers are in flight; then train on."""
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(MLP(), bucket_cap_mb=0.0001, schedule=schedule)
    opt = fgp.ShardedOptimizer(model, SlowOnRank1AdamW, lr=1e-2)
    checkpoint = None
    # Past the steps that profile the plan (their end synchronises the ranks).
    for step in range(5):
        x, y = make_batch("mlp", step, 0, rank)
        loss_fn("mlp", model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step == 3:
            model.synchronize()
            checkpoint = copy.deepcopy(model.module.state_dict())
    # Step 4's values as they are now, gathers in flight (state_dict() would land them).
    before_load = {k: v.detach().clone() for k, v in model.module.named_parameters()}
    if via == "wrapper":
        model.load_state_dict({"module." + k: v for k, v in checkpoint.items()})
    elif via == "module":
        model.module.load_state_dict(checkpoint)
    else:  # the first layer only: its all-gathers are the first to go out
        checkpoint = {k: v for k, v in checkpoint.items() if k.startswith("net.0.")}
        model.module.net[0].load_state_dict({k[len("net.0."):]: v for k, v in checkpoint.items()})
    model.synchronize()
    loaded = model.module.state_dict()
    result = {"loaded": all(torch.equal(loaded[k], v) for k, v in checkpoint.items()),
              # The test can fail: step 4 did change what the checkpoint restores.
              "step_changed_it": any(not torch.equal(before_load[k], v)
                                     for k, v in checkpoint.items())}
    x, y = make_batch("mlp", 5, 0, rank)  # training goes on from the loaded values
    loss_fn("mlp", model(x), y).backward()
    opt.step()
    opt.zero_grad()
    model.synchronize()
    result["params"] = [p.detach().clone() for p in model.module.parameters()]
    try:
        model.load_state_dict(model.state_dict(), assign=True)
    except ValueError as error:
        result["assign_refused"] = str(error)
    return result


def global_optimizer_hook_calls(rank: int, world_size: int, schedule: str) -> tuple[int, int]:
    """torch.optim's global step hooks (profilers, trackers) over 3 steps: (pre, post)."""
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)
    calls = [0, 0]
    handles = [register_optimizer_step_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)),
               register_optimizer_step_post_hook(lambda *_: calls.__setitem__(1, calls[1] + 1))]
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(MLP(), bucket_cap_mb=0.0001, schedule=schedule,
                                        **({"overlap_plan": "layout"} if schedule == "two_stage"
                                           else {}))
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    for step in range(3):
        x, y = make_batch("mlp", step, 0, rank)
        loss_fn("mlp", model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for handle in handles:
        handle.remove()
    return calls[0], calls[1]


def inner_steps_per_step(rank: int, world_size: int, schedule: str,
                         min_elements: Optional[str]) -> dict:
    """The inner optimizer's calls in each of 3 steps of an MLP in many buckets, with
    FGPSDP_STEP_CHUNK_MIN_ELEMENTS as given (None: the default), and the parameters."""
    if min_elements is None:
        os.environ.pop("FGPSDP_STEP_CHUNK_MIN_ELEMENTS", None)
    else:
        os.environ["FGPSDP_STEP_CHUNK_MIN_ELEMENTS"] = min_elements
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(MLP(), bucket_cap_mb=0.0001, schedule=schedule)
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    calls = []
    inner_step = opt._inner_step

    def counted():
        calls[-1] += 1
        inner_step()
    opt._inner_step = counted
    for step in range(3):
        x, y = make_batch("mlp", step, 0, rank)
        loss_fn("mlp", model(x), y).backward()
        calls.append(0)
        opt.step()
        opt.zero_grad()
    model.synchronize()
    return {"calls": calls, "buckets": len(model.buckets),
            "params": [p.detach().clone() for p in model.module.parameters()]}


class _ForwardingOptimizer:
    """A trainer's wrapper that forwards what it lacks to the optimizer it wraps."""

    def __init__(self, optimizer):
        self._optimizer = optimizer

    def __getattr__(self, name):
        return getattr(self._optimizer, name)


class _SubclassingOptimizer:
    """Lightning's LightningOptimizer: the wrapped optimizer's __dict__ copied, its
    class taken as a base, and what is still missing forwarded."""

    def __init__(self, optimizer):
        self.__dict__ = {k: v for k, v in optimizer.__dict__.items() if k != "step"}
        self.__class__ = type("Lightning" + type(optimizer).__name__,
                              (type(self), type(optimizer)), {})
        self._optimizer = optimizer

    def __getattr__(self, name):
        return getattr(self._optimizer, name)


def optimizer_surface_as_trainers_read_it(rank: int, world_size: int) -> dict:
    """What trainer libraries read of an optimizer, of a ShardedOptimizer and of torch's
    AdamW side by side: HF's Trainer and accelerate call opt.train() where hasattr()
    finds it; Lightning's wrapper reads param_groups and repr through its class;
    pickle and copy.deepcopy give copies whose param_groups and repr work."""
    import pickle
    ours, opt, ref, ref_opt = _adamw_beside_torch_ddp(MLP(), "two_stage")
    x, y = make_batch("mlp", 0, 0, rank)
    for model, o in ((ours, opt), (ref, ref_opt)):
        loss_fn("mlp", model(x), y).backward()
        o.step()
        o.zero_grad()
    out = {}
    for side, o in (("ours", opt), ("torch", ref_opt)):
        read = {"probe": [hasattr(o, "train"), hasattr(o, "eval")]}
        for wrap in (_ForwardingOptimizer, _SubclassingOptimizer):
            wrapped = wrap(o)
            read[wrap.__name__] = [len(wrapped.param_groups), wrapped.param_groups[0]["lr"],
                                   "lr: 0.01" in repr(wrapped)]
        for name, made in (("pickled", lambda o=o: pickle.loads(pickle.dumps(o))),
                           ("deepcopied", lambda o=o: copy.deepcopy(o))):
            try:
                copied = made()
                read[name] = [len(copied.param_groups), copied.param_groups[0]["lr"],
                              repr(copied) == repr(o)]
            except Exception as error:  # noqa: BLE001 - what a copy raises is the result
                read[name] = f"{type(error).__name__}: {error}"
        out[side] = read
    return out


class GatedStepCountingSGD(StepCountingSGD):
    """StepCountingSGD whose first step on the scheduler thread (a two_stage
    speculative one) in each training step waits, inside its run on copies of the
    groups, until the loop has done what it does after backward (``loop_done``)."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, lr)
        self.inside, self.loop_done = threading.Event(), threading.Event()

    def step(self, closure=None):
        if threading.current_thread() is not threading.main_thread() \
                and not self.inside.is_set():
            self.inside.set()
            self.loop_done.wait(10.0)
        return super().step(closure)


def param_groups_replaced_during_a_speculative_step(rank: int, world_size: int,
                                                    replace: bool) -> dict:
    """opt.param_groups given new dicts of the same values right after backward, while
    a speculative step runs on copies of the groups (an optimizer counting in its
    groups: the copies' counts must be the ones kept). Before, the new list went into
    the inner optimizer at once, the running step counted in the loop's dicts, and
    the ranks' counts could differ."""
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(MLP(), bucket_cap_mb=0.0001, schedule="two_stage",
                                        overlap_plan="layout")
    opt = fgp.ShardedOptimizer(model, GatedStepCountingSGD, lr=0.05)
    gated = opt.optim
    counts = []  # group["k"] after each step
    for step in range(3):
        gated.inside.clear()
        gated.loop_done.clear()
        x, y = make_batch("mlp", step, 0, rank)
        loss_fn("mlp", model(x), y).backward()
        if model.scheduler.stopped_because is not None:
            break  # no speculative step to wait for (a count went wrong: see counts)
        assert gated.inside.wait(10.0), "no speculative step ran"
        if replace:
            opt.param_groups = [dict(g) for g in opt.param_groups]
        gated.loop_done.set()
        opt.step()
        counts.append([g["k"] for g in opt.param_groups])
        opt.zero_grad()
    model.synchronize()
    return {"k": counts, "params": [p.detach().clone() for p in model.module.parameters()]}
