"""Model structures beside torch DDP: fgpsdp + ShardedOptimizer(AdamW, clipping) against
torch DDP + AdamW + clip_grad_norm_ on the same seed and per-rank data.

Structures the other scenarios do not build: a block applied several times, a
parameter the parent reads and hands to a child, parameter containers,
torch.nn.utils parametrizations (and one with a parameter of its own), the old
spectral_norm, recurrent layers, outputs with unused parts, zero-element
parameters, parameters read only in forward hooks, a custom autograd.Function,
requires_grad switched between steps, mixed float32/float64, transposed and
strided parameters. (Not a bias before BatchNorm or MultiheadAttention's key
bias: their gradient is zero in exact arithmetic, and Adam turns the rounding
left there into full-size steps on both sides, differently.)
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations, parametrize

STEPS = 8


def _mlp_body(width_in: int = 6) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width_in, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


class SharedBlock(nn.Module):  # ALBERT: one block applied three times
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(6, 16), nn.Linear(16, 3)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())

    def forward(self, x):
        h = self.inp(x)
        for _ in range(3):
            h = self.block(h)
        return self.out(h)


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x, scale):
        return self.lin(x) * scale


class ParentReadsAndPasses(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(6, 16), nn.Linear(16, 3)
        self.scale = nn.Parameter(torch.randn(16))
        self.child = _Scaled()

    def forward(self, x):
        return self.out(self.child(torch.tanh(self.inp(x) * self.scale), self.scale))


class Containers(nn.Module):
    def __init__(self):
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(6, 16) * 0.3),
                                    nn.Parameter(torch.randn(16, 16) * 0.3),
                                    nn.Parameter(torch.randn(16, 3) * 0.3)])
        self.bs = nn.ParameterDict({k: nn.Parameter(torch.zeros(n))
                                    for k, n in (("a", 16), ("b", 16), ("c", 3))})

    def forward(self, x):
        h = torch.tanh(x @ self.ws[0] + self.bs["a"])
        h = torch.tanh(h @ self.ws[1] + self.bs["b"])
        return h @ self.ws[2] + self.bs["c"]


def parametrized() -> nn.Module:
    m = _mlp_body()
    parametrizations.orthogonal(m[2])
    parametrizations.weight_norm(m[4])
    return m


def spectral_norms() -> nn.Module:
    m = _mlp_body()
    torch.nn.utils.spectral_norm(m[2])  # the old hook-based one: weight_orig, buffers u, v
    parametrizations.spectral_norm(m[4])
    return m


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 8, num_layers=2, batch_first=True, bidirectional=True,
                            proj_size=4)
        self.gru = nn.GRU(8, 6, batch_first=True)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        y, _ = self.lstm(x.reshape(x.shape[0], 2, 3))
        y, _ = self.gru(y)
        return self.out(y[:, -1])


@dataclasses.dataclass
class Outputs:
    logits: torch.Tensor
    aux: torch.Tensor
    extra: torch.Tensor


class ManyOutputs(nn.Module):
    """A dict, a nested tuple or a dataclass; the loss leaves one head unused."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.trunk, self.head = nn.Linear(6, 16), nn.Linear(16, 3)
        self.aux, self.extra = nn.Linear(16, 4), nn.Linear(16, 2)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        a, b, c = self.head(h), self.aux(h), self.extra(h)
        if self.kind == "dict":
            return {"logits": a, "aux": b, "extra": c}
        if self.kind == "tuple":
            return a, (b, [c])
        return Outputs(a, b, c)


class _TupleOfDataclass(nn.Module):
    """torch DDP's side of the dataclass output: its find_unused_parameters does not
    look into a dataclass (the unused head then fails its next forward)."""

    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, x):
        o = self.m(x)
        return o.logits, o.aux, o.extra


