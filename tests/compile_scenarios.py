"""torch.compile around the wrapper, around the module, or around a submodule.

Imported by the spawned ranks (module-level functions only).
"""
from __future__ import annotations

import copy
import inspect
import threading
import time

import torch
import torch._dynamo
from torch import nn

import fgpsdp_runtime as fgp

from .scenarios import MLP, make_batch, param_diff

BACKEND = "aot_eager"  # dynamo and AOTAutograd as inductor sees them, without its C++ build


def _unique_graphs() -> int:
    """The graphs dynamo has made in this process so far."""
    import torch._dynamo.utils
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def compiled_side_by_side(rank: int, world_size: int, how: str, schedule: str,
                          accumulate: int = 1, fullgraph: bool = False, steps: int = 4) -> dict:
    """fgpsdp's parameters after ``steps`` steps and their largest difference to
    torch DDP's (compiled around its wrapper), fgpsdp compiled ``how``:

    - "eager": not compiled;
    - "wrapper": torch.compile(fgpsdp wrapper);
    - "module" / "submodule": torch.compile(m) (an OptimizedModule) before wrapping;
    - "module_in_place" / "module_in_place_later" / "submodule_in_place_later":
      nn.Module.compile(), before wrapping or after the first step.

    ``accumulate`` > 1 runs that many forward/backward pairs per step without
    no_sync(): forwards between backward and step, which undo two_stage's
    speculative steps and send the restored slices again. ``fullgraph``: every
    compile but the wrapper's is ``fullgraph=True`` (torchtitan compiles each block
    so, before wrapping it).
    """
    torch.manual_seed(0)
    base = MLP()
    reference = copy.deepcopy(base)
    options = {"backend": BACKEND, "fullgraph": fullgraph}
    if how == "module":
        base = torch.compile(base, **options)
    elif how == "submodule":
        base.net[2] = torch.compile(base.net[2], **options)
    elif how == "module_in_place":
        base.compile(**options)
    # overlap_plan="layout": two_stage speculates from the first step.
    kw = {"overlap_plan": "layout"} if schedule == "two_stage" else {}
    ours = fgp.DistributedDataParallel(base, schedule=schedule, bucket_cap_mb=0.0001, **kw)
    ref = nn.parallel.DistributedDataParallel(reference)
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    run_ours = torch.compile(ours, backend=BACKEND) if how == "wrapper" else ours
    run_ref = torch.compile(ref, backend=BACKEND)
    for step in range(steps):
        if step == 1 and how == "module_in_place_later":
            ours.module.compile(**options)
        if step == 1 and how == "submodule_in_place_later":
            ours.module.net[2].compile(**options)
        for m in range(accumulate):
            x, y = make_batch("mlp", step, m, rank)
            nn.functional.mse_loss(run_ours(x), y).backward()
            nn.functional.mse_loss(run_ref(x), y).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return _params_and_diff(ours, ref)


def _train_side_by_side(rank: int, ours: tuple, ref: tuple, steps: int,
                        before_step=lambda step: None) -> None:
    """``steps`` steps of (model, optimizer) ``ours`` and ``ref`` on the same batches."""
    for step in range(steps):
        before_step(step)
        x, y = make_batch("mlp", step, 0, rank)
        for model, optimizer in (ours, ref):
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()


def _params_and_diff(ours, ref) -> dict:
    """Our parameters once landed, and their largest difference to torch DDP's."""
    ours.synchronize()
    return {"params": [p.detach().clone() for p in ours.module.parameters()],
            "diff_to_ddp": param_diff(ours, ref)}


def compiled_many(rank: int, world_size: int, cases: list[tuple]) -> dict:
    return {case: compiled_side_by_side(rank, world_size, *case) for case in cases}


