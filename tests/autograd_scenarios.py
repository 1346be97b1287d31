"""Parameters the backward still reads after their gradient is complete.

Imported by the spawned ranks (module-level functions only).
"""
from __future__ import annotations

import contextlib
import copy
import gc
import time

import torch
import torch.nn.functional as F
from torch import nn

import fgpsdp_runtime as fgp


class DetachedReadNet(nn.Module):
    """out.weight is also read through .detach() early on: saved for the gradient of
    h0 only, it is read by backward after out.weight's own gradient is complete.
    ``how``: through ``.detach()`` of the parameter, of a view of it, or a view
    taken under no_grad (no autograd history either, though it says requires_grad)."""

    def __init__(self, how: str = "detach"):
        super().__init__()
        self.how = how
        self.inp = nn.Linear(12, 32)
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh())
                                    for _ in range(3)])
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        h0 = torch.tanh(self.inp(x))
        if self.how == "detach":
            w = self.out.weight.detach()
        elif self.how == "view_detach":
            w = self.out.weight.t().detach().t()
        else:
            with torch.no_grad():
                w = self.out.weight[:]
        side = F.linear(h0, w)
        return self.out(self.body(h0)) + 0.5 * torch.tanh(side)


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 12, generator=g), torch.randn(16, 4, generator=g)


def detached_read_side_by_side(rank: int, world_size: int, schedule: str,
                               steps: int = 4, eval_first: bool = False,
                               how: str = "detach") -> float:
    """Largest parameter difference to torch DDP (AdamW, one bucket per parameter).
    ``eval_first``: a no-grad forward (an evaluation, a sanity check) comes first."""
    torch.manual_seed(1234 + rank)
    base = DetachedReadNet(how)
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    kw = {"overlap_plan": "layout"} if schedule == "two_stage" else {}
    ours = fgp.DistributedDataParallel(base, bucket_cap_mb=0.0001, schedule=schedule, **kw)
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    if eval_first:
        with torch.no_grad():
            ours(_batch(99, rank)[0])
            ref(_batch(99, rank)[0])
    _train_both(ours, opt, ref, ref_opt, rank, steps)
    return _param_diff(ours, ref)


def backward_after_step_through_old_graph(rank: int, world_size: int, schedule: str) -> None:
    """GAN loops' classic bug: a retained graph's second backward after the step. torch
    DDP raises "modified by an inplace operation"; so must every schedule."""
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(DetachedReadNet(), bucket_cap_mb=0.0001,
                                        schedule=schedule)
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    x, y = _batch(0, rank)
    loss = F.mse_loss(model(x), y)
    loss.backward(retain_graph=True)
    opt.step()
    loss.backward()


class PlainNet(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, width), nn.Tanh(), nn.Linear(width, width),
                                 nn.Tanh(), nn.Linear(width, 4))

    def forward(self, x):
        return self.net(x)


class SlowSGD(torch.optim.SGD):
    """SGD whose step takes a while after its writes (a large bucket's step)."""

    def step(self, closure=None):
        loss = super().step(closure)
        time.sleep(0.3)
        return loss


def second_backward_through_retained_graph(rank: int, world_size: int,
                                           slow_step: bool = False) -> None:
    """two_stage steps parameters speculatively during the first backward: the second
    one through the same graph must raise, not use the new values, on every rank.
    ``slow_step``: the second backward starts while the speculative steps are still
    running (before: it read their new values unnoticed, or raised on one rank only)."""
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(PlainNet(), bucket_cap_mb=0.0001,
                                        schedule="two_stage", overlap_plan="layout")
    opt = fgp.ShardedOptimizer(model, SlowSGD if slow_step else torch.optim.SGD,  # noqa: F841
                               lr=0.1)
    x, y = _batch(0, rank)
    out = model(x)
    F.mse_loss(out, y).backward(retain_graph=True)
    if not slow_step:
        time.sleep(0.5)  # the scheduler thread's speculative steps are done
    out.square().mean().backward()


