"""Uneven inputs: fgpsdp's model.join() beside torch DDP's, on the same data.

Each rank trains on its own number of batches; the ranks that run out first
join. Imported by the spawned ranks (module-level functions only).
"""
from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any

import torch
from torch import nn

import fgpsdp_runtime as fgp
from .scenarios import (MODELS, loss_fn, make_batch, make_groups, optimizer_class_and_defaults,
                       reference_clip_, wrapped_for)


def _loop(model, opt, sched, cfg: dict, rank: int, clip) -> list[float]:
    """The training loop both systems run: ``cfg["batches"][rank]`` steps."""
    model_name = cfg.get("model", "mlp")
    micro = cfg.get("accumulate", 1)
    losses = []
    for step in range(cfg["batches"][rank]):
        if cfg.get("eval_every_step"):  # an evaluation forward between steps
            model.eval()
            with torch.no_grad():
                model(make_batch(model_name, 99, 0, rank)[0])
            model.train()
        for m in range(micro):
            x, y = make_batch(model_name, step, m, rank)
            ctx = model.no_sync() if m < micro - 1 else contextlib.nullcontext()
            with ctx:
                loss = loss_fn(model_name, model(x), y) / micro
                loss.backward()
        clip()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
        losses.append(float(loss.detach()))
    return losses


