"""The two-stage machinery: the scheduler thread, the profile plan, fixed plans, the timeline."""
import json
import sys

import pytest
import torch

from .dist_harness import run_calls, run_distributed
from .scenarios import (gan_loop, load_checkpoint_with_gathers_in_flight,
                        save_checkpoint_with_gathers_in_flight, scheduler_thread_failure,
                        speculative_failure_on_one_rank, step_and_gather_order,
                        synchronize_between_backward_and_step, traced_steps, train_many)
from .test_equivalence import SCENARIOS, TOL
from .test_schedules import results


@pytest.mark.parametrize("topology", ["flat", "2x2"])
def test_auto_plan_profiles_without_speculating_then_switches_on_every_rank(topology):
    ranks = results("two_stage", topology, "auto", ("clip_idle", "clip_triggers"))
    plans = {r["clip_idle"]["plan"] for r in ranks}
    assert len(plans) == 1, "every rank must run the same plan"
    plan = json.loads(plans.pop())
    assert plan["source"] == "profile"  # switched after the profiled steps of a 5-step run
    assert plan["predicted"]["link"]["bandwidth_Bps"] > 0
    ready, backward = plan["predicted"]["bucket_ready_s"], plan["predicted"]["backward_s"]
    assert 0 < min(ready) and max(ready) <= backward  # from the forward's end, host clock
    n = ranks[0]["clip_idle"]["n_buckets"]
    assert n >= 4
    assert sorted(plan["stage1"] + plan["stage2"]) == list(range(n))
    serial = results("serial", topology)
    for rank, res in enumerate(ranks):
        # Steps 1-3 ran the profiling plan: no undo records, nothing speculated.
        # Steps 4 and 5 speculated the profile plan's stage 1 and committed it.
        assert res["clip_idle"]["commits"] == 2 * len(plan["stage1"])
        assert res["clip_idle"]["rollbacks"] == 0
        # Clipping from the first step on: the profile plan never speculates either.
        assert res["clip_triggers"]["commits"] == res["clip_triggers"]["rollbacks"] == 0
        for case in ("clip_idle", "clip_triggers"):
            assert res[case]["param_diff"] <= TOL, (rank, case, res[case]["param_diff"])
            for a, b in zip(res[case]["params"], serial[rank][case]["params"]):
                assert torch.equal(a, b), f"rank {rank} {case}: auto differs from serial"


def _fixed_plan_results():
    cases = {}
    for stage in ("stage1", "stage2"):
        for lookahead in (1, 3):
            for case in ("clip_idle", "clip_triggers"):
                cases[f"{case}-{stage}-{lookahead}"] = dict(
                    SCENARIOS[case], bucket_cap_mb=0.0001, steps=4, schedule="two_stage",
                    overlap_plan="layout", fixed_plan=(stage, lookahead), return_params=True,
                    local_size=2)
    return run_distributed(4, train_many, cases, timeout_s=600)


def test_fixed_plans_and_lookahead_match_serial():
    ours = _fixed_plan_results()
    serial = results("serial", "2x2")
    for rank, res in enumerate(ours):
        for name, r in res.items():
            case = name.split("-")[0]
            assert json.loads(r["plan"])["source"] == "test", "a fixed plan is never replaced"
            assert r["param_diff"] <= TOL
            # serial ran 5 steps; compare with DDP only, and plans with each other below
        for case in ("clip_idle", "clip_triggers"):
            variants = [res[f"{case}-{s}-{la}"]["params"] for s in ("stage1", "stage2")
                        for la in (1, 3)]
            for other in variants[1:]:
                for a, b in zip(variants[0], other):
                    assert torch.equal(a, b), f"rank {rank} {case}: plans disagree"
    assert serial  # the serial reference exists (bitwise checks live in test_schedules)
    r0 = ours[0]
    assert r0["clip_idle-stage1-1"]["commits"] > 0 and r0["clip_idle-stage2-1"]["commits"] == 0
    assert r0["clip_triggers-stage1-3"]["rollbacks"] > 0