def speculation_during_a_compile(rank: int, world_size: int, steps: int = 4) -> float:
    """two_stage's speculative AdamW steps run on the scheduler thread while the main
    thread compiles something else (a fresh module each step, right after backward;
    rank 1 late to its backward, so that rank 0's steps wait into that compile).
    Largest parameter difference to torch DDP (eager)."""
    torch.manual_seed(0)
    base = MLP()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ours = fgp.DistributedDataParallel(base, schedule="two_stage", bucket_cap_mb=0.0001,
                                       overlap_plan="layout")
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = make_batch("mlp", step, 0, rank)
        loss = nn.functional.mse_loss(ours(x), y)
        if rank == 1:
            time.sleep(0.3)  # rank 0's reduce-scatters, so its speculative steps, wait
        loss.backward()
        other = nn.Sequential(nn.Linear(13, 13), nn.Tanh(), nn.Linear(13, 3))
        torch.compile(other, backend=BACKEND)(x).sum().backward()  # a compile session
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    ours.synchronize()
    return max(float((a.detach() - b.detach()).abs().max())
               for a, b in zip(ours.module.parameters(), ref.module.parameters()))


class _CompileGate:
    """Events between a speculative step (scheduler thread) and the main thread's compile."""

    def __init__(self):
        self.step_began = threading.Event()
        self.session_began = threading.Event()
        self.step_ran = threading.Event()


_gate = None  # this rank's _CompileGate for the training step under way


class _AdamWThatLetsACompileIn(torch.optim.AdamW):
    """The first step of each training step taken off the main thread (a speculative
    step) lets a compile session of the main thread begin inside it: it waits up to
    ``GATE_WAIT_S`` for the session, steps, and returns once the session has ended,
    a session that begins and ends within one step."""

    GATE_WAIT_S = 1.0

    def step(self, closure=None):
        gate = _gate
        if (gate is None or gate.step_began.is_set()
                or threading.current_thread() is threading.main_thread()):
            return super().step(closure)
        gate.step_began.set()
        gate.session_began.wait(self.GATE_WAIT_S)
        try:
            return super().step(closure)
        finally:
            gate.step_ran.set()
            deadline = time.monotonic() + 10.0
            while torch.compiler.is_compiling() and time.monotonic() < deadline:
                time.sleep(0.001)