def train_uneven(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Train fgpsdp under join(), then torch DDP under join(); return their differences."""
    model_name = cfg.get("model", "mlp")
    optimizer = cfg.get("optimizer", "adamw_groups")
    join_kw = cfg.get("join", {})
    torch.manual_seed(1234 + rank)  # the broadcast at construction fixes it
    base = MODELS[model_name]()
    ref_module = copy.deepcopy(base)
    kw = {k: cfg[k] for k in ("schedule", "overlap_plan", "bucket_cap_mb") if k in cfg}
    if "local_size" in cfg:
        kw["topology"] = fgp.Topology(local_size=cfg["local_size"])
    ours = fgp.DistributedDataParallel(base, **kw)
    ref = nn.parallel.DistributedDataParallel(ref_module)
    cls, defaults = optimizer_class_and_defaults(optimizer)
    named = [(n, p) for n, p in ours.module.named_parameters() if p.requires_grad]
    ref_named = [(n, p) for n, p in ref.module.named_parameters() if p.requires_grad]
    opt = fgp.ShardedOptimizer(ours, cls, param_groups=make_groups(named, optimizer),
                               max_grad_norm=cfg.get("max_grad_norm"), **defaults)
    ref_opt = cls(make_groups(ref_named, optimizer), **defaults)
    sched = ref_sched = None
    if cfg.get("lr_scheduler"):
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)

    manual = cfg.get("manual_clip")
    max_norm = cfg.get("max_grad_norm")
    norms: list[float] = []

    def ours_clip():
        if cfg.get("clip_value"):
            opt.clip_grad_value_(cfg["clip_value"])
        if manual:
            norms.append(float(opt.clip_grad_norm_(manual)))

    def ref_clip():
        if cfg.get("clip_value"):
            torch.nn.utils.clip_grad_value_(ref.parameters(), cfg["clip_value"])
        for limit in (max_norm, manual):
            if limit is not None:
                reference_clip_(ref.parameters(), limit)

    with ours.join(**join_kw):
        losses = _loop(ours, opt, sched, cfg, rank, ours_clip)
    commits_in_join = ours.scheduler.commits if ours.scheduler else 0
    ref_losses = []
    if not cfg.get("skip_reference"):
        with ref.join(**join_kw):
            ref_losses = _loop(ref, ref_opt, ref_sched, cfg, rank, ref_clip)
    if cfg.get("then_even_steps"):  # training goes on after the join, every rank alike
        even = dict(cfg, batches=[cfg["then_even_steps"]] * world_size)
        _loop(ours, opt, sched, even, rank, ours_clip)
        if not cfg.get("skip_reference"):
            _loop(ref, ref_opt, ref_sched, even, rank, ref_clip)
    ours.synchronize()
    param_diff = max(float((a.detach() - b.detach()).abs().max())
                     for a, b in zip(ours.module.parameters(), ref.module.parameters()))
    buffer_diff = max([float((a.double() - b.double()).abs().max())
                       for a, b in zip(ours.module.buffers(), ref.module.buffers())] or [0.0])
    return {"param_diff": param_diff, "buffer_diff": buffer_diff, "losses": losses,
            "ref_losses": ref_losses, "lrs": [g["lr"] for g in opt.param_groups],
            "params": [p.detach().clone() for p in ours.module.parameters()],
            "own_lrs": sched.get_last_lr() if sched is not None else None,
            "speculating_stopped": ours.scheduler.stopped_because if ours.scheduler else None,
            "commits": ours.scheduler.commits if ours.scheduler else 0,
            "commits_in_join": commits_in_join,
            "stage1_buckets": len(ours.plan.stage1) if ours.plan else 0}


# Cases by name (call_many's calls must be hashable). "batches": per rank.
CASES = {
    **{f"2r-{s}": {"schedule": s, "batches": [3, 5], "max_grad_norm": 1.0, "lr_scheduler": True}
       for s in ("serial", "overlap_backward", "next_forward", "two_stage")},
    # The same with no_sync() accumulation and BatchNorm (running statistics updated).
    **{f"2r-{s}-accumulate-bn": {"schedule": s, "batches": [3, 5], "accumulate": 2,
                                 "model": "bn_frozen", "max_grad_norm": 1.0,
                                 "lr_scheduler": True}
       for s in ("serial", "overlap_backward", "next_forward", "two_stage")},
    # The layout plan speculates from the first step, before any rank has joined.
    "2r-layout-plan-rank1-first": {"schedule": "two_stage", "overlap_plan": "layout",
                                   "bucket_cap_mb": 0.002, "batches": [5, 2],
                                   "optimizer": "sgd_momentum"},
    "2r-speculation-resumes": {"schedule": "two_stage", "overlap_plan": "layout",
                               "bucket_cap_mb": 0.002, "batches": [5, 2], "then_even_steps": 3,
                               "optimizer": "sgd_momentum", "skip_reference": True},
    # clip_grad_value_ on the active rank: the joined one clamps its slices too.
    "2r-clip-value": {"schedule": "two_stage", "overlap_plan": "layout", "bucket_cap_mb": 0.002,
                      "batches": [3, 5], "clip_value": 0.02, "optimizer": "sgd_momentum"},
    "2r-average-over-active": {"batches": [4, 2], "optimizer": "sgd_momentum",
                               "join": {"divide_by_initial_world_size": False}},
    "2r-disabled-even": {"batches": [3, 3], "model": "bn_frozen", "join": {"enable": False}},
    # Even inputs, then training goes on outside the context.
    "2r-even-then-on": {"batches": [4, 4], "model": "bn_frozen", "then_even_steps": 2},
    # Evaluation forwards under no_grad (torch DDP's join cannot shadow them).
    "2r-eval-forwards": {"batches": [2, 4], "model": "bn_frozen", "eval_every_step": True,
                         "skip_reference": True},
    "2r-no-eval-forwards": {"batches": [2, 4], "model": "bn_frozen", "skip_reference": True},
    "3r-accumulate-clip": {"batches": [2, 4, 5], "accumulate": 2, "manual_clip": 0.5,
                           "model": "bn_frozen"},
    "3r-next-forward": {"schedule": "next_forward", "batches": [5, 2, 4], "max_grad_norm": 1.0},
    # After the join the ranks train on; torch DDP's joined ranks' optimizer
    # state went stale, ours did not: checked for agreement across ranks only.
    "3r-uneven-then-on": {"batches": [5, 2, 4], "then_even_steps": 2, "skip_reference": True},
    "4r-2x2": {"batches": [2, 3, 1, 2], "local_size": 2, "max_grad_norm": 1.0},
}


def train_case(rank: int, world_size: int, name: str) -> dict[str, Any]:
    return train_uneven(rank, world_size, CASES[name])


def join_then_save(rank: int, world_size: int, schedule: str,
                   rank0_only: bool = False, early: tuple[int, ...] = (0,)) -> dict[str, Any]:
    """The ranks in ``early`` run out first; the others save a full optimizer
    checkpoint and the model (synchronize between backward and step) while those
    are joined. With ``rank0_only`` they also save the whole dict, for comparison."""
    torch.manual_seed(5)
    ours = fgp.DistributedDataParallel(MODELS["mlp"](), schedule=schedule,
                                       overlap_plan="layout")
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2)
    saved = whole = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ours.join():
            for step in range(2 if rank in early else 4):
                x, y = make_batch("mlp", step, 0, rank)
                loss_fn("mlp", ours(x), y).backward()
                ours.synchronize()  # between backward and step: undoes speculative steps
                opt.step()
                opt.zero_grad()
                if step == 3:
                    saved = opt.full_state_dict(rank0_only=rank0_only)
                    if rank0_only:
                        whole = opt.full_state_dict()
    ours.synchronize()
    return {"saved_steps": None if not saved else
            sorted({int(s["step"]) for s in saved["state"].values()}),
            "kept_the_whole": bool(saved) and whole is not None and _same_state(saved, whole),
            "warnings": [str(w.message) for w in caught if "fgpsdp" in str(w.message)],
            "params": torch.cat([p.detach().reshape(-1) for p in ours.module.parameters()])}


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
               for x, y in zip(a["state"].values(), b["state"].values()))


def _error_of(fn, *args) -> dict[str, str]:
    try:
        fn(*args)
    except Exception as error:  # noqa: BLE001 - the test checks its type and message
        return {"type": type(error).__name__, "message": str(error)}
    return {"type": None, "message": ""}


def join_with_grad_scaler(rank: int, world_size: int) -> dict[str, str]:
    """ShardedGradScaler inside join(): refused on every rank, no hang."""
    return _error_of(_join_with_grad_scaler, rank)


def _join_with_grad_scaler(rank: int) -> None:
    ours = fgp.DistributedDataParallel(MODELS["mlp"]())
    opt = fgp.ShardedOptimizer(ours, torch.optim.SGD, lr=0.1)
    scaler = fgp.ShardedGradScaler("cpu")
    with ours.join():
        for step in range(1 if rank == 0 else 3):
            x, y = make_batch("mlp", step, 0, rank)
            scaler.scale(loss_fn("mlp", ours(x), y)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()


def refusal_caught_under_join(rank: int, world_size: int, what: str) -> dict[str, Any]:
    """Rank 0 joins after one step; rank 1's loop calls, at its third step, what
    refuses before announcing itself, catches the error and goes on (a loop written
    for any optimizer). Returns the error caught, if any, and the parameters."""
    try:
        return _refusal_caught_under_join(rank, what)
    except Exception as error:  # noqa: BLE001 - the test checks there is none
        return {"error": f"{type(error).__name__}: {error}"}


def _refusal_caught_under_join(rank: int, what: str) -> dict[str, Any]:
    ours = fgp.DistributedDataParallel(MODELS["mlp"]())
    opt = fgp.ShardedOptimizer(ours, torch.optim.SGD, lr=0.1)
    caught = None
    with ours.join():
        for step in range(1 if rank == 0 else 4):
            x, y = make_batch("mlp", step, 0, rank)
            loss_fn("mlp", ours(x), y).backward()
            if step == 2:
                try:
                    if what == "norm_type":
                        opt.clip_grad_norm_(1.0, norm_type=1.0)  # only the L2 norm
                    else:
                        opt.train()  # SGD has no train() (schedule-free's)
                except (ValueError, AttributeError) as error:
                    caught = type(error).__name__
            opt.step()
            opt.zero_grad()
    ours.synchronize()
    return {"error": None, "caught": caught,
            "params": torch.cat([p.detach().reshape(-1) for p in ours.module.parameters()])}


def train_case_throwing(rank: int, world_size: int) -> dict[str, str]:
    """join(throw_on_early_termination=True): rank 0 runs out first."""
    return _error_of(_train_throwing, rank)


def _train_throwing(rank: int) -> None:
    ours = fgp.DistributedDataParallel(MODELS["mlp"]())
    opt = fgp.ShardedOptimizer(ours, torch.optim.SGD, lr=0.1)
    with ours.join(throw_on_early_termination=True):
        _loop(ours, opt, None, {"batches": [1, 3]}, rank, lambda: None)


def backward_skipped_on_rank1(rank: int, world_size: int, steps: tuple, use_join: bool) -> list:
    """Rank 1's backward reaches no parameter on even steps (it skips it): its step
    launches that round, which it announces before the step, as rank 0's backward
    announced its own."""
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(MODELS["mlp"](), bucket_cap_mb=0.0001)
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2, max_grad_norm=1.0)
    with model.join(enable=use_join):
        for step in range(steps[rank]):
            x, y = make_batch("mlp", step, 0, rank)
            loss = loss_fn("mlp", model(x), y)
            if not (rank == 1 and step % 2 == 0):
                loss.backward()
            if step == 1:
                opt.clip_grad_norm_(0.5)
            opt.step()
            opt.zero_grad()
    model.synchronize()
    return [p.detach().clone() for p in model.module.parameters()]


def _plain_step(model, opt, step: int, rank: int) -> None:
    """One step of the MLP on this rank's batch of ``step``."""
    x, y = make_batch("mlp", step, 0, rank)
    loss_fn("mlp", model(x), y).backward()
    opt.step()
    opt.zero_grad()


def load_while_joined(rank: int, world_size: int, what: str, load_at: int) -> dict[str, str]:
    """Rank 0 runs one step, the others three; at step ``load_at`` the active ranks
    rewind to a checkpoint of step 0 (``what="plan"``: set the plan they run again,
    under two_stage). Before, a model or full optimizer load missed the joined rank's
    slices (1e-2 off torch DDP, silently) and a shard reload aborted gloo."""
    return _error_of(_load_while_joined, rank, what, load_at)


def _load_while_joined(rank: int, what: str, load_at: int) -> None:
    torch.manual_seed(5)
    ours = fgp.DistributedDataParallel(MODELS["mlp"](),
                                       schedule="two_stage" if what == "plan" else "serial")
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-2)
    saved = None
    with ours.join():
        for step in range(1 if rank == 0 else 3):
            _plain_step(ours, opt, step, rank)
            if step == 0:
                saved = {"model": ours.module.state_dict(), "full": opt.full_state_dict(),
                         "shard": opt.state_dict()}
            if step == load_at:
                if what == "plan":
                    ours.set_overlap_plan(ours.plan)
                elif what == "model":
                    ours.module.load_state_dict(saved["model"])
                else:
                    opt.load_state_dict(saved[what])