def second_backward_reduces_too(rank: int, world_size: int, schedule: str,
                                how: str) -> list:
    """Two backwards through one synchronised forward (``how="twice"``, the graph
    retained) against one backward of the loss doubled (``"doubled"``): each
    backward reduces, and the two reductions add up to exactly what the doubled
    loss reduces (a factor of 2 is exact). Plain SGD; returns the parameters."""
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(PlainNet(), bucket_cap_mb=0.0001, schedule=schedule)
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    for step in range(3):
        x, y = _batch(step, rank)
        loss = F.mse_loss(model(x), y)
        if how == "twice":
            loss.backward(retain_graph=True)
            loss.backward()
        else:
            (2 * loss).backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()
    return [p.detach().clone() for p in model.module.parameters()]


def _plain_side_by_side(rank: int, schedule: str, build=PlainNet,
                        optimizer=(torch.optim.SGD, 0.5)):
    """``build()`` (PlainNet) under fgpsdp (one bucket per parameter) and torch DDP,
    the same optimizer class and learning rate (SGD at 0.5) on both."""
    torch.manual_seed(1234 + rank)
    base = build()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ours = fgp.DistributedDataParallel(base, bucket_cap_mb=0.0001, schedule=schedule)
    cls, lr = optimizer
    opt = fgp.ShardedOptimizer(ours, cls, lr=lr)
    return ours, opt, ref, cls(ref.parameters(), lr=lr)


def _train_both(ours, opt, ref, ref_opt, rank: int, steps: int) -> None:
    """``steps`` steps of ours and of torch DDP on the same batches, zeroing first."""
    for step in range(steps):
        x, y = _batch(step, rank)
        for model, optimizer in ((ours, opt), (ref, ref_opt)):
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
    ours.synchronize()


def _param_diff(ours, ref) -> float:
    """Largest parameter difference to torch DDP."""
    return max(float((a.detach() - b.detach()).abs().max())
               for a, b in zip(ours.module.parameters(), ref.module.parameters()))


def clamp_after_step(rank: int, world_size: int, schedule: str, synchronize_first: bool,
                     via: str = "held", steps: int = 4) -> float:
    """WGAN's weight clipping (OpenCLIP clamps logit_scale alike): parameters written in
    place right after opt.step(), ``via`` a list of them taken before training
    (``held``; ``held_not_landed``: written with the torch functions of tensor
    subclasses disabled, which land them), ``model.module.parameters()`` read then
    (``module``), each
    submodule's (``submodules``), or each read as an attribute then, as OpenCLIP
    reads ``model.module.logit_scale`` (``attributes``; ``attribute_data``: its
    ``.data``). Largest parameter difference to torch DDP."""
    ours, opt, ref, ref_opt = _plain_side_by_side(rank, schedule)
    held = {id(m): list(m.module.parameters()) for m in (ours, ref)}

    def params(model):
        if via in ("held", "held_not_landed"):
            return held[id(model)]
        if via == "module":
            return model.module.parameters()
        if via in ("attributes", "attribute_data"):
            read = [getattr(layer, name) for layer in model.module.net
                    if isinstance(layer, nn.Linear) for name in ("weight", "bias")]
            return read if via == "attributes" else [p.data for p in read]
        return [p for sub in model.module.children() for p in sub.parameters()]
    for step in range(steps):
        x, y = _batch(step, rank)
        for model, optimizer in ((ours, opt), (ref, ref_opt)):
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if model is ours and synchronize_first:
                ours.synchronize()
            with torch.no_grad(), (torch._C.DisableTorchFunctionSubclass()
                                   if via == "held_not_landed" else contextlib.nullcontext()):
                for p in params(model):
                    p.clamp_(-0.1, 0.1)
    ours.synchronize()
    return _param_diff(ours, ref)


class MaxNormLinear(nn.Linear):
    """braindecode's LinearWithConstraint: the weight renormed, as new storage, in forward."""

    def forward(self, x):
        self.weight.data = torch.renorm(self.weight.data, p=2, dim=0, maxnorm=0.5)
        return super().forward(x)


