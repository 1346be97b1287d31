"""A wrapper's life: dropped and rebuilt on the same module, freed with its
threads and groups, and a backward that raises. Imported by the spawned ranks.
"""
from __future__ import annotations

import copy
import gc
import os
import threading
import time
import warnings
import weakref
from typing import Any, Optional

import torch
from torch import nn

import fgpsdp_runtime as fgp

from .dist_harness import destroys_its_group
from .scenarios import MLP, loss_fn, make_batch, wrapped_for

# The class of a module's parameter table as torch makes it (dict; OrderedDict on
# torch 2.4): what the wrapper leaves there when it goes.
_PLAIN_TABLE = type(vars(nn.Module())["_parameters"])


def _train(model, opt, rank: int, steps: range) -> None:
    for step in steps:
        x, y = make_batch("mlp", step, 0, rank)
        loss_fn("mlp", model(x), y).backward()
        opt.step()
        opt.zero_grad()


def wrap_again(rank: int, world_size: int, schedule: str) -> dict[str, Any]:
    """Wrap, train, drop the wrapper (no gc.collect()), wrap the same module
    again and train on; torch DDP does the same on a copy. The first parameter is
    frozen in the first wrapping and unfrozen for the second: how a parameter
    frozen at wrapping starts training (docs/semantics.md's way to unfreeze)."""
    torch.manual_seed(0)
    module = MLP()
    ref_module = copy.deepcopy(module)
    frozen, ref_frozen = next(module.parameters()), next(ref_module.parameters())
    moved, frozen_moved = [], []
    for phase in range(2):
        for p in (frozen, ref_frozen):
            p.requires_grad_(phase == 1)
        before = [p.detach().clone() for p in module.parameters()]
        model = fgp.DistributedDataParallel(module, schedule=schedule, bucket_cap_mb=0.002)
        opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
        ref = nn.parallel.DistributedDataParallel(ref_module)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        _train(model, opt, rank, range(3 * phase, 3 * phase + 3))
        _train(ref, ref_opt, rank, range(3 * phase, 3 * phase + 3))
        model.synchronize()
        changes = [float((a - b).abs().max()) for a, b in zip(before, module.parameters())]
        moved.append(max(changes))
        frozen_moved.append(changes[0])
        del model, opt, ref, ref_opt
    diff = max(float((a - b).abs().max())
               for a, b in zip(module.parameters(), ref_module.parameters()))
    return {"moved": moved, "frozen_moved": frozen_moved, "diff_to_ddp": diff}


def _resources() -> tuple[int, int]:
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def dropped_wrapper_is_freed(rank: int, world_size: int, schedule: str) -> dict[str, Any]:
    """Build, train and drop a wrapper three times: it is freed as it is dropped,
    with its threads, file descriptors and groups (the module lives on)."""
    module = MLP()
    counts, freed = [], []
    for _ in range(3):
        model = fgp.DistributedDataParallel(module, schedule=schedule, bucket_cap_mb=0.002)
        opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
        _train(model, opt, rank, range(2))
        ref = weakref.ref(model)
        # Freed when the loop drops it, as torch DDP is, not at the garbage
        # collector's next full pass (till then its hooks took the module's gradients).
        gc.disable()
        try:
            del model, opt
            freed.append(ref() is None)
        finally:
            gc.enable()
        gc.collect()
        counts.append(_resources())
    # The dropped wrappers' hooks are gone from the module (their assign=True
    # refusal with them).
    hooks = sum(len(m._state_dict_pre_hooks) + len(m._load_state_dict_pre_hooks)
                + len(m._forward_pre_hooks) for m in module.modules())
    hooks += sum(len(p._post_accumulate_grad_hooks or {}) for p in module.parameters())
    # No hook of theirs takes a plain backward's gradients (they hook the gradient
    # accumulator nodes, which went with them).
    x, y = make_batch("mlp", 0, 0, rank)
    loss_fn("mlp", module(x), y).backward()
    hooks += sum(p.grad is None for p in module.parameters())
    module.zero_grad(set_to_none=True)
    # The copy, read and zero_grad guards (instance attributes).
    hooks += sum(name in vars(m) for m in module.modules()
                 for name in ("__getstate__", "named_parameters", "zero_grad"))
    # The parameter tables that land attribute reads: plain ones again.
    hooks += sum(type(vars(m)["_parameters"]) is not _PLAIN_TABLE for m in module.modules())
    module.load_state_dict(copy.deepcopy(module.state_dict()), assign=True)
    return {"freed": freed, "counts": counts, "python_threads": threading.active_count(),
            "hooks_left": hooks}