def join_of_two_wrappers(rank: int, world_size: int, how: str) -> dict[str, str]:
    """torch's generic Join([model, opt]), or one wrapper's join() inside another's (a
    GAN's two models): before, an AttributeError, or a hang until the timeout."""
    def run() -> None:
        from torch.distributed.algorithms import Join
        first = fgp.DistributedDataParallel(MODELS["mlp"]())
        second = fgp.DistributedDataParallel(MODELS["mlp"]())
        if how == "generic":
            with Join([first, fgp.ShardedOptimizer(first, torch.optim.SGD, lr=0.1)]):
                pass
        else:
            with first.join(), second.join():
                pass
    return _error_of(run)


def tensor_lr_through_join(rank: int, world_size: int) -> dict[str, Any]:
    """A tensor learning rate the loop fills (``lr=torch.tensor(...)``), rank 0 out
    first: an active rank other than the one hyperparameters come from had its group's
    tensor replaced by a copy, and stepped with a stale rate after the join."""
    torch.manual_seed(5)
    lr = torch.tensor(0.05)
    ours = fgp.DistributedDataParallel(MODELS["mlp"]())
    opt = fgp.ShardedOptimizer(ours, torch.optim.SGD, lr=lr)
    with ours.join():
        for step in range(1 if rank == 0 else 3):
            lr.fill_(0.05 / (step + 1))
            _plain_step(ours, opt, step, rank)
    lr.fill_(0.001)
    return {"same_tensor": opt.param_groups[0]["lr"] is lr,
            "lr": float(opt.param_groups[0]["lr"])}