def a_compile_session_inside_a_speculative_step(rank: int, world_size: int,
                                                 steps: int = 3) -> float:
    """Each step, while the first speculative step runs on the scheduler thread, the
    main thread compiles a fresh module whose backend returns only once that step has
    stepped. Before, the speculative step checked for a session before and after
    stepping, so one that began and ended in between went unseen and torch's AdamW
    took its compile-time path (1.2e-7 off torch DDP). Largest difference to torch DDP."""
    global _gate
    torch.manual_seed(0)
    base = MLP()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ours = fgp.DistributedDataParallel(base, schedule="two_stage", bucket_cap_mb=0.0001,
                                       overlap_plan="layout")
    opt = fgp.ShardedOptimizer(ours, _AdamWThatLetsACompileIn, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    compiles = []

    def backend_that_waits_for_the_step(gm, example_inputs):
        compiles.append(1)
        _gate.session_began.set()
        _gate.step_ran.wait(10.0)
        return gm.forward

    try:
        for step in range(steps):
            _gate = _CompileGate()
            torch._dynamo.reset()  # else only step 0 compiles (the graph is cached)
            x, y = make_batch("mlp", step, 0, rank)
            nn.functional.mse_loss(ours(x), y).backward()
            assert _gate.step_began.wait(10.0), "no speculative step began"
            other = nn.Sequential(nn.Linear(13, 13), nn.Tanh(), nn.Linear(13, 3))
            torch.compile(other, backend=backend_that_waits_for_the_step)(x)
            nn.functional.mse_loss(ref(x), y).backward()
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
    finally:
        _gate = None
    ours.synchronize()
    assert len(compiles) == steps, compiles  # a compile session in every step
    return max(float((a.detach() - b.detach()).abs().max())
               for a, b in zip(ours.module.parameters(), ref.module.parameters()))


def compiled_training_step(rank: int, world_size: int, what: str, compiled: bool = True,
                           steps: int = 5) -> dict:
    """A whole training step under torch.compile (forward, backward, the optimizer's
    calls), two_stage, on torch.compile(wrapper), the ShardedOptimizer built on that:

    - "clip": max_grad_norm that clips every step (every speculative step undone);
    - "auto_plan": the default plan, whose profile ends with a broadcast from rank 0;
    - "scaler": float16 autocast and ShardedGradScaler (compared with eager only).

    Before, dynamo traced the optimizer's calls: "clip" kept the speculative steps
    (0.037 off), "auto_plan" raised on rank 1 only (rank 0 waited in the broadcast),
    "scaler" raised torch's "No inf checks were recorded", and the optimizer refused
    the compiled wrapper."""
    from .scenarios import reference_clip_
    torch.manual_seed(0)
    base = MLP()
    reference = copy.deepcopy(base)
    wrapper = fgp.DistributedDataParallel(
        base, schedule="two_stage", bucket_cap_mb=0.0001,
        overlap_plan="auto" if what == "auto_plan" else "layout")
    model = torch.compile(wrapper, backend="eager") if compiled else wrapper
    max_norm = 0.1 if what == "clip" else None
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9,
                               max_grad_norm=max_norm)
    scaler = fgp.ShardedGradScaler("cpu", init_scale=2.0 ** 8) if what == "scaler" else None
    ref = nn.parallel.DistributedDataParallel(reference)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    def train_step(x, y):
        with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
            loss = nn.functional.mse_loss(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()

    run_step = torch.compile(train_step, backend="eager") if compiled else train_step
    for step in range(steps):
        x, y = make_batch("mlp", step, 0, rank)
        run_step(x, y)
        nn.functional.mse_loss(ref(x), y).backward()
        if max_norm is not None:
            reference_clip_(ref.parameters(), max_norm)
        ref_opt.step()
        ref_opt.zero_grad()
    return {**_params_and_diff(wrapper, ref),
            "rollbacks": wrapper.scheduler.rollbacks, "commits": wrapper.scheduler.commits}


def compiled_training_steps(rank: int, world_size: int, cases: list[tuple]) -> dict:
    return {case: compiled_training_step(rank, world_size, *case) for case in cases}


def compiled_autograd_refused(rank: int, world_size: int) -> str:
    """Compiled autograd (a backward inside a compiled function with
    torch._dynamo.config.compiled_autograd on): our error on every rank, where
    torch's assertion about queue_callback() said nothing of the cause. Returns the
    message; compiled autograd is off again afterwards."""
    import torch._dynamo
    previous = torch._dynamo.config.compiled_autograd
    torch._dynamo.config.compiled_autograd = True  # read when torch.compile wraps
    try:
        torch.manual_seed(0)
        model = fgp.DistributedDataParallel(MLP())
        fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)

        @torch.compile(backend=BACKEND)
        def forward_backward(x):
            loss = model(x).square().mean()
            loss.backward()
            return loss

        forward_backward(make_batch("mlp", 0, 0, rank)[0])
        return "no error"
    except RuntimeError as error:
        return str(error)
    finally:
        torch._dynamo.config.compiled_autograd = previous


def compiled_step_leaves_our_hooks_untraced(rank: int, world_size: int, schedule: str) -> dict:
    """A whole training step under torch.compile: autograd calls our gradient-accumulator
    hooks, output hooks and end-of-backward callback from inside the compiled frame's
    graph break. Before, dynamo traced them (one recompile per parameter index up to
    config.recompile_limit, whose warning every rank logged, and UserWarnings about
    _thread.allocate_lock, our multi_tensor_pack and time.perf_counter)."""
    import io
    import logging
    import warnings
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Linear(16, 16) for _ in range(10)])  # > recompile_limit params
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    kw = {"overlap_plan": "layout"} if schedule == "two_stage" else {}
    model = fgp.DistributedDataParallel(base, bucket_cap_mb=0.0001, schedule=schedule, **kw)
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger("torch._dynamo").addHandler(handler)

    def step(x):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    compiled = torch.compile(step, backend=BACKEND)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(4):
                x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * i + rank))
                compiled(x)
                ref(x).square().mean().backward()
                ref_opt.step()
                ref_opt.zero_grad()
    finally:
        logging.getLogger("torch._dynamo").removeHandler(handler)
    return {"diff_to_ddp": _params_and_diff(model, ref)["diff_to_ddp"],
            "dynamo_warnings": sorted({str(w.message)[:120] for w in caught
                                       if "Dynamo" in str(w.message)}),
            "recompile_limit_hit": "recompile_limit" in log.getvalue()}