def shared_frozen_submodule_tables(rank: int, world_size: int) -> list[str]:
    """Two live wrappers share a frozen feature extractor; the first is dropped
    first. The extractor's ``_parameters`` table, after each drop: the second
    wrapper's, then the extractor's own. Before, the first wrapper's table (of a
    wrapper gone) came back for good, and until then it kept the first wrapper's
    module alive. Also: a shallow copy taken while wrapped
    shares the extractor's own table once both are dropped, as without them."""
    shared = nn.Linear(4, 4).requires_grad_(False)
    own = vars(shared)["_parameters"]
    first = fgp.DistributedDataParallel(nn.Sequential(shared, nn.Linear(4, 2)),
                                        schedule="next_forward")
    second = fgp.DistributedDataParallel(nn.Sequential(shared, nn.Linear(4, 2)),
                                         schedule="next_forward")
    shallow = copy.copy(shared)
    first_module = weakref.ref(first.module)
    seen = []
    del first
    gc.collect()
    seen.append("second's" if vars(shared)["_parameters"] is vars(second.module[0])[
        "_parameters"] and type(vars(shared)["_parameters"]) is not _PLAIN_TABLE else "other")
    # (Its table, under the second's, held its waiter, which holds its module.)
    seen.append("first freed" if first_module() is None else "first's module alive")
    del second
    gc.collect()
    table = vars(shared)["_parameters"]
    seen.append("own" if table is own and type(table) is _PLAIN_TABLE else type(table).__name__)
    seen.append("shared" if vars(shallow)["_parameters"] is table else "apart")
    return seen


def stand_in_freed(rank: int, world_size: int, schedule: str) -> dict[str, Any]:
    """Train, then make and drop a stand-in of the wrapper as torch.compile's
    ``nn_module_proxy`` makes one at a graph break (a new object of the class
    sharing the wrapper's ``__dict__``), and train on; torch DDP does the same
    steps. The stand-in's finalizer must leave the live wrapper's hooks, threads
    and groups alone (before, on torch 2.4 under torch.compile, it removed them
    and the next step waited forever)."""
    from torch._dynamo.utils import nn_module_proxy

    results = {}
    for system in ("fgpsdp", "ddp"):
        torch.manual_seed(0)
        net = MLP()
        model, opt = wrapped_for(net, system == "ddp", torch.optim.AdamW, 1e-2,
                                 schedule=schedule, bucket_cap_mb=0.002)
        _train(model, opt, rank, range(2))
        stand_in = nn_module_proxy(model)
        assert stand_in is not model and vars(stand_in) is vars(model)
        del stand_in
        gc.collect()
        _train(model, opt, rank, range(2, 4))
        if system == "fgpsdp":
            model.synchronize()
            alive = model.scheduler is None or model.scheduler.is_alive()
        results[system] = [p.detach().clone() for p in net.parameters()]
    diff = max(float((a - b).abs().max())
               for a, b in zip(results["fgpsdp"], results["ddp"]))
    return {"diff_to_ddp": diff, "scheduler_alive": alive}