def step_counters_through_join(rank: int, world_size: int) -> dict[str, Any]:
    """An optimizer that counts steps in its param groups and its state (schedule-free,
    MADGRAD), and in a number on itself: rank 0 runs out after one step, the others
    after three, then every rank trains two more. Before, the join's end wound rank 0's
    group counts back to its own (1 where the others had 3). Returns every count after
    the run."""
    from .scenarios import StepCountingSGD

    class AlsoOnItself(StepCountingSGD):
        def step(self, closure=None):
            self.n_steps = getattr(self, "n_steps", 0) + 1
            return super().step(closure)
    torch.manual_seed(5)
    ours = fgp.DistributedDataParallel(MODELS["mlp"](), bucket_cap_mb=0.0001)
    opt = fgp.ShardedOptimizer(ours, AlsoOnItself, lr=0.05)

    with ours.join():
        for step in range(1 if rank == 0 else 3):
            _plain_step(ours, opt, step, rank)
    for step in range(2):
        _plain_step(ours, opt, step, rank)
    return {"k": [g["k"] for g in opt.param_groups],
            "t": [float(g["t"]) for g in opt.param_groups],
            "steps": int(opt.state["steps"]), "meta": opt.state["meta"]["n"],
            "n_steps": opt.optim.n_steps}


