"""Parameters the loop holds from before the step, read right after it (torch_ema's
EMA keeps ``list(model.parameters())``), beside torch DDP. See held_param_reads.py."""
from __future__ import annotations

import copy
import io
import threading

import torch
from torch import nn

import fgpsdp_runtime as fgp
from fgpsdp_runtime import held_param_reads
from fgpsdp_runtime.held_param_reads import ParameterInFlight


def _base() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(step * 10 + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _read_held(how: str, shadow: list, held: list) -> None:
    """What a loop does with parameters it holds, right after the step."""
    with torch.no_grad():
        if how == "torch_ema":  # torch_ema's ExponentialMovingAverage.update()
            for s, p in zip(shadow, held):
                s.sub_(0.1 * (s - p))
        elif how == "foreach":  # one call over the whole list
            torch._foreach_lerp_(shadow, held, 0.1)
        elif how == "data":  # through .data, then an op on the plain tensor it gives
            for s, p in zip(shadow, held):
                s.mul_(0.9).add_(p.data, alpha=0.1)
        elif how == "detach":
            for s, p in zip(shadow, held):
                s.copy_(p.detach() * 0.5 + s * 0.5)
        elif how == "clamp":  # written in place (a clamp of a scale, OpenCLIP-style)
            for s, p in zip(shadow, held):
                p.clamp_(-0.2, 0.2)
                s.copy_(p)
        elif how == "data_write":  # through .data (torch_ema's copy_to and restore)
            for s, p in zip(shadow, held):
                p.data.copy_(p.data.clamp(-0.2, 0.2))
                s.copy_(p.data)
        elif how == "copy":  # a copy of the parameter itself
            for i, p in enumerate(held):
                shadow[i].copy_(copy.deepcopy(p))
        elif how == "thread":  # read on another thread (a logger's)
            def read():
                for s, p in zip(shadow, held):
                    s.copy_(p * 2.0)
            reader = threading.Thread(target=read)
            reader.start()
            reader.join()
        else:
            raise ValueError(how)


def _side_by_side(schedule: str):
    """Ours and torch DDP over copies of one model, AdamW each, the parameter lists
    held from the start, and a copy of each list (an EMA's shadow):
    ``(ours, ref), (opt, ref_opt), helds, shadows``."""
    base = _base()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ours = fgp.DistributedDataParallel(base, schedule=schedule, bucket_cap_mb=0.001)
    opts = (fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2),
            torch.optim.AdamW(ref.parameters(), lr=1e-2))
    helds = [list(m.module.parameters()) for m in (ours, ref)]
    shadows = [[p.detach().clone() for p in held] for held in helds]
    return (ours, ref), opts, helds, shadows


def _train_reading_after_each_step(rank: int, models, opts, helds, shadows, read,
                                   after_each_step=lambda: None) -> None:
    """4 steps of ours and of torch DDP, ``read(shadow, held)`` right after each."""
    for step in range(4):
        x, y = _batch(step, rank)
        for model, o, held, shadow in zip(models, opts, helds, shadows):
            nn.functional.mse_loss(model(x), y).backward()
            o.step()
            o.zero_grad()
            read(shadow, held)
        after_each_step()


def held_reads_after_the_step(rank: int, world_size: int, schedule: str, how: str) -> float:
    """The largest difference, against torch DDP, of what the held reads gave and
    of the models after 4 steps."""
    (ours, ref), opts, helds, shadows = _side_by_side(schedule)
    _train_reading_after_each_step(rank, (ours, ref), opts, helds, shadows,
                                   lambda shadow, held: _read_held(how, shadow, held))
    ours.synchronize()
    with torch.no_grad():
        pairs = list(zip(shadows[0], shadows[1])) + list(
            zip(ours.module.parameters(), ref.module.parameters()))
        return max(float((a - b).abs().max()) for a, b in pairs)