def step_after_scheduler_stopped(rank: int, world_size: int) -> str:
    """The scheduler thread stopped (as the exit hook stops it), then a step:
    the hand-over raises on every rank (before, the step waited forever for a
    thread that was gone)."""
    from fgpsdp_runtime import shutdown

    model = fgp.DistributedDataParallel(MLP(), bucket_cap_mb=0.002, overlap_plan="layout")
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    _train(model, opt, rank, range(2))
    shutdown.stop_and_join([model.scheduler])
    try:
        _train(model, opt, rank, range(2, 3))
    except RuntimeError as error:
        return str(error)
    return "no error"


class _Boom(Exception):
    pass


class _RaiseInBackward(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _RaiseInBackward.armed:
            raise _Boom("raised in backward")
        return grad


class _NetRaisingInBackward(nn.Module):
    """The backward raises between its last and first layers when armed: the
    last layers' gradients are reduced or held, the first's never come."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(13, 37), nn.Linear(37, 29), nn.Linear(29, 5)

    def forward(self, x):
        h = _RaiseInBackward.apply(torch.tanh(self.a(x)))
        return self.c(torch.tanh(self.b(h)))


def backward_raises(rank: int, world_size: int, schedule: str, zero_grad: bool) -> dict[str, Any]:
    """The backward of step 2 raises on every rank and the loop catches it (with
    ``zero_grad``: then zeroes, as a loop that skips the batch does). torch DDP
    cannot go on after that (it raises at the next forward); compared with
    torch DDP skipping that batch."""
    results, caught = {}, []
    for system in ("fgpsdp", "ddp_skipping"):
        torch.manual_seed(0)
        net = _NetRaisingInBackward()
        model, opt = wrapped_for(net, system != "fgpsdp", torch.optim.AdamW, 1e-2,
                                 schedule=schedule, bucket_cap_mb=0.002)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for step in range(5):
                x, y = make_batch("mlp", step, 0, rank)
                if step == 2:
                    if system == "ddp_skipping":
                        continue
                    _RaiseInBackward.armed = True
                    try:
                        loss_fn("mlp", model(x), y).backward()
                    except _Boom:
                        caught.append(step)
                    finally:
                        _RaiseInBackward.armed = False
                    if zero_grad:
                        opt.zero_grad()
                    continue
                loss_fn("mlp", model(x), y).backward()
                opt.step()
                opt.zero_grad()
        if system == "fgpsdp":
            model.synchronize()
            results["warnings"] = sorted({str(w.message)[:60] for w in seen
                                          if "did not finish" in str(w.message)})
        results[system] = [p.detach().clone() for p in net.parameters()]
    diff = max(float((a - b).abs().max())
               for a, b in zip(results["fgpsdp"], results["ddp_skipping"]))
    return {"diff_to_ddp_skipping": diff, "caught": caught, "warnings": results["warnings"]}


def own_group_timeouts(rank: int, world_size: int) -> list[float]:
    """Seconds the wrapper's own process groups wait for a stalled peer."""
    model = fgp.DistributedDataParallel(MLP())
    return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for g in model._own_groups]


_KEPT_ALIVE: list = []


def _early_bound_destroy():
    """torch's destroy_process_group, as a script bound it before any wrapper put one
    in front of it (``from torch.distributed import destroy_process_group``)."""
    c10d = torch.distributed.distributed_c10d
    return getattr(c10d.destroy_process_group, "_fgpsdp_torch_destroy",
                   c10d.destroy_process_group)


def _three_steps_ending_in_flight(rank: int, schedule: str):
    """(module, ours, theirs): three steps of an MLP under ``schedule`` beside torch
    DDP, ours last, so that the last step's all-gathers are still in flight."""
    torch.manual_seed(0)
    module = MLP()
    reference = copy.deepcopy(module)
    plan = {"overlap_plan": "layout"} if schedule == "two_stage" else {}
    ours = wrapped_for(module, False, torch.optim.Adam, 1e-2, schedule=schedule,
                       bucket_cap_mb=0.0005, **plan)
    theirs = wrapped_for(reference, True, torch.optim.Adam, 1e-2)
    for step in range(3):
        for model, opt in (theirs, ours):
            if step:
                opt.zero_grad()
            x, y = make_batch("mlp", step, 0, rank)
            loss_fn("mlp", model(x), y).backward()
            opt.step()
    return module, ours, theirs