def no_sync_left_at_the_join(rank: int, world_size: int, system: str,
                             micro_batches: tuple) -> list:
    """Accumulation of 2 (a no_sync() micro-batch, then a synchronised one and a
    step), ``micro_batches[rank]`` micro-batches under join(): an odd count leaves
    a no_sync() gradient in param.grad when the loop ends, which torch DDP adds to
    the first step after the join, on the rank that joined first and on the last
    alike (before, fgpsdp dropped it on every rank). Then two more steps. ``system``:
    "torch" or an fgpsdp schedule; each trains in its own call."""
    torch.manual_seed(0)
    module = MODELS["mlp"]()
    model, opt = wrapped_for(module, system == "torch", torch.optim.SGD, 0.1, schedule=system)

    def run(first: int, count: int) -> None:
        for i in range(first, first + count):
            x, y = make_batch("mlp", i, 0, rank)
            with model.no_sync() if i % 2 == 0 else contextlib.nullcontext():
                (loss_fn("mlp", model(x), y) / 2).backward()
            if i % 2 == 1:
                opt.step()
                opt.zero_grad()

    with model.join():
        run(0, micro_batches[rank])
    run(100, 4)  # a leftover goes into the first of these steps
    if system != "torch":
        model.synchronize()
    return [p.detach().clone() for p in model.module.parameters()]


def announced_arguments(rank: int, world_size: int, max_norms: tuple) -> dict[str, Any]:
    """Rank 0 runs one step under join(), the others three, each clipping at
    ``max_norms[rank]`` and by value at 0.7 and zeroing with ``set_to_none`` True
    on odd steps only: what every rank's clips and zero_grad received (a joined
    rank's come from the active ranks' announcements), or the error raised."""
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(MODELS["mlp"]())
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    received: list[tuple[str, float]] = []
    by_norm, by_value = opt.clip_grad_norm_, opt.clip_grad_value_

    def clip_grad_norm_(max_norm, *args, **kwargs):
        received.append(("norm", max_norm))
        return by_norm(max_norm, *args, **kwargs)

    def clip_grad_value_(clip_value):
        received.append(("value", clip_value))
        return by_value(clip_value)

    def zero_grad(set_to_none=True):
        received.append(("zero", set_to_none))
        return zero(set_to_none)
    zero = opt.zero_grad
    opt.clip_grad_norm_, opt.clip_grad_value_ = clip_grad_norm_, clip_grad_value_
    opt.zero_grad = zero_grad

    def loop() -> None:
        with model.join():
            for step in range(1 if rank == 0 else 3):
                x, y = make_batch("mlp", step, 0, rank)
                loss_fn("mlp", model(x), y).backward()
                opt.clip_grad_value_(0.7)
                opt.clip_grad_norm_(max_norms[rank])
                opt.step()
                opt.zero_grad(set_to_none=step % 2 == 1)
    error = _error_of(loop)
    return {"received": [(kind, value if isinstance(value, bool) else value.hex())
                         for kind, value in received], **error}


def no_sync_beside_a_synchronised_forward(rank: int, world_size: int) -> dict[str, Any]:
    """Under join(), rank 0 runs a no_sync() micro-batch at the call where rank 1 runs a
    synchronised forward (micro-batches that do not line up across ranks): torch DDP's
    join only sums the flag; here it is an argument the active ranks must agree on, and
    every rank raises (found by fuzzing; no hang)."""
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(MODELS["mlp"]())
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)

    def loop() -> None:
        with model.join():
            x, y = make_batch("mlp", 0, 0, rank)
            with model.no_sync() if rank == 0 else contextlib.nullcontext():
                loss_fn("mlp", model(x), y).backward()
            opt.step()
    return _error_of(loop)