# The two-rank scenarios of this file, run in one set of processes.
ORDER_SCHEDULES = ["two_stage", "next_forward", "serial"]
LOAD_CASES = [("two_stage", "wrapper"), ("next_forward", "module"), ("two_stage", "submodule")]
SAVE_CASES = [("two_stage", "module"), ("next_forward", "submodule"),
              ("two_stage", "module on rank 0")]
GAN_SCHEDULES = ["two_stage", "next_forward"]
TWO_RANK_CALLS = ([(step_and_gather_order, s) for s in ORDER_SCHEDULES]
                  + [(scheduler_thread_failure,)]
                  + [(synchronize_between_backward_and_step, s) for s in ("two_stage", "serial")]
                  + [(load_checkpoint_with_gathers_in_flight, *case) for case in LOAD_CASES]
                  + [(save_checkpoint_with_gathers_in_flight, *case) for case in SAVE_CASES]
                  + [(gan_loop, s, gp) for s in GAN_SCHEDULES for gp in (False, True)])


@pytest.fixture(scope="module")
def two_ranks():
    """call -> [rank 0's result, rank 1's]."""
    return run_calls(2, TWO_RANK_CALLS, timeout_s=300)


@pytest.mark.parametrize("schedule", ORDER_SCHEDULES)
def test_step_and_all_gathers_run_in_forward_order(two_ranks, schedule):
    # Clipping is active, so nothing is speculated in the logged step: every
    # bucket is stepped after the norm. Under the forward-overlapped schedules
    # each bucket's all-gather starts right after its own slice is stepped, in
    # forward order; serial steps everything, then gathers.
    for res in two_ranks[(step_and_gather_order, schedule)]:
        log, order = res["log"], res["forward_order"]
        assert len(order) >= 4
        gathers = [b for kind, b in log if kind == "gather"]
        assert gathers == order
        steps = [i for i, (kind, _) in enumerate(log) if kind == "step"]
        if schedule == "serial":
            assert len(steps) == 1 and steps[0] == 0
        else:
            assert [kind for kind, _ in log] == ["step", "gather"] * len(order)
            # (A rank's slice of a small bucket may be all padding: no tensors.)
            assert sum(n for kind, n in log if kind == "step") > 0


def test_scheduler_thread_failure_is_raised_on_every_rank(two_ranks):
    for res in two_ranks[(scheduler_thread_failure,)]:
        assert res["error"] is not None and "injected failure" in res["error"]
        if sys.version_info >= (3, 11):
            assert any("two_stage speculative step" in n for n in res["notes"]), res
        # The failed bucket's partial norm, taken before its step raised, was
        # used again for the next step's total (a NaN there went unnoticed).
        assert res["norms"] == pytest.approx(res["ref_norms"], rel=1e-6), res  # float32 tensors
        assert res["param_diff"] <= 1e-6, res


@pytest.mark.parametrize("mode", ["step", "forward_before_step"])
def test_a_speculative_step_failing_on_one_rank_is_raised_on_every_rank(mode):
    """Before 2026-12-05 rank 1 raised at the join while rank 0 went on into the
    step's collectives: both waited out the process group's timeout. Every rank
    raises the failing rank's exception type, which the loop catches."""
    ranks = run_distributed(2, speculative_failure_on_one_rank, mode,
                            timeout_s=120, pg_timeout_s=30)
    assert ranks[0]["stage1"] >= 3  # the failure is part-way through stage 1
    (step0, message0, notes0), = ranks[0]["errors"]
    (step1, message1, notes1), = ranks[1]["errors"]
    assert step0 == step1 == (0 if mode == "forward_before_step" else 1)
    assert message0 == message1 == "injected failure on rank 1"
    if sys.version_info >= (3, 11):
        assert any("raised on rank 1 in a two_stage speculative step" in n
                   for n in notes0), notes0
        assert any("skipped on every rank" in n for n in notes1), notes1
    # Accumulating without no_sync() adds reduced gradients, torch DDP reduces the sum:
    # bitwise only without it.
    for res in ranks:
        assert res["param_diff"] <= (1e-6 if mode == "forward_before_step" else 0.0), \
            res["param_diff"]