@destroys_its_group
def save_after_a_peer_destroyed_the_group(rank: int, world_size: int, schedule: str,
                                          bound_before_import: bool) -> Optional[float]:
    """A job's last lines, ``if rank == 0: torch.save(model.module.state_dict())`` and
    ``dist.destroy_process_group()``, where rank 1 destroys the group first (the
    harness does, as soon as this returns) while its last step's all-gathers are in
    flight, and rank 0 reads the parameters a moment later. With
    ``bound_before_import``, rank 1 calls the function as a script that ran ``from
    torch.distributed import destroy_process_group`` before building the wrapper
    holds it (nanoGPT's train.py does). Returns rank 0's largest difference to
    torch DDP's parameters (None on rank 1)."""
    destroy_bound_early = _early_bound_destroy()
    module, ours, theirs = _three_steps_ending_in_flight(rank, schedule)
    # Alive past the harness's destroy_process_group(), as a script's model is
    # (freed, a wrapper lets its collectives run first: see ddp.__del__).
    _KEPT_ALIVE.append(ours)
    if rank != 0:
        if bound_before_import:
            destroy_bound_early()
        return None
    time.sleep(0.5)
    saved = ours[0].module.state_dict()
    return max(float((saved[k] - v).abs().max())
               for k, v in theirs[0].module.state_dict().items())


@destroys_its_group
def read_after_an_early_bound_destroy_and_a_dropped_wrapper(rank: int, world_size: int,
                                                            schedule: str) -> float:
    """Every rank calls ``destroy_process_group`` as bound before the wrapper existed
    (``from torch.distributed import ...`` at the top of a script) right after its
    last step, drops the wrapper and its optimizer, and reads the module (to save
    it, or to wrap it again after a new ``init_process_group``). Before, the destroy
    cut the last step's all-gathers, the freed wrapper could not finish them, and
    the module held the step before on some elements, differently on each rank,
    without a word. Returns the largest difference to torch DDP's parameters."""
    destroy_bound_early = _early_bound_destroy()
    module, ours, theirs = _three_steps_ending_in_flight(rank, schedule)
    expected = copy.deepcopy(theirs[0].module.state_dict())
    del theirs
    destroy_bound_early()
    del ours
    gc.collect()
    saved = module.state_dict()
    return max(float((saved[k] - v).abs().max()) for k, v in expected.items())


def freed_before_the_last_gathers_landed(rank: int, world_size: int, how: str) -> list[str]:
    """The wrapper is dropped right after its last step, and the module outlives it.
    ``how``: "landed" (the all-gathers ran: nothing to say), "failed" (every rank's
    last all-gathers fail, as where a peer is gone; injected before any byte moves,
    so that no rank waits), "never started" (a plan with a lookahead of one keeps
    the rest queued) or "speculated" (dropped between backward and step, stage 1's
    speculative steps in the module). Returns the warnings the drop gave."""
    from concurrent.futures import Future

    from fgpsdp_runtime.link_worker import PendingOp
    from fgpsdp_runtime.plan import OverlapPlan

    torch.manual_seed(0)
    module = MLP()
    model, opt = wrapped_for(module, False, torch.optim.Adam, 1e-2, schedule="two_stage",
                             overlap_plan="layout", bucket_cap_mb=0.0005)
    if how == "never started":
        model.set_overlap_plan(OverlapPlan(stage1=(), stage2=model.forward_bucket_order,
                                           lookahead=1, source="test"))
    for step in range(3):
        opt.zero_grad()
        x, y = make_batch("mlp", step, 0, rank)
        loss_fn("mlp", model(x), y).backward()
        if how == "failed" and step == 2:
            def fail(*args, **kwargs):
                future: Future = Future()
                future.set_exception(RuntimeError("injected: a peer is gone"))
                return PendingOp(future)
            model._exchange.start_all_gather = fail
        if how == "speculated" and step == 2:
            # An error in the loop's code a moment later: the thread has stepped
            # stage 1 by then (dropped at once, it finds the optimizer gone first).
            assert model.scheduler.holds_speculative_values_once_settled()
            break
        opt.step()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        del model, opt
        gc.collect()
    return [str(w.message) for w in seen]