def renorm_in_forward(rank: int, world_size: int, schedule: str) -> float:
    """A max-norm constraint assigning ``weight.data`` in forward, with a no-grad eval
    forward between steps. Largest parameter difference to torch DDP."""
    ours, opt, ref, ref_opt = _plain_side_by_side(
        rank, schedule,
        lambda: nn.Sequential(MaxNormLinear(12, 32), nn.Tanh(), MaxNormLinear(32, 4)),
        (torch.optim.AdamW, 0.05))
    for step in range(4):
        x, y = _batch(step, rank)
        for model, optimizer in ((ours, opt), (ref, ref_opt)):
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():  # a validation forward (renorms too)
                model(x)
    ours.synchronize()
    return _param_diff(ours, ref)


def copies_and_direct_calls(rank: int, world_size: int, schedule: str) -> dict:
    """After a step: copy.deepcopy(model.module) and AveragedModel (SWA) work, a pickle of
    the module loads, and model.module(x) called directly (an eval, generate())
    sees the updated parameters, as under torch DDP. A copy holds none of the
    wrapper's hooks and scripts; scripting model.module itself names that recipe."""
    import io
    ours, opt, ref, ref_opt = _plain_side_by_side(rank, schedule)
    outputs, sub_outputs, copies, leftovers, hooks_left = [], [], [], 0, 0
    for step in range(3):
        x, y = _batch(step, rank)
        for model, optimizer in ((ours, opt), (ref, ref_opt)):
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        # Copies right after the step, gathers in flight (timm's ModelEmaV2 copies
        # lazily there): before, they held the other ranks' slices before the step.
        made = [copy.deepcopy(ours.module), torch.optim.swa_utils.AveragedModel(ours.module)]
        buffer = io.BytesIO()
        torch.save(ours.module, buffer)
        buffer.seek(0)
        made.append(torch.load(buffer, weights_only=False))
        # What export pipelines do: script a copy (the copy has no hooks to compile).
        made.append(torch.jit.script(copy.deepcopy(ours.module)))
        leftovers += sum("__getstate__" in vars(m) for c in made[:3] for m in c.modules())
        # No hook of ours went with the copies (PlainNet has none of its own).
        hooks_left += sum(_hook_count(m) for c in made[:3] for m in c.modules())
        with torch.no_grad():
            expected = ref.module(x)
            copies += [float((m(x) - expected).abs().max()) for m in made]
        with torch.no_grad():  # right after the step, gathers in flight
            # A submodule called directly (CLIP's encode_image calling self.visual):
            # the last layer, whose bucket the forward-order gathers reach last.
            h = torch.tanh(torch.randn(x.shape[0], 32))
            sub_outputs.append(float((ours.module.net[4](h) - ref.module.net[4](h)).abs().max()))
            outputs.append(float((ours.module(x) - ref.module(x)).abs().max()))
    try:
        torch.jit.script(ours.module)
        script_error = None
    except Exception as error:  # noqa: BLE001 - what the user sees
        script_error = f"{type(error).__name__}: {error}"
    return {"direct_call_diffs": outputs, "submodule_call_diffs": sub_outputs,
            "copy_diffs": copies, "copies_holding_our_getstate": leftovers,
            "copies_holding_hooks": hooks_left, "script_error": script_error}