def test_a_speculative_failure_in_a_round_dropped_by_zero_grad_is_not_raised_later():
    """The loop drops the failing round with zero_grad(): no step of it raises, the
    failing rank warns, and the next rounds speculate on both ranks alike."""
    ranks = run_distributed(2, speculative_failure_on_one_rank, "zero_grad_without_step",
                            timeout_s=120, pg_timeout_s=30)
    assert ranks[0]["errors"] == ranks[1]["errors"] == []
    assert ranks[0]["dropped_warnings"] == [] and len(ranks[1]["dropped_warnings"]) == 1
    assert ranks[0]["commits_after_failure"] == ranks[1]["commits_after_failure"] > 0
    assert ranks[0]["param_diff"] == ranks[1]["param_diff"] == 0.0


@pytest.mark.parametrize("schedule", ["two_stage", "next_forward"])
def test_timeline_has_every_lane_and_bucket(schedule):
    ranks = run_distributed(4, traced_steps, {"local_size": 2, "schedule": schedule, "steps": 3},
                            timeout_s=300)
    for res in ranks:
        assert res["spans_before"] == 0, "a disabled timeline records nothing"
        trace = json.loads(json.dumps(res["trace"]))  # valid JSON
        names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
                 if e["ph"] == "M" and e["name"] == "thread_name"}
        spans = [(names[e["tid"]], e["name"]) for e in trace["traceEvents"] if e["ph"] == "X"]
        lanes = {lane for lane, _ in spans}
        assert {"compute", "intra-rs", "inter-rs", "inter-ag", "intra-ag"} <= lanes
        n = res["n_buckets"]
        for lane in ("intra-rs", "inter-rs"):
            assert sorted(name for l, name in spans if l == lane) == sorted(
                f"RS b{b}" for b in range(n))
        for lane in ("inter-ag", "intra-ag"):
            assert {name for l, name in spans if l == lane} == {f"AG b{b}" for b in range(n)}
        compute = {name for l, name in spans if l == "compute"}
        assert {"forward", "optimizer step", "norm all-reduce"} <= compute
        if schedule == "two_stage":
            stage1 = json.loads(res["plan"])["stage1"]
            assert {name for l, name in spans if l == "scheduler"} >= {
                f"spec step b{b}" for b in stage1}
        assert all(e["dur"] >= 0 for e in trace["traceEvents"] if e["ph"] == "X")


def test_synchronize_between_backward_and_step_sees_the_old_parameters(two_ranks):
    ours = two_ranks[(synchronize_between_backward_and_step, "two_stage")]
    serial = two_ranks[(synchronize_between_backward_and_step, "serial")]
    for res, ref in zip(ours, serial):
        assert res["unchanged"] == [True]
        assert res["rollbacks"] > 0, "speculative steps were undone"
        for a, b in zip(res["params"], ref["params"]):
            assert torch.equal(a, b)


def test_forward_ordered_step_runs_the_inner_optimizer_a_bounded_number_of_times():
    from fgpsdp_runtime.step_chunks import MAX_STEP_CHUNKS, split_evenly
    order = list(range(40, 0, -1))
    chunks = split_evenly(order, MAX_STEP_CHUNKS)
    assert len(chunks) == MAX_STEP_CHUNKS
    assert [b for chunk in chunks for b in chunk] == order  # consecutive, in order
    assert max(map(len, chunks)) - min(map(len, chunks)) <= 1
    assert split_evenly([3, 2, 1], MAX_STEP_CHUNKS) == [[3], [2], [1]]
    assert split_evenly([], MAX_STEP_CHUNKS) == []