class _Attention(nn.Module):
    """Tied embedding, attention (nn.MultiheadAttention reads out_proj.weight without
    calling out_proj) and a norm."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(23, 16)
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 23, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.layer(self.embed(tokens)))


def classes_through_a_loop(rank: int, world_size: int, schedule: str, model: str) -> dict:
    """A loop's own calls, between the step and the next forward and in it, land
    nothing through held parameters (they would take the all-gathers out of the
    forward's overlap): counts held_param_reads.land's calls, and the classes
    the held parameters have after the step and after synchronize()."""
    torch.manual_seed(0)
    base = _base() if model == "mlp" else _Attention()
    ours = fgp.DistributedDataParallel(base, schedule=schedule, bucket_cap_mb=0.001)
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2, max_grad_norm=1.0)
    held = list(base.parameters())
    landed = []
    real_land = held_param_reads.land
    held_param_reads.land = lambda p: (landed.append(p), real_land(p))[1]
    after_step = []
    try:
        for step in range(4):
            x, y = _batch(step, rank)
            if model == "mlp":
                loss = nn.functional.mse_loss(ours(x), y)
            else:
                tokens = torch.randint(0, 23, (4, 6), generator=torch.Generator().manual_seed(step))
                loss = nn.functional.cross_entropy(ours(tokens).flatten(0, 1), tokens.flatten())
            loss.backward()
            opt.step()
            after_step.append(sorted({type(p).__name__ for p in held}))
            opt.zero_grad(set_to_none=True)
            ours.zero_grad()
            _ = [p.shape for p in held] + [p.dtype for p in held] + [p.grad for p in held]
            _ = {p: 1 for p in held}  # hashed as dict keys
        in_loop = len(landed)
        ours.synchronize()
        return {"landed_in_loop": in_loop, "after_step": after_step,
                "after_synchronize": sorted({type(p).__name__ for p in held})}
    finally:
        held_param_reads.land = real_land


def held_copies_and_pickles(rank: int, world_size: int) -> dict:
    """A deep copy, a pickle and a repr of a held parameter whose all-gather is
    pending: each lands it first and is of class nn.Parameter."""
    base = _base()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ours = fgp.DistributedDataParallel(base, schedule="next_forward", bucket_cap_mb=0.001)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2)
    held, ref_held = list(base.parameters()), list(ref.module.parameters())
    out = {}
    for step, way in enumerate(("deepcopy", "pickle")):
        x, y = _batch(step, rank)
        for model, o in ((ours, opt), (ref, ref_opt)):
            nn.functional.mse_loss(model(x), y).backward()
            o.step()
            o.zero_grad()
        pending = type(held[0]) is ParameterInFlight
        if way == "deepcopy":
            copies = [copy.deepcopy(p) for p in held]
        else:
            buffer = io.BytesIO()
            torch.save(held, buffer)
            buffer.seek(0)
            copies = torch.load(buffer)
        out[way] = {"pending_before": pending,
                    "classes": sorted({type(c).__name__ for c in copies}),
                    "diff": max(float((c.detach() - r.detach()).abs().max())
                                for c, r in zip(copies, ref_held))}
    ours.synchronize()
    return out


def dropped_wrapper_gives_the_class_back(rank: int, world_size: int) -> list:
    """A wrapper freed while its all-gathers are pending: the module outlives it,
    and its parameters are nn.Parameter again."""
    import gc
    import warnings
    base = _base()
    ours = fgp.DistributedDataParallel(base, schedule="next_forward", bucket_cap_mb=0.001)
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2)
    held = list(base.parameters())
    x, y = _batch(0, rank)
    nn.functional.mse_loss(ours(x), y).backward()
    opt.step()
    before = sorted({type(p).__name__ for p in held})
    del ours, opt
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (what did not land, if anything)
        gc.collect()
    return [before, sorted({type(p).__name__ for p in held})]


def compiled_read_of_held_parameters(rank: int, world_size: int, schedule: str,
                                     fullgraph: bool = False) -> dict:
    """An EMA update compiled apart, over held parameters, right after each step: it
    reads the updated values (the landing is a graph break), or under
    ``fullgraph=True`` raises, saying what to do (returns the message). Also how
    many graphs were compiled by the end of each step."""
    (ours, ref), opts, helds, shadows = _side_by_side(schedule)
    compiles = []

    def backend(graph, _example_inputs):
        compiles.append(1)
        return graph.forward
    def update(shadow, held):
        if fullgraph:
            for s, p in zip(shadow, held):
                s.lerp_(p, 0.1)
        else:
            torch._foreach_lerp_(shadow, held, 0.1)
    ema = torch.no_grad()(torch.compile(update, backend=backend, fullgraph=fullgraph))
    compiled_by_step = []
    try:
        _train_reading_after_each_step(rank, (ours, ref), opts, helds, shadows, ema,
                                       lambda: compiled_by_step.append(len(compiles)))
    except Exception as error:  # (fullgraph)
        ours.synchronize()
        return {"raised": str(error)}
    ours.synchronize()
    with torch.no_grad():
        diff = max(float((a - b).abs().max()) for a, b in zip(shadows[0], shadows[1]))
    return {"diff": diff, "compiled_by_step": compiled_by_step}


def _on_a_thread_inside_the_forward(rank: int, schedule: str, layer: int, steps: int,
                                    call) -> tuple:
    """``call(model, held)`` run on another thread from ``layer``'s forward pre-hook
    (so while the loop's forward runs, most buckets not landed yet), in every
    forward but the first, of ours and of torch DDP: ``(ours, [what each call
    returned] for ours and for torch DDP)``."""
    (ours, ref), opts, helds, _ = _side_by_side(schedule)
    loop_thread = threading.get_ident()
    returned = []
    for model, o, held in zip((ours, ref), opts, helds):
        got: list = []

        def on_a_thread(_module, _args, model=model, held=held, got=got):
            if threading.get_ident() != loop_thread:
                return  # (the layer called by ``call`` itself)
            other = threading.Thread(target=lambda: got.append(call(model, held)))
            other.start()
            other.join()
        for step in range(steps):
            x, y = _batch(step, rank)
            hook = model.module[layer].register_forward_pre_hook(on_a_thread) if step else None
            nn.functional.mse_loss(model(x), y).backward()
            if hook is not None:
                hook.remove()
            o.step()
            o.zero_grad()
        returned.append(got)
    return ours, returned


def _copies(_model, held) -> list:
    return [p.detach().clone() for p in held]


def _eval_of_the_module(model, _held) -> torch.Tensor:
    with torch.no_grad():
        return model.module(torch.ones(2, 16))


def thread_reads_during_the_forward(rank: int, world_size: int, schedule: str) -> float:
    """Another thread (a logger's, an asynchronous checkpoint's) reads the held
    parameters while the next forward runs, from the first layer's pre-hook, so most
    buckets have not landed yet: the largest difference of what it read from what
    torch DDP's thread reads. (Before, reads off the forward's thread landed
    nothing while a forward ran, by any path: about 1e-2 off.)"""
    _, (mine, theirs) = _on_a_thread_inside_the_forward(rank, schedule, 0, 2, _copies)
    return max(float((a - b).abs().max()) for a, b in zip(mine[0], theirs[0]))


def module_called_on_a_thread_during_the_forward(rank: int, world_size: int,
                                                 schedule: str) -> dict:
    """``model.module(x)`` on another thread (a logger's eval) while the loop's forward
    runs, from the third layer's pre-hook: its output against torch DDP's, and how
    many of the loop's forwards were taken for another module order. (Before, the
    thread's pre-hooks ran as the loop forward's: a deviation each time, and the
    thread waited as the loop.)"""
    ours, (mine, theirs) = _on_a_thread_inside_the_forward(rank, schedule, 2, 4,
                                                           _eval_of_the_module)
    return {"diff": max(float((a - b).abs().max()) for a, b in zip(mine, theirs)),
            "evals": len(mine), "deviations": ours._forward_waiter.deviations}
