"""opt.grad_norms(), opt.full_grad(p) and opt.full_state(p) beside torch DDP's p.grad
and its optimizer's state, on the same data.

Imported by the spawned ranks (module-level functions only).
"""
from __future__ import annotations

import contextlib
import copy
import warnings

import torch
from torch import nn

import fgpsdp_runtime as fgp
from .scenarios import MODELS, loss_fn, make_batch, reference_clip_


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of their width: equal only if bit for bit (-0.0
    apart from 0.0, a NaN equal to itself), which torch.equal and differences miss."""
    widths = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().contiguous().view(widths[t.element_size()])


def adamw_beside_torch_ddp(base: nn.Module, model_name: str, schedule: str,
                           local_size: int = 0) -> tuple:
    """fgpsdp's wrapper of ``base`` (tiny buckets; under two_stage the layout plan, which
    speculates from the first step) with AdamW, and torch DDP over a copy with AdamW:
    (ours, opt, ref, ref_opt). The "unused" model finds unused parameters on both."""
    find_unused = model_name == "unused"
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base),
                                              find_unused_parameters=find_unused)
    kw = {"topology": fgp.Topology(local_size=local_size)} if local_size else {}
    ours = fgp.DistributedDataParallel(
        base, bucket_cap_mb=0.0001, schedule=schedule, find_unused_parameters=find_unused,
        overlap_plan="layout" if schedule == "two_stage" else "auto", **kw)
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.module.parameters() if p.requires_grad],
                                lr=1e-2)
    return ours, opt, ref, ref_opt


def _compare(opt, ours, ref, where: str, found: list[str], worst: list[float]) -> None:
    """Every parameter's full_grad() against ref's p.grad (layout included; ``worst``
    gets [the largest difference, how many gradients differ in any bit]), and
    grad_norms() against p.grad.norm()."""
    norms = opt.grad_norms()
    ref_named = dict(ref.module.named_parameters())
    expected = {n for n, p in ref_named.items() if p.grad is not None}
    if set(norms) != expected:
        found.append(f"{where}: grad_norms() names {sorted(norms)}, torch DDP's p.grad "
                     f"set for {sorted(expected)}")
    for name, param in ours.module.named_parameters():
        ref_grad = ref_named[name].grad
        full = opt.full_grad(param)
        if (full is None) != (ref_grad is None):
            found.append(f"{where}: {name}: full_grad {'None' if full is None else 'set'}, "
                         f"torch DDP's p.grad {'None' if ref_grad is None else 'set'}")
            continue
        if full is None:
            continue
        if full.shape != ref_grad.shape or full.stride() != ref_grad.stride() \
                or full.dtype != ref_grad.dtype:
            found.append(f"{where}: {name}: full_grad {tuple(full.shape)} {full.stride()} "
                         f"{full.dtype}, p.grad {tuple(ref_grad.shape)} {ref_grad.stride()}")
            continue
        worst[0] = max(worst[0], float((full - ref_grad).abs().max()) if full.numel() else 0.0)
        worst[1] += not torch.equal(bits(full), bits(ref_grad))
        if name in norms:
            norm, ref_norm = float(norms[name]), float(ref_grad.norm())
            if abs(norm - ref_norm) > 1e-6 * max(ref_norm, 1e-30):
                found.append(f"{where}: {name}: norm {norm!r}, torch's {ref_norm!r}")
            if norms[name].dtype != ref_grad.dtype or norms[name].dim() != 0:
                found.append(f"{where}: {name}: norm {norms[name]!r}")


def _compare_state(opt, ours, ref, ref_opt, where: str, found: list[str]) -> float:
    """Every parameter's full_state() against ref_opt.state[p] (entries, their order,
    shapes, layouts and dtypes), and bit for bit against full_state_dict()'s entry,
    gathered another way; returns the largest difference from torch's of a tensor
    entry."""
    ref_named = dict(ref.module.named_parameters())
    gathered = opt.full_state_dict()["state"]  # numbered as module.parameters()
    worst = 0.0
    for number, (name, param) in enumerate(ours.module.named_parameters()):
        state, ref_state = opt.full_state(param), ref_opt.state.get(ref_named[name], {})
        other = gathered.get(number, {})
        if list(state) != list(other) or any(
                not torch.equal(bits(value.cpu()), bits(other[key]))
                for key, value in state.items()):
            found.append(f"{where}: {name}: full_state() is not full_state_dict()'s entry")
        if param.numel() == 0:  # no slice holds it: never stepped here (docs/semantics.md)
            if state:
                found.append(f"{where}: {name}: state {state} of a parameter of no elements")
            continue
        if list(state) != list(ref_state):
            found.append(f"{where}: {name}: state entries {list(state)}, torch's "
                         f"{list(ref_state)}")
            continue
        for key, value in state.items():
            expected = ref_state[key]
            if value.shape != expected.shape or value.dtype != expected.dtype or (
                    value.dim() and value.stride() != expected.stride()):
                found.append(f"{where}: {name}: {key} {tuple(value.shape)} {value.dtype}, "
                             f"torch's {tuple(expected.shape)} {expected.dtype}")
            elif value.numel():
                worst = max(worst, float((value - expected).abs().max()))
    return worst


def grads_beside_torch_ddp(rank: int, world_size: int, schedule: str, model_name: str,
                           local_size: int = 0, reads: bool = True) -> dict:
    """Three steps of AdamW beside torch DDP, both clipping at step 1 (the norm is
    above the bound), the second step's gradients accumulated over two micro-batches
    (the first under no_sync()). After each backward, after the clip, after the step
    and after zero_grad(), every parameter's gradient read both ways (``reads=False``:
    none, the same training otherwise).

    After each step, full_state() of every parameter against torch's optimizer state.

    Returns {"mismatches": [...], "largest_difference": float, "bit_differences": how
    many gradients read differ from torch DDP's in any bit, "warnings": [...],
    "params": fgpsdp's parameters at the end, "state_differences": one per step}."""
    torch.manual_seed(1234)
    base = EmptyParameterNet() if model_name == "empty_parameter" else MODELS[model_name]()
    model_name = "mlp" if model_name == "empty_parameter" else model_name  # (its batches)
    ours, opt, ref, ref_opt = adamw_beside_torch_ddp(base, model_name, schedule, local_size)
    found: list[str] = []
    worst = [0.0, 0]
    state_differences: list[float] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train_and_compare(opt, ours, ref, ref_opt, model_name, rank, found, worst, reads,
                           state_differences)
    ours.synchronize()
    # _compare walks model.module.named_parameters() between backward and step: no
    # warning that torch's clip would see no gradient (the loop reads them through ours).
    said = [str(w.message) for w in caught if "fgpsdp" in str(w.message)]
    return {"mismatches": found, "largest_difference": worst[0], "bit_differences": worst[1],
            "warnings": said,
            "params": [p.detach().clone() for p in ours.module.parameters()],
            "state_differences": state_differences}


def backward_both(ours, ref, model_name: str, step: int, rank: int) -> None:
    """Step ``step``'s backward on both sides: two micro-batches in step 1 (the first
    under no_sync()), one otherwise."""
    micro = 2 if step == 1 else 1
    for m in range(micro):
        x, y = make_batch(model_name, step, m, rank)
        for model in (ours, ref):
            ctx = model.no_sync() if m < micro - 1 else contextlib.nullcontext()
            with ctx:
                (loss_fn(model_name, model(x), y) / micro).backward()


def _train_and_compare(opt, ours, ref, ref_opt, model_name: str, rank: int,
                       found: list[str], worst: list[float], reads: bool,
                       state_differences: list[float]) -> None:
    def compare(where: str) -> None:
        if reads:
            _compare(opt, ours, ref, where, found, worst)
    for step in range(3):
        backward_both(ours, ref, model_name, step, rank)
        compare(f"step {step} after backward")
        if step == 1:
            opt.clip_grad_norm_(1e-3)
            reference_clip_(ref.parameters(), 1e-3)
            compare(f"step {step} after the clip")
        opt.step()
        ref_opt.step()
        compare(f"step {step} after the step")
        if reads:
            state_differences.append(
                _compare_state(opt, ours, ref, ref_opt, f"step {step}", found))
        opt.zero_grad()
        ref_opt.zero_grad()
    compare("after zero_grad()")


def full_grad_refusals(rank: int, world_size: int) -> dict:
    """What full_grad() says of a tensor that is no parameter of the model, of a slice
    piece from opt.param_groups, of a parameter left to the user, and of one frozen at
    wrapping (None, as its p.grad)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    module[0].bias.requires_grad_(False)
    module._ddp_params_and_buffers_to_ignore = ["1.bias"]
    model = fgp.DistributedDataParallel(module, schedule="serial")
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    said = {}
    for what, tensor in (("other", torch.zeros(4)), ("piece", opt.param_groups[0]["params"][0]),
                         ("ignored", module[1].bias), ("not a tensor", "0.weight")):
        try:
            opt.full_grad(tensor)
            said[what] = "returned"
        except ValueError as error:
            said[what] = str(error)
    said["frozen"] = opt.full_grad(module[0].bias)
    opt.step()
    model.synchronize()
    return said


def different_reads(rank: int, world_size: int, other: str) -> None:
    """Rank 0 asks for one parameter's gradient, and the others for another's
    (``other="parameter"``), for the norms of a model of three trainable parameters
    (``"norms"``), or rank 0 for a frozen parameter's (``"frozen"``: None, without a
    collective of its own before) or for a tensor not of the model's (``"stranger"``:
    a ValueError on rank 0 alone before): raises on every rank (before, the figures
    of two reads were summed together, silently, or the ranks' collectives paired
    with other ones)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2, bias=False), nn.Linear(2, 2))
    module[2].requires_grad_(False)
    model = fgp.DistributedDataParallel(module, schedule="serial")
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1,
                               param_groups=[{"params": list(module[:2].parameters())}])
    model(torch.randn(3, 4)).sum().backward()
    if rank > 0 and other == "norms":
        opt.grad_norms()
    elif rank > 0:
        opt.full_grad(module[1].weight)
    elif other == "frozen":
        opt.full_grad(module[2].weight)
    elif other == "stranger":
        opt.full_grad(torch.zeros(4))
    else:
        opt.full_grad(module[0].weight)  # the wrapper's parameter 0