def read_right_after_the_step(rank: int, world_size: int, schedule: str, how: str) -> float:
    """Trained 2 steps beside torch DDP, then, right after the last step, the
    all-gathers in flight, the module converted (PyTorch Lightning's
    ``lightning_module.cpu()`` at the end of a fit, on a GPU a copy; an export's
    ``.half()``) or its ``_parameters`` tables read (an export script's walk): the
    largest difference between what was copied or read and torch DDP's. Hidden
    layers 512 wide (1 MiB weights): all-gathers long enough that the read comes
    before they land."""
    ours, opt, ref, ref_opt = _plain_side_by_side(rank, schedule, build=lambda: PlainNet(512),
                                                  optimizer=(torch.optim.SGD, 0.05))
    for step in range(2):
        x, y = _batch(step, rank)
        for model, optimizer in ((ref, ref_opt), (ours, opt)):  # ours last: right after it
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
    if how.startswith("table."):
        read = [p.detach().clone() for m in ours.module.modules() for p in _table_read(m, how)]
    else:
        for model in (ours, ref):
            if how == "module.double":
                model.module.double()
            elif how == "module.half":
                model.module.half()
            elif how == "submodules.to":  # the last layer first, its bucket lands last
                for index in (4, 2, 0):
                    model.module.net[index].to(torch.float64)
            elif how == "wrapper.double":
                model.double()
        # (copies now: nothing lands on reading them)
        read = [p.detach() for m in ours.module.modules() for p in m._parameters.values()]
    expected = [p.detach() for m in ref.module.modules() for p in m._parameters.values()]
    return max(float((a.double() - b.double()).abs().max()) for a, b in zip(read, expected))


class ListingNet(PlainNet):
    """A class whose named_parameters builds a list (nn.Module's hands out a generator)."""

    def named_parameters(self, *args, **kwargs):
        return [(n, p) for n, p in super().named_parameters(*args, **kwargs)]


class DelegatingNet(PlainNet):
    """A class whose named_parameters hands out its child's."""

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        yield from self.net.named_parameters(prefix=(prefix + "." if prefix else "") + "net",
                                             recurse=recurse, remove_duplicate=remove_duplicate)


def named_parameters_of_its_own(rank: int, world_size: int, cls_name: str) -> dict:
    """A module class with a named_parameters of its own, under two_stage beside torch
    DDP (3 steps): whether model.module.zero_grad() right after the last step (the
    library's own read of the parameters, whose gradients it resets) landed the
    all-gathers the next forward overlaps, and the difference to torch DDP."""
    build = {"ListingNet": ListingNet, "DelegatingNet": DelegatingNet}[cls_name]
    ours, opt, ref, ref_opt = _plain_side_by_side(rank, "two_stage", build=lambda: build(512),
                                                  optimizer=(torch.optim.SGD, 0.05))
    for step in range(3):
        x, y = _batch(step, rank)
        for model, optimizer in ((ref, ref_opt), (ours, opt)):  # ours last: right after it
            model.module.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
    in_flight = bool(ours._gathers.in_flight)
    ours.module.zero_grad()
    still = bool(ours._gathers.in_flight)
    return {"in_flight_before": in_flight, "in_flight_after_zero_grad": still,
            "diff": _param_diff(ours, ref)}


def _table_read(module: nn.Module, how: str) -> list:
    table = module._parameters
    if how == "table.items":
        return [p for _, p in table.items()]
    if how == "table.values":
        return list(table.values())
    return [table.get(name) for name in table]  # "table.get"


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_state_dict_pre_hooks",
               "_state_dict_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def _hook_count(module: nn.Module) -> int:
    return sum(len(getattr(module, name)) for name in _HOOK_DICTS)


class _UsersPreHook:
    """A forward pre-hook of the user's, registered before wrapping: scales the input."""

    def __call__(self, module, args):
        return (args[0] * 2.0,)


def _users_kwargs_hook(module, args, kwargs, output):
    return output + 1.0