@pytest.mark.parametrize("schedule,via", LOAD_CASES)
def test_load_state_dict_lands_the_gathers_in_flight_first(two_ranks, schedule, via):
    """A checkpoint loaded while a step's all-gathers are in flight is what the model
    holds afterwards on every rank (they must not land over it), and training goes on."""
    res = two_ranks[(load_checkpoint_with_gathers_in_flight, schedule, via)]
    for r in res:
        assert r["step_changed_it"]
        assert r["loaded"]
        assert "assign=True" in r["assign_refused"]
    for a, b in zip(res[0]["params"], res[1]["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("schedule,via", SAVE_CASES)
def test_module_state_dict_lands_the_gathers_in_flight_first(two_ranks, schedule, via):
    """model.module.state_dict() right after opt.step() (torch DDP's way to save, on
    rank 0 alone too) holds the updated parameters, the same on every rank."""
    res = two_ranks[(save_checkpoint_with_gathers_in_flight, schedule, via)]
    saved_by = [r for r in res if r["saved"] is not None]
    for r in saved_by:
        for k, v in r["landed"].items():
            assert torch.equal(r["saved"][k], v), k
    for k, v in res[0]["landed"].items():
        assert torch.equal(v, res[1]["landed"][k]), k


@pytest.mark.parametrize("gradient_penalty", [False, True], ids=["dcgan", "wgan_gp"])
@pytest.mark.parametrize("schedule", GAN_SCHEDULES)
def test_gan_discriminator_does_not_speculate_with_gradients_it_never_steps(
        two_ranks, schedule, gradient_penalty):
    """DCGAN: G's backward adds to D's gradients after D's step, and D zeroes them
    before its next backward. two_stage must not step D speculatively with them
    (it did: every D step then rolled back, a rank-0 save of D raised, and a D
    wrapper dropped there left those steps in the module). Bitwise torch DDP.
    With WGAN-GP's penalty D's backward is preceded by torch.autograd.grad
    through D (no parameter reached: no round of reduce-scatters) and reaches
    D's parameters through the penalty's double-backward graph too."""
    for rank, res in enumerate(two_ranks[(gan_loop, schedule, gradient_penalty)]):
        for a, b in zip(res["params"], res["reference"]):
            assert torch.equal(a, b), f"rank {rank}"
        if rank == 0:
            assert res["saves"] == ["ok"] * 4
        if schedule == "two_stage":
            # No clipping: D's own backwards speculate, and every such step commits
            # (all four: G's round through D is no read before D's step).
            assert res["d_stage1"] > 0, res
            assert res["d_commits"] == 4 * res["d_stage1"] and res["d_rollbacks"] == 0, res


def _tensor_learning_rate(rank, world_size, system):
    """AdamW with ``lr=torch.tensor(...)`` (as capturable and fused optimizers take it
    on a GPU), a StepLR filling it in place after each step, and the loop filling it
    once between backward and step. Returns the parameters, the number of speculative
    steps committed, and per step how often the hyperparameter bookkeeping read a
    tensor's value (torch.equal: on a GPU each waits for the device)."""
    import sys as _sys
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    import fgpsdp_runtime as fgp
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    kwargs = dict(lr=torch.tensor(1e-2), foreach=False)
    if system == "ddp":
        model = TorchDDP(module)
        opt = torch.optim.AdamW(module.parameters(), **kwargs)
    else:
        model = fgp.DistributedDataParallel(module, schedule="two_stage", overlap_plan="layout",
                                            bucket_cap_mb=0.0005)
        opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, **kwargs)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    reads = [0]
    original = torch.equal

    def counting(a, b):
        if _sys._getframe(1).f_globals.get("__name__") == "fgpsdp_runtime.step_wide_state":
            reads[-1] += 1
        return original(a, b)
    torch.equal = counting
    try:
        g = torch.Generator().manual_seed(rank)
        for step in range(5):
            model(torch.randn(4, 8, generator=g)).square().mean().backward()
            if step == 2:
                opt.param_groups[0]["lr"].fill_(3e-3)  # the speculative steps must be redone
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            reads.append(0)
    finally:
        torch.equal = original
    if system != "ddp":
        model.synchronize()
    return {"params": [p.detach().clone() for p in module.parameters()], "reads": reads[:-1],
            "commits": model.scheduler.commits if system != "ddp" else None}


def test_a_tensor_learning_rate_trains_as_torch_ddp_without_reading_it_each_step():
    ours = run_distributed(2, _tensor_learning_rate, "fgpsdp")
    torch_ddp = run_distributed(2, _tensor_learning_rate, "ddp")
    for rank, (res, ref) in enumerate(zip(ours, torch_ddp)):
        assert res["commits"] > 0, "nothing speculated: the test proves nothing"
        for a, b in zip(res["params"], ref["params"]):
            assert torch.equal(a, b), f"rank {rank}"
        # Only the step whose learning rate changed after backward compares values.
        assert [n for step, n in enumerate(res["reads"]) if step != 2] == [0] * 4, res["reads"]