@destroys_its_group
def teardown_waits_for_the_threads_once(rank: int, world_size: int, schedule: str) -> int:
    """``dist.destroy_process_group()`` right after the last step, then the wrapper
    dropped: how many times the wrapper waited for its threads. Before, the destroy
    reached the wrapper once, then once per group it shuts down, and the drop once
    more, each wait up to 5 s where a thread is stuck (a peer gone)."""
    from fgpsdp_runtime import shutdown

    waits = []
    stop_and_join = shutdown.stop_and_join

    def counted(owners, *args, **kwargs):
        waits.append(1)
        return stop_and_join(owners, *args, **kwargs)

    torch.manual_seed(0)
    plan = {"overlap_plan": "layout"} if schedule == "two_stage" else {}
    model, opt = wrapped_for(MLP(), False, torch.optim.Adam, 1e-2, schedule=schedule,
                             bucket_cap_mb=0.0005, **plan)
    for step in range(2):
        opt.zero_grad()
        x, y = make_batch("mlp", step, 0, rank)
        loss_fn("mlp", model(x), y).backward()
        opt.step()
    shutdown.stop_and_join = counted
    try:
        torch.distributed.destroy_process_group()
        del model, opt
        gc.collect()
    finally:
        shutdown.stop_and_join = stop_and_join
    return len(waits)


def survivor_saves_after_a_peer_failed(rank: int, world_size: int, first_read: str,
                                       slow_thread: bool) -> tuple[str, float]:
    """Rank 1 raises in its forward of step 3 (a data error) and leaves; rank 0's step
    then fails on the exchange, and its handler reads what torch DDP's survivor can:
    ``first_read`` ("module state_dict", "optimizer state_dict" or "direct call",
    ``model.module(x)``), then saves ``model.module.state_dict()``. Under two_stage
    with a stage 1 these raised "would ... two_stage's speculative updates" although
    none had run, where the scheduler thread had not yet failed (``slow_thread``
    makes it take 0.3 s to each bucket on rank 0: then always). Returns rank 0's
    error type and the largest difference of what it saved to torch DDP's
    parameters after step 2."""
    torch.manual_seed(0)
    module = MLP()
    reference = copy.deepcopy(module)
    ours = wrapped_for(module, False, torch.optim.Adam, 1e-2, schedule="two_stage",
                       overlap_plan="layout", bucket_cap_mb=0.0005)
    theirs = wrapped_for(reference, True, torch.optim.Adam, 1e-2)
    for step in range(3):
        for model, opt in (theirs, ours):
            opt.zero_grad()
            x, y = make_batch("mlp", step, 0, rank)
            loss_fn("mlp", model(x), y).backward()
            opt.step()
    model, opt = ours
    opt.zero_grad()
    x, y = make_batch("mlp", 3, 0, rank)
    if rank == 1:
        raise _Boom("a data error on rank 1")
    if slow_thread:
        speculate = model.scheduler._speculate

        def slowly(*args):
            time.sleep(0.3)
            return speculate(*args)
        model.scheduler._speculate = slowly
    try:
        loss_fn("mlp", model(x), y).backward()
        opt.step()
        failed = "nothing"
    except Exception as error:  # noqa: BLE001 - the exchange's, whatever the transport
        failed = type(error).__name__
    reads = {"module state_dict": lambda: model.module.state_dict(),
             "optimizer state_dict": lambda: opt.state_dict(),
             "direct call": lambda: model.module(x)}
    reads[first_read]()
    saved = model.module.state_dict()
    return failed, max(float((saved[k] - v).abs().max())
                       for k, v in theirs[0].module.state_dict().items())