def copy_keeps_the_users_hooks(rank: int, world_size: int, schedule: str) -> dict:
    """A copy or a pickle of model.module leaves the wrapper's hooks out and keeps
    the user's (one registered before wrapping, one after, one with kwargs and
    always_called)."""
    import io
    torch.manual_seed(1234)
    base = PlainNet()
    base.net[0].register_forward_pre_hook(_UsersPreHook())
    ours = fgp.DistributedDataParallel(base, bucket_cap_mb=0.0001, schedule=schedule)
    opt = fgp.ShardedOptimizer(ours, torch.optim.SGD, lr=0.5)
    ours.module.net[4].register_forward_hook(_users_kwargs_hook, with_kwargs=True,
                                             always_call=True)
    x, y = _batch(0, rank)
    F.mse_loss(ours(x), y).backward()
    opt.step()
    copied = copy.deepcopy(ours.module)
    buffer = io.BytesIO()
    torch.save(ours.module, buffer)
    buffer.seek(0)
    pickled = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        expected = ours.module(x)  # the user's hooks run on the wrapped module too
        out = {"copy_equal": torch.equal(copied(x), expected),
               "pickled_equal": torch.equal(pickled(x), expected)}
    for name, c in (("copy", copied), ("pickle", pickled)):
        first, last = c.net[0], c.net[4]
        out[f"{name}_hooks"] = (
            [type(h).__name__ for h in first._forward_pre_hooks.values()],
            [getattr(h, "__name__", None) for h in last._forward_hooks.values()],
            list(last._forward_hooks_with_kwargs.values()),
            list(last._forward_hooks_always_called.values()),
            sum(_hook_count(m) for m in c.modules()))
    return out


def train_through_module_only(rank: int, world_size: int, schedule: str,
                              steps: int = 5) -> float:
    """A loop that never calls the wrapper: ``model.module(x)`` trains (the gradients
    are reduced all the same). Before the wrapper's first forward the module's calls
    recorded their reads instead of landing the all-gathers: each step's forward read
    parameters half updated (1e-4 to 6e-4 off torch DDP, a different figure each run).
    Largest parameter difference to torch DDP trained through its wrapper."""
    ours, opt, ref, ref_opt = _plain_side_by_side(rank, schedule)
    for step in range(steps):
        x, y = _batch(step, rank)
        F.mse_loss(ours.module(x), y).backward()
        F.mse_loss(ref(x), y).backward()
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    ours.synchronize()
    return _param_diff(ours, ref)


def copy_the_wrapper(rank: int, world_size: int) -> None:
    copy.deepcopy(fgp.DistributedDataParallel(PlainNet()))


def clamp_between_backward_and_step(rank: int, world_size: int) -> None:
    """Under two_stage the speculative steps have run when backward returns: a
    parameter written then would be partly lost. Raises at the step, before any change."""
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(PlainNet(), bucket_cap_mb=0.0001,
                                        schedule="two_stage", overlap_plan="layout")
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    x, y = _batch(0, rank)
    F.mse_loss(model(x), y).backward()
    time.sleep(0.3)  # the speculative steps are done
    with torch.no_grad():
        for p in model.module.parameters():
            p.clamp_(-0.1, 0.1)
    opt.step()



def _state_tensors(opt) -> list[torch.Tensor]:
    """By key (an undo puts the restored entries last)."""
    state = opt.state_dict()["shard"]["state"]
    return [state[k][n].clone() for k in sorted(state) for n in sorted(state[k])
            if torch.is_tensor(state[k][n])]


def optimizer_state_dict_between_backward_and_step(rank: int, world_size: int,
                                                   undo: str = "synchronize") -> dict:
    """Under two_stage the stage-1 steps have updated the optimizer state when
    backward returns: opt.state_dict(), opt.full_state_dict() and
    opt.load_state_dict() raise there (on every rank, found by an audit: a loop
    passed the profile window, then failed from step 4 on); after
    model.synchronize() or model.state_dict() (``undo``, on every rank) they see
    the state before the step, the model's state dict holds the parameters before
    the step, and the step then runs as it would have."""
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(PlainNet(), bucket_cap_mb=0.0001,
                                        schedule="two_stage", overlap_plan="layout")
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    messages = []
    for step in range(3):
        x, y = _batch(step, rank)
        before = _state_tensors(opt)
        saved = opt.state_dict()
        params_before = [p.detach().clone() for p in model.parameters()]
        F.mse_loss(model(x), y).backward()
        if step == 1:
            for call in (opt.state_dict, opt.full_state_dict,
                         lambda: opt.load_state_dict(saved)):
                try:
                    call()
                    messages.append(None)
                except RuntimeError as error:
                    messages.append(str(error))
            if undo == "synchronize":
                model.synchronize()  # undoes the stage-1 steps, state included
                saved_params = [p.detach().clone() for p in model.parameters()]
            else:
                saved_params = list(model.state_dict().values())  # undoes them too
            after_sync, before_backward = _state_tensors(opt), before
            params_kept = len(saved_params) == len(params_before) and all(
                torch.equal(a, b) for a, b in zip(saved_params, params_before))
            opt.load_state_dict(saved)  # what a rewind does: allowed now
        opt.step()
        opt.zero_grad()
    model.synchronize()
    return {"messages": messages,
            "state_before_the_step": len(before_backward) > 0
            and len(before_backward) == len(after_sync)
            and all(torch.equal(a, b) for a, b in zip(before_backward, after_sync)),
            "params_before_the_step": params_kept,
            "params": [p.detach().clone() for p in model.module.parameters()]}