def read_after_a_no_sync_backward(rank: int, world_size: int, read: str) -> None:
    """A read after a backward under no_sync() alone raises on every rank: reducing
    those gradients apart from the rest of the accumulation would change the step."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model = fgp.DistributedDataParallel(module, schedule="two_stage")
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    with model.no_sync():
        model(torch.randn(3, 4)).sum().backward()
    if read == "norms":
        opt.grad_norms()
    else:
        opt.full_grad(module[0].weight)


class EmptyParameterNet(nn.Module):
    """A parameter of no elements beside a linear layer (no bucket holds it)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(13, 5)
        self.empty = nn.Parameter(torch.zeros(0))

    def forward(self, x):
        return self.lin(x) + self.empty.sum()


def grads_under_join(rank: int, world_size: int, schedule: str) -> dict:
    """Uneven inputs (rank 0 runs 2 batches, rank 1 runs 4): every step's gradient
    norms and whole gradients, and after the step Adam's exp_avg (full_state()), read
    on the active ranks under fgpsdp's model.join() (the joined rank takes its part in
    the reads) and then torch DDP's join."""
    torch.manual_seed(1234)
    base = MODELS["mlp"]()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ours = fgp.DistributedDataParallel(base, bucket_cap_mb=0.0001, schedule=schedule)
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def loop(model, optimizer, read, read_state) -> list:
        reads = []
        for step in range((2, 4)[rank]):
            x, y = make_batch("mlp", step, 0, rank)
            loss_fn("mlp", model(x), y).backward()
            norms, grads = read()
            optimizer.step()
            reads.append((norms, grads, read_state()))
            optimizer.zero_grad()
        return reads

    with ours.join():
        ours_reads = loop(ours, opt, lambda: (
            {n: float(v) for n, v in opt.grad_norms().items()},
            [opt.full_grad(p) for p in ours.module.parameters()]),
            lambda: [opt.full_state(p)["exp_avg"] for p in ours.module.parameters()])
    with ref.join():
        ref_reads = loop(ref, ref_opt, lambda: (
            {n: float(p.grad.norm()) for n, p in ref.module.named_parameters()},
            [p.grad.clone() for p in ref.module.parameters()]),
            lambda: [ref_opt.state[p]["exp_avg"].clone() for p in ref.module.parameters()])
    ours.synchronize()
    found = []
    for step, ((norms, grads, states), (ref_norms, ref_grads, ref_states)) in enumerate(
            zip(ours_reads, ref_reads)):
        if set(norms) != set(ref_norms) or any(
                abs(norms[n] - ref_norms[n]) > 1e-6 * ref_norms[n] for n in norms):
            found.append(f"step {step}: norms {norms}, torch's {ref_norms}")
        if any(not torch.equal(bits(g), bits(r)) for g, r in zip(grads, ref_grads)):
            found.append(f"step {step}: a whole gradient differs from torch DDP's p.grad")
        if any(not torch.equal(bits(a), bits(b)) for a, b in zip(states, ref_states)):
            found.append(f"step {step}: an exp_avg differs from torch's after the step")
    return {"mismatches": found, "reads": len(ours_reads)}