class ZeroElements(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(6, 16), nn.Linear(16, 3)
        self.empty, self.empty2 = nn.Parameter(torch.zeros(0)), nn.Parameter(torch.zeros(16, 0))

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        return self.l2(h + (h[:, :0] @ self.empty2.t()).sum() + self.empty.sum())


class ReadInHooks(nn.Module):
    """A delta added by a child's forward hook, a gate read by the root's pre-hook."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 3)
        self.delta = nn.Parameter(torch.randn(16) * 0.1)
        self.gate = nn.Parameter(torch.ones(6))
        self.l2.register_forward_hook(lambda m, i, o: o + self.delta)
        self.register_forward_pre_hook(lambda m, args: (args[0] * self.gate,))

    def forward(self, x):
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


class _LearnedScale(nn.Module):  # a parametrization with a parameter of its own
    def __init__(self, n: int):
        super().__init__()
        self.s = nn.Parameter(torch.ones(n, 1))

    def forward(self, w):
        return w * self.s


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x, g.sum(0)


class CustomPieces(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(6, 16), nn.Linear(16, 16)
        parametrize.register_parametrization(self.l2, "weight", _LearnedScale(16))
        self.w3, self.b3 = nn.Parameter(torch.randn(3, 16) * 0.3), nn.Parameter(torch.zeros(3))

    def forward(self, x):
        return _LinearFn.apply(torch.tanh(self.l2(torch.tanh(self.l1(x)))), self.w3, self.b3)


class FourLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3, self.l4 = (nn.Linear(6, 16), nn.Linear(16, 16),
                                              nn.Linear(16, 16), nn.Linear(16, 3))

    def forward(self, x):
        return self.l4(torch.tanh(self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))))


def _freeze_some(module: FourLayers, step: int) -> None:
    """Parameters frozen and unfrozen between steps, on every rank alike."""
    module.l2.weight.requires_grad_(step % 3 != 1)
    module.l3.bias.requires_grad_(step % 2 == 0)
    module.l1.weight.requires_grad_(step not in (2, 3, 4, 5, 6))


class MixedDtypes(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(6, 16), nn.Linear(16, 16).double(), nn.Linear(16, 3)

    def forward(self, x):
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)).double())).float())


class OddStrides(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter((torch.randn(16, 6) * 0.3).t())  # transposed
        self.w2 = nn.Parameter((torch.randn(16, 3, 2) * 0.3)[..., 0])  # strides (6, 2)
        self.b = nn.Parameter(torch.zeros(16))

    def forward(self, x):
        return torch.tanh(x @ self.w1 + self.b) @ self.w2


# name -> (build, find_unused_parameters, per-step change or None)
STRUCTURES = {
    "shared_block": (SharedBlock, False, None),
    "parent_reads_and_passes": (ParentReadsAndPasses, False, None),
    "containers": (Containers, False, None),
    "parametrized": (parametrized, False, None),
    "spectral_norms": (spectral_norms, False, None),
    "recurrent": (Recurrent, False, None),
    "dict_output": (lambda: ManyOutputs("dict"), True, None),
    "tuple_output": (lambda: ManyOutputs("tuple"), True, None),
    "dataclass_output": (lambda: ManyOutputs("dataclass"), True, None),
    "zero_elements": (ZeroElements, False, None),
    "read_in_hooks": (ReadInHooks, False, None),
    "custom_pieces": (CustomPieces, False, None),
    "frozen_between_steps": (FourLayers, True, _freeze_some),
    "mixed_dtypes": (MixedDtypes, False, None),
    "odd_strides": (OddStrides, False, None),
}


def _loss(out, y):
    if isinstance(out, dict):
        return F.mse_loss(out["logits"], y)  # aux, extra unused
    if isinstance(out, Outputs):
        return F.mse_loss(out.logits, y) + 0.1 * out.extra.pow(2).mean()  # aux unused
    if isinstance(out, tuple):
        if len(out) == 3:  # torch DDP's side of the dataclass
            return _loss(Outputs(*out), y)
        return F.mse_loss(out[0], y) + 0.1 * out[1][0].pow(2).mean()  # [c] unused
    return F.mse_loss(out, y)


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)  # a module whose hooks close over self is built, not copied
    return STRUCTURES[name][0]()


def _layout_in_a_bucket(t: torch.Tensor) -> tuple[int, ...]:
    """A parameter keeps its strides where it is dense in memory (any order); one
    with gaps (a strided slice) cannot, and is laid out row-major."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    dense = t.permute(order).is_contiguous()
    return t.stride() if dense else torch.empty(t.shape).stride()


def side_by_side(rank: int, world_size: int, name: str, schedule: str,
                 overlap_plan: str = "auto", max_grad_norm: float = 1.0) -> dict:
    """Per parameter: (largest difference to torch DDP relative to its largest value,
    moved under DDP, moved here, same strides) after STEPS steps."""
    import fgpsdp_runtime as fgp
    _, find_unused, per_step = STRUCTURES[name]
    ref_module, ours_module = _build(name), _build(name)
    initial = {n: p.detach().clone() for n, p in ref_module.named_parameters()}
    ref = nn.parallel.DistributedDataParallel(
        _TupleOfDataclass(ref_module) if name == "dataclass_output" else ref_module,
        find_unused_parameters=find_unused, bucket_cap_mb=0.0002)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ours = fgp.DistributedDataParallel(ours_module, bucket_cap_mb=0.0002, schedule=schedule,
                                       overlap_plan=overlap_plan,
                                       find_unused_parameters=find_unused)
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                               max_grad_norm=max_grad_norm)
    dtype = next(ref_module.parameters()).dtype
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 6, generator=gen, dtype=dtype), torch.randn(8, 3, generator=gen,
                                                                          dtype=dtype)
        if per_step is not None:
            per_step(ref_module, step)
            per_step(ours_module, step)
        _loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        _loss(ours(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    ours.synchronize()
    ref_params = dict(ref_module.named_parameters())
    out = {}
    for n, p in ours_module.named_parameters():
        r, p = ref_params[n].detach(), p.detach()
        if p.numel() == 0:
            out[n] = (0.0, 0.0, 0.0, True)
            continue
        out[n] = (float((p - r).abs().max()) / max(float(r.abs().max()), 1e-12),
                  float((r - initial[n]).abs().max()), float((p - initial[n]).abs().max()),
                  p.stride() == _layout_in_a_bucket(r))
    scheduler = ours.scheduler
    return {"params": out,
            "speculated": None if scheduler is None else (scheduler.commits, scheduler.rollbacks)}


def every_structure(rank: int, world_size: int) -> dict:
    results = {}
    for name in STRUCTURES:
        # two_stage speculating for every bucket but the last reduced (the layout plan),
        # clipping at 0.5 (its speculative steps roll back where it clips); next_forward
        # as it is.
        results[(name, "two_stage")] = side_by_side(rank, world_size, name, "two_stage",
                                                    overlap_plan="layout", max_grad_norm=0.5)
        results[(name, "next_forward")] = side_by_side(rank, world_size, name, "next_forward")
    return results


class SkipsEveryOtherForward(nn.Module):
    """Every other forward reads mid's parameters in place of calling mid (a branch):
    the module order changes there only after the read."""

    def __init__(self):
        super().__init__()
        # mid large enough that its all-gather is still in flight at the read.
        self.inp, self.mid, self.out = nn.Linear(6, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 3)
        self.forwards = 0

    def forward(self, x):
        self.forwards += 1
        h = torch.tanh(self.inp(x))
        if self.forwards % 2 == 0:
            h = torch.tanh(F.linear(h, self.mid.weight, self.mid.bias))
        else:
            h = torch.tanh(self.mid(h))
        return self.out(h)


def trained_apart(rank: int, world_size: int, schedule: str) -> dict:
    """fgpsdp and torch DDP (AdamW) each train SkipsEveryOtherForward on their own:
    a torch DDP step between fgpsdp's step and its next forward would give the
    all-gathers time to land. Returns the largest parameter difference and the steps
    whose loss differed."""
    import fgpsdp_runtime as fgp
    torch.manual_seed(0)
    ref_module = SkipsEveryOtherForward()
    ours_module = SkipsEveryOtherForward()
    ours_module.load_state_dict(ref_module.state_dict())
    ref = nn.parallel.DistributedDataParallel(ref_module)
    ours = fgp.DistributedDataParallel(ours_module, bucket_cap_mb=0.0001, schedule=schedule)
    losses = {}
    for model, opt in ((ref, torch.optim.AdamW(ref.parameters(), lr=1e-2)),
                       (ours, fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2))):
        losses[model] = []
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
            loss = F.mse_loss(model(x), y)
            losses[model].append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    ours.synchronize()
    diff = max(float((p.detach() - r.detach()).abs().max()) for p, r in
               zip(ours_module.parameters(), ref_module.parameters()))
    return {"diff": diff, "steps_differing": [step for step, (a, b) in
                                              enumerate(zip(losses[ours], losses[ref])) if a != b],
            "deviations": ours._forward_waiter.deviations}