def optimizer_state_dict_reference(rank: int, world_size: int) -> dict:
    """The same loop under serial, without the calls between backward and step."""
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(PlainNet(), bucket_cap_mb=0.0001, schedule="serial")
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    for step in range(3):
        x, y = _batch(step, rank)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {"params": [p.detach().clone() for p in model.module.parameters()]}


def _copied_right_after_a_step(net: nn.Module) -> tuple:
    """``net`` wrapped (``next_forward``) and stepped once, and a deep copy of the
    module taken right after the step (which lands the all-gathers); the wrapper
    and its optimizer are dropped. Returns the copy and the trained parameters."""
    model = fgp.DistributedDataParallel(net, schedule="next_forward")
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    ema = copy.deepcopy(model.module)
    model.synchronize()
    trained = [p.detach().clone() for p in net.parameters()]
    del model, opt
    gc.collect()
    return ema, trained


def copy_of_a_parametrized_module(rank: int, world_size: int) -> dict:
    """torch.nn.utils.parametrize's own __deepcopy__ copies __dict__, our copy guard
    with it: the copy's must belong to the copy (before, it pointed at the original
    and its wrapper, and copying the copy failed once they were gone)."""
    from torch.nn.utils import parametrizations
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    parametrizations.weight_norm(net[2])
    ema, trained = _copied_right_after_a_step(net)
    del net
    gc.collect()
    same = all(torch.equal(a, b) for a, b in zip(ema.parameters(), trained))
    again = copy.deepcopy(ema)  # the original and its wrapper are gone
    guard = vars(ema[2]).get("__getstate__")
    return {"copy_equal": same,
            "copy_of_copy_equal": all(torch.equal(a, b)
                                      for a, b in zip(again.parameters(), ema.parameters())),
            "guard_is_the_copys": guard is not None and guard._module() is ema[2]}