class _ReadsAnotherModulesWeightDetached(nn.Module):
    """``F.linear(h, other.weight.detach())``: saved for the gradient of ``h`` only,
    read by backward after ``other.weight``'s own gradient is complete."""

    def __init__(self, other: nn.Linear):
        super().__init__()
        self._other = [other]  # not a submodule: the weight is not in this subtree

    def forward(self, h):
        return nn.functional.linear(h, self._other[0].weight.detach())


class _NetWithADetachedReadCompiledApart(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(13, 32)
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh())
                                    for _ in range(3)])
        self.out = nn.Linear(32, 5)
        self.side = _ReadsAnotherModulesWeightDetached(self.out)

    def forward(self, x):
        h0 = torch.tanh(self.inp(x))
        return self.out(self.body(h0)) + 0.5 * torch.tanh(self.side(h0))


def detached_read_in_a_block_compiled_apart(rank: int, world_size: int,
                                            steps: int = 4) -> dict:
    """The block that takes a parameter's ``.detach()`` is compiled apart with
    ``fullgraph=True``: the recording forward still notices the read (the
    speculative steps then wait for backward's end, as in eager mode). Also how
    many graphs dynamo made."""
    graphs_before = _unique_graphs()
    torch.manual_seed(1234 + rank)
    base = _NetWithADetachedReadCompiledApart()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    base.side = torch.compile(base.side, backend=BACKEND, fullgraph=True)
    ours = fgp.DistributedDataParallel(base, bucket_cap_mb=0.0001, schedule="two_stage",
                                       overlap_plan="layout")
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _train_side_by_side(rank, (ours, opt), (ref, ref_opt), steps)
    ours.synchronize()
    return {"diff_to_ddp": param_diff(ours, ref),
            "noticed": ours.backward_may_read_detached_params,
            "commits": ours.scheduler.commits,
            "graphs": _unique_graphs() - graphs_before}


class _DetachesInEvals(nn.Module):
    """Takes its weight's ``.detach()`` in evaluation (no_grad) calls only."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, h):
        if not torch.is_grad_enabled():
            return torch.tanh(nn.functional.linear(h, self.lin.weight.detach()))
        return torch.tanh(self.lin(h))


def detach_in_compiled_evals_only(rank: int, world_size: int, compiled: bool,
                                  steps: int = 3) -> list[bool]:
    """A layer (compiled apart, or eager) takes a parameter's ``.detach()`` only in an
    eval through ``model.module`` between steps, outside the wrapper's forwards: per
    step, whether the wrapper then took the backward for one that may read detached
    parameters (the speculative steps would wait for its end from then on)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = _Layers()
    base.layers[1] = _DetachesInEvals()
    if compiled:
        base.layers[1] = torch.compile(base.layers[1], backend=BACKEND, fullgraph=True)
    ours = fgp.DistributedDataParallel(base, schedule="two_stage", bucket_cap_mb=0.0001,
                                       overlap_plan="layout")
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2)
    flags = []
    for step in range(steps):
        x, y = make_batch("mlp", step, 0, rank)
        nn.functional.mse_loss(ours(x), y).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            ours.module(x)
        flags.append(ours.backward_may_read_detached_params)
    return flags