def reads_beside_no_sync(rank: int, world_size: int, schedule: str, under_join: bool,
                         reads: bool) -> dict:
    """Three steps of two micro-batches, the first under no_sync(); after it, with
    ``reads``, a gradient read (refused: caught), and in step 1, after zero_grad(
    set_to_none=False), another (allowed: zeros, nothing to reduce). Under
    ``under_join`` inside model.join() (even inputs: no rank joins), where the read's
    announcement would have launched the reduction of the no_sync() gradients.
    Returns what the reads said and the parameters at the end."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model = fgp.DistributedDataParallel(
        module, schedule=schedule, overlap_plan="layout" if schedule == "two_stage" else "auto")
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    said = []
    with model.join() if under_join else contextlib.nullcontext():
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + rank)
            with model.no_sync():
                model(torch.randn(5, 8, generator=g)).pow(2).sum().backward()
            if reads:
                try:
                    opt.full_grad(module[0].weight)
                    said.append("read")
                except RuntimeError as error:  # (under join too: every rank's type alike)
                    said.append(f"{type(error).__name__}: {error}")
                if step == 1:
                    opt.zero_grad(set_to_none=False)
                    norms = opt.grad_norms()
                    said.append("zeros" if all(float(v) == 0.0 for v in norms.values())
                                else f"norms {norms}")
            elif step == 1:
                opt.zero_grad(set_to_none=False)
            model(torch.randn(5, 8, generator=g)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    model.synchronize()
    return {"said": said, "params": [p.detach().clone() for p in module.parameters()]}


def frozen_parameter_state(rank: int, world_size: int) -> dict:
    """full_state() of a parameter frozen at wrapping, beside torch's Adagrad, which
    gives every listed parameter its initial sum at construction."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    base[0].bias.requires_grad_(False)
    ref_opt = torch.optim.Adagrad(copy.deepcopy(base).parameters(), lr=0.1,
                                  initial_accumulator_value=0.3)
    model = fgp.DistributedDataParallel(base, schedule="serial")
    opt = fgp.ShardedOptimizer(model, torch.optim.Adagrad, lr=0.1,
                               initial_accumulator_value=0.3,
                               param_groups=[{"params": list(base.parameters())}])
    ref_state = list(ref_opt.state.values())[1]  # the frozen bias, second listed
    state = opt.full_state(base[0].bias)
    return {"keys": list(state), "ref_keys": list(ref_state),
            "equal": all(torch.equal(state[k], ref_state[k]) for k in ref_state)}


def norms_of_a_non_finite_gradient(rank: int, world_size: int) -> dict:
    """Rank 0's loss puts an inf into one weight's gradient: grad_norms() shows which
    parameter (inf there, finite elsewhere), as p.grad.norm() would under torch DDP."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model = fgp.DistributedDataParallel(module, schedule="two_stage")
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    loss = model(torch.randn(3, 4)).sum()
    if rank == 0:
        loss = loss + module[1].weight.view(-1)[0] * float("inf")
    loss.backward()
    norms = {name: float(norm) for name, norm in opt.grad_norms().items()}
    opt.step()  # skipped: the norm is inf
    model.synchronize()
    return norms


def torch_clip_beside_a_read(rank: int, world_size: int, read: str) -> list[str]:
    """A loop that logs opt.grad_norms() (``read="norms"``) or reads one parameter's
    gradient (``"one full_grad"``), and clips with torch's clip_grad_norm_ over
    model.parameters() (which sees no gradient): still warned at the step."""
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)),
                                        schedule="serial")
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(3, 4)).sum().backward()
        if read == "norms":
            opt.grad_norms()
        else:
            opt.full_grad(model.module[1].bias)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.synchronize()
    return [str(w.message) for w in caught if "fgpsdp" in str(w.message)]