class OwnDeepcopyNet(nn.Module):
    """A class whose own ``__deepcopy__`` copies its ``__dict__`` as user code may
    (``how``): deep-copied whole, the copy put into the memo first (``registers``)
    or not (``does-not``); merged into the copy's own (``dict-update``); item by
    item (``item-by-item``), or item by item without the memo (``neither``). Its
    ``__del__`` closes a handle, as a class holding a file would."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.handle_open = True
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))

    def __del__(self):
        self.__dict__["handle_open"] = False

    def __deepcopy__(self, memo):
        replica = type(self).__new__(type(self))
        if self.how not in ("does-not", "neither"):
            memo[id(self)] = replica
        if self.how in ("item-by-item", "neither"):
            for k, v in self.__dict__.items():
                setattr(replica, k, copy.deepcopy(v, memo))
        elif self.how == "dict-update":
            replica.__dict__.update(copy.deepcopy(self.__dict__, memo))
        else:
            replica.__dict__ = copy.deepcopy(self.__dict__, memo)
        return replica


def copy_by_a_class_own_deepcopy(rank: int, world_size: int, how: str) -> dict:
    """A copy made by a class's own ``__deepcopy__`` right after the step: its
    parameters are the updated ones, and it reads, zeroes, pickles (with what was
    set on it) and copies again once the original and its wrapper are gone, and
    reading it finalizes nothing. (Before, without registering the copy in the memo
    first, the copy's parameters() raised: its guard pointed at another copy, made
    meanwhile by our load hook, which held the module, and soon gone.)"""
    import pickle
    torch.manual_seed(0)
    net = OwnDeepcopyNet(how)
    ema, trained = _copied_right_after_a_step(net)
    del net
    gc.collect()

    def equal(module):
        params = list(module.parameters())
        return len(params) == len(trained) and all(torch.equal(a, b)
                                                   for a, b in zip(params, trained))
    copy_equal = equal(ema)
    ema.zero_grad()  # the copy's zero_grad guard zeroes the copy's, as nn.Module's
    ema.eval()
    pickled = pickle.loads(pickle.dumps(ema))
    return {"copy_equal": copy_equal, "submodule_reads": len(list(ema.a.parameters())) == 2,
            "pickled_equal": equal(pickled), "pickled_in_eval": not pickled.training,
            "copy_of_copy_equal": equal(copy.deepcopy(ema)), "handle_open": ema.handle_open}


def copy_by_a_deepcopy_of_neither_kind(rank: int, world_size: int) -> str:
    """A class's own ``__deepcopy__`` that copies ``__dict__`` item by item without
    putting the copy into the memo first: the copy's guards point at nothing once
    the original is gone, and its ``parameters()`` raises, saying what to do.
    Returns the message."""
    torch.manual_seed(0)
    net = OwnDeepcopyNet("neither")
    ema, _ = _copied_right_after_a_step(net)
    del net
    gc.collect()
    try:
        list(ema.parameters())
    except TypeError as error:
        return str(error)
    return "no error"


def user_grad_hooks_side_by_side(rank: int, world_size: int, schedule: str,
                                 registered: str) -> dict:
    """A post-accumulate-grad hook that reads and edits the local gradient (halves
    it, clamps it: per-parameter gradient surgery), registered on the module's
    parameters ``before`` or ``after`` wrapping, on ours and on torch DDP's. torch
    DDP runs its reduction after every such hook, whenever it was registered.
    Returns the largest parameter difference and the hook calls that saw no gradient."""
    torch.manual_seed(7)
    base = PlainNet()
    ref_module = copy.deepcopy(base)
    saw_none = []

    def hook(param):
        if param.grad is None:
            saw_none.append(1)
            return
        param.grad.mul_(0.5).clamp_(-0.01, 0.01)

    def register(module):
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(hook)

    if registered == "before":
        register(base)
        register(ref_module)
    ours = fgp.DistributedDataParallel(base, bucket_cap_mb=0.0001, schedule=schedule)
    ref = nn.parallel.DistributedDataParallel(ref_module)
    if registered == "after":
        register(base)
        register(ref_module)
    # SGD: its update scales with the gradient (AdamW's would hide the halving).
    opt = fgp.ShardedOptimizer(ours, torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    _train_both(ours, opt, ref, ref_opt, rank, 3)
    return {"diff": _param_diff(ours, ref), "saw_none": len(saw_none)}


def gradients_assigned_by_the_loop(rank: int, world_size: int, schedule: str) -> float:
    """``torch.autograd.grad`` of the loss, its results set on ``p.grad`` by the loop,
    then ``opt.step()``: the gradients are reduced at the step, as ``no_sync()``'s
    are. Largest parameter difference to torch DDP's loop with each gradient divided
    by the ranks and all-reduced by hand (torch DDP alone would step each rank on its
    own)."""
    import torch.distributed as dist
    ours, opt, ref, ref_opt = _plain_side_by_side(rank, schedule)
    for step in range(3):
        x, y = _batch(step, rank)
        for model, optimizer in ((ours, opt), (ref, ref_opt)):
            params = list(model.module.parameters())
            for p, g in zip(params, torch.autograd.grad(F.mse_loss(model(x), y), params)):
                if model is ref:
                    g = g / world_size
                    dist.all_reduce(g)
                p.grad = g
            optimizer.step()
            optimizer.zero_grad()
    ours.synchronize()
    return _param_diff(ours, ref)