def compiled_forwards_keep_their_signature(rank: int, world_size: int) -> dict:
    """A layer whose ``forward`` is compiled (``m.forward = torch.compile(m.forward)``),
    and one left eager by ``torch.compiler.disable(layer)``, after two steps."""
    from fgpsdp_runtime.forward_waits import _RecorderAround
    torch.manual_seed(0)
    base = _Layers()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    base.layers[0].forward = torch.compile(base.layers[0].forward, backend=BACKEND)
    base.layers[1] = torch.compiler.disable(base.layers[1])
    ours = fgp.DistributedDataParallel(base, schedule="next_forward", bucket_cap_mb=0.0001)
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2)
    _train_side_by_side(rank, (ours, opt), (ref, torch.optim.AdamW(ref.parameters(), lr=1e-2)),
                        2)
    return {"diff_to_ddp": param_diff(ours, ref),
            "signature": str(inspect.signature(base.layers[0].forward)),
            "disabled_one_wrapped": isinstance(vars(base.layers[1])["forward"], _RecorderAround)}


class _Layers(nn.Module):
    """Residual layers, each compiled apart in the scenario below; the root counts,
    after the first layer, the parameters of the others still being all-gathered."""

    def __init__(self, width: int = 16, depth: int = 4):
        super().__init__()
        self.inp = nn.Linear(13, width)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
            for _ in range(depth))
        self.out = nn.Linear(width, 5)
        self.watched: list = []  # parameters, held as a loop holds them
        self.in_flight_after_the_first_layer: list[int] = []

    def forward(self, x):
        from fgpsdp_runtime.held_param_reads import ParameterInFlight
        h = torch.tanh(self.inp(x))
        for i, layer in enumerate(self.layers):
            h = h + layer(h)
            if i == 0:  # (type() reads the class: it lands nothing)
                self.in_flight_after_the_first_layer.append(
                    sum(type(p) is ParameterInFlight for p in self.watched))
        return self.out(h)


def compiled_per_layer(rank: int, world_size: int, how: str, schedule: str,
                       steps: int = 4) -> dict:
    """Each layer compiled apart (fullgraph=True), ``how``: "in_place"
    (``layer.compile()`` before wrapping, as torchtune compiles each layer),
    "in_place_later" (after the first step), "apart" (``torch.compile(layer)``
    before wrapping, as torchtitan), "apart_warm" (so, and run once before
    wrapping), "apart_later" (set into the module so after the first step),
    "forward" (each layer's ``forward`` compiled), or "eager". Also how many
    parameters of the later layers were still in flight after the first layer, per
    forward, and how many graphs dynamo made."""
    torch._dynamo.reset()  # graphs of this case only (the cases share one process)
    graphs_before = _unique_graphs()
    torch.manual_seed(0)
    base = _Layers()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    base.watched = list(base.parameters())
    options = {"backend": BACKEND, "fullgraph": True}
    if how == "in_place":
        for layer in base.layers:
            layer.compile(**options)
    elif how in ("apart", "apart_warm"):
        for i, layer in enumerate(base.layers):
            base.layers[i] = torch.compile(layer, **options)
        if how == "apart_warm":
            x, y = make_batch("mlp", 0, 0, rank)
            nn.functional.mse_loss(base(x), y).backward()
            base.zero_grad(set_to_none=True)
    elif how == "forward":
        for layer in base.layers:
            layer.forward = torch.compile(layer.forward, **options)
    kw = {"overlap_plan": "layout"} if schedule == "two_stage" else {}
    ours = fgp.DistributedDataParallel(base, schedule=schedule, bucket_cap_mb=0.0001, **kw)
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def compile_later(step: int) -> None:
        if step == 1 and how == "in_place_later":
            for layer in ours.module.layers:
                layer.compile(**options)
        if step == 1 and how == "apart_later":
            for i, layer in enumerate(ours.module.layers):
                ours.module.layers[i] = torch.compile(layer, **options)

    _train_side_by_side(rank, (ours, opt), (ref, ref_opt), steps, before_step=compile_later)
    result = _params_and_diff(ours, ref)
    result["in_flight_after_the_first_layer"] = base.in_flight_after_the_first_layer
    waiter = ours._forward_waiter  # (none under serial)
    result["deviations"] = 0 if waiter is None else waiter.deviations
    result["graphs"] = _unique_graphs() - graphs_before
    return result


def compiled_per_layer_many(rank: int, world_size: int, cases: list[tuple]) -> dict:
    return {case: compiled_per_layer(rank, world_size, *case) for case in cases}


def graph_outside_torch_functions(gm, example_inputs):
    """A dynamo backend whose compiled code, as inductor's kernels, makes no torch
    calls a TorchFunctionMode sees (without inductor's C++ build)."""
    def run(*args):
        with torch._C.DisableTorchFunction():
            return gm(*args)
    return run


class _ReadsAnotherModulesWeight(nn.Module):
    def __init__(self, other: nn.Linear):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self._other = [other]  # not a submodule: its weight is outside this subtree

    def forward(self, h):
        return torch.tanh(self.a(h)) + nn.functional.linear(h, self._other[0].weight)


class _NetWithALayerReadingALaterOne(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(13, 16)
        post = nn.Linear(16, 16)
        self.layer = _ReadsAnotherModulesWeight(post)
        # Registered after the layer, as it runs: its all-gather goes after the layer's.
        self.post = post
        self.out = nn.Linear(16, 5)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = h + self.layer(h)
        return self.out(torch.tanh(self.post(h)))


def layer_compiled_apart_reading_outside_its_subtree(rank: int, world_size: int, how: str,
                                                     schedule: str, fullgraph: bool,
                                                     steps: int = 4) -> float:
    """The compiled layer reads the weight of a module that runs after it, its
    compiled code invisible to a mode (as inductor's), ``how``: "in_place" or
    "apart"; torch DDP's layer is compiled alike. The largest difference to it."""
    from .profile_window_scenarios import slow_all_gathers
    torch.manual_seed(0)
    base = _NetWithALayerReadingALaterOne()
    ref_base = copy.deepcopy(base)
    options = {"backend": graph_outside_torch_functions, "fullgraph": fullgraph}
    ref_base.layer.compile(**options)
    if how == "in_place":
        base.layer.compile(**options)
    else:
        base.layer = torch.compile(base.layer, **options)
    kw = {"overlap_plan": "layout"} if schedule == "two_stage" else {}
    ours = fgp.DistributedDataParallel(base, schedule=schedule, bucket_cap_mb=0.0001, **kw)
    ref = nn.parallel.DistributedDataParallel(ref_base)
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with slow_all_gathers(0.01):  # still in flight when the layer runs
        _train_side_by_side(rank, (ours, opt), (ref, ref_opt), steps)
        ours.synchronize()
    return param_diff(ours, ref)


def outside_reads_many(rank: int, world_size: int, cases: list[tuple]) -> dict:
    return {case: layer_compiled_apart_reading_outside_its_subtree(rank, world_size, *case)
            for case in cases}


def _apply(h, w):
    return torch.tanh(h @ w)


class _LoopOverAParameterList(nn.Module):
    """One compiled function called once per weight, with no module hook between
    the calls (the recording's marks must not change what dynamo guards on)."""

    def __init__(self, compiled, width: int = 16, depth: int = 12):
        super().__init__()
        self.inp = nn.Linear(13, width)
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(width, width) / width**0.5)
                                        for _ in range(depth))
        self.out = nn.Linear(width, 5)
        self._compiled = [compiled]

    def forward(self, x):
        h = self.inp(x)
        for w in self.weights:
            h = self._compiled[0](h, w)
        return self.out(h)


def compiled_function_called_in_a_loop(rank: int, world_size: int, steps: int = 4) -> dict:
    torch.manual_seed(0)
    compiled = torch.compile(_apply, backend=graph_outside_torch_functions, fullgraph=True)
    base = _LoopOverAParameterList(compiled)
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ours = fgp.DistributedDataParallel(base, schedule="next_forward", bucket_cap_mb=0.0001)
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    graphs_before = _unique_graphs()
    _train_side_by_side(rank, (ours, opt), (ref, ref_opt), steps)
    return {"diff_to_ddp": param_diff(ours, ref),
            "graphs": _unique_graphs() - graphs_before}


def detach_in_compiled_evals_many(rank: int, world_size: int) -> dict:
    return {"eager": detach_in_compiled_evals_only(rank, world_size, False),
            "compiled": detach_in_compiled_evals_only(rank, world_size, True)}
