"""ParamGathers on its own: the order and the lookahead of the parameter all-gathers,
with an exchange that only records (no process group); and the lookahead on 2 ranks."""
import types

import pytest
import torch

from fgpsdp_runtime.param_gathers import ParamGathers
from fgpsdp_runtime.tracing import Timeline


class _Op:
    """A submitted all-gather that never lands by itself; counts done() calls and waits.
    ``waits_per_stream``: as on CUDA (set by a test)."""
    asked = 0
    waits_per_stream = False

    def __init__(self):
        self.landed = False

    def done(self) -> bool:
        _Op.asked += 1
        return self.landed

    def wait(self) -> None:
        self.landed = True
        self.waits = getattr(self, "waits", 0) + 1


class _Exchange:
    def __init__(self):
        self.started = []

    def start_all_gather(self, output, input, label):
        self.started.append(label)
        return _Op()


def _gathers(buckets: int, lookahead):
    storage = types.SimpleNamespace(flat_param=None, param_shard=None)
    exchange = _Exchange()
    versions = types.SimpleNamespace(written_since_change=lambda bucket: None)
    gathers = ParamGathers(exchange, [storage] * buckets, Timeline(), versions, "two_stage",
                           overlaps_forward=True)
    gathers.lookahead = lookahead
    return gathers, exchange


@pytest.mark.parametrize("lookahead", [None, 200])
def test_a_lookahead_of_every_bucket_starts_all_without_counting(lookahead):
    """The plans' default: before, each queued bucket counted every all-gather in
    flight, 20,000 done() calls a step at 200 buckets (audit h110)."""
    gathers, exchange = _gathers(200, lookahead)
    _Op.asked = 0
    for b in range(200):
        gathers.queue(b)
    assert exchange.started == [f"b{b}" for b in range(200)]
    assert _Op.asked == 0


def test_a_smaller_lookahead_holds_the_rest_and_counts_without_asking_the_ops():
    gathers, exchange = _gathers(200, 4)
    _Op.asked = 0
    for b in range(200):
        gathers.queue(b)
    assert exchange.started == ["b0", "b1", "b2", "b3"]
    assert gathers.queued
    assert _Op.asked == 0  # counted from the loop's waits, not from done()
    gathers.finish(10)  # the forward needs bucket 10: every one before it starts too
    assert exchange.started == [f"b{b}" for b in range(11)]
    gathers.start_queued(all_of_them=True)
    assert exchange.started == [f"b{b}" for b in range(200)]


def test_the_lookahead_counts_what_the_loop_has_not_waited_for():
    """Not what has not landed: that depends on each rank's timing, so ranks started
    different buckets, and a read of the parameters on rank 0 alone waited for one its
    peer had not started while the peer waited in a barrier (a deadlock a timing fuzzer found)."""
    gathers, exchange = _gathers(6, 2)
    for b in range(6):
        gathers.queue(b)
    assert exchange.started == ["b0", "b1"]
    for op in list(gathers._in_flight.values()):
        op.landed = True  # landed on this rank: still ahead of the loop
    gathers.start_queued()
    assert exchange.started == ["b0", "b1"]
    # A wait that may run on one rank alone (a read) lands b0, starts nothing, and
    # frees no place: the loop's next start is where every rank's is.
    gathers.finish(0, by_the_loop=False)
    assert exchange.started == ["b0", "b1"] and list(gathers._in_flight) == [1]
    gathers.finish_all(by_the_loop=False)
    assert exchange.started == ["b0", "b1"] and not gathers.in_flight
    gathers.finish(0)  # the loop's wait (a forward's pre-hook): one more starts
    assert exchange.started == ["b0", "b1", "b2"]
    gathers.finish_all()  # the loop's wait for all (synchronize())
    assert exchange.started == [f"b{b}" for b in range(6)] and not gathers.in_flight
    assert not gathers._ahead


def test_a_wait_off_the_loop_leaves_a_cuda_op_owed_to_the_loop(monkeypatch):
    """On CUDA a wait orders only the waiting thread's current stream: a read of the
    parameters under a side stream (an EMA's) or on a checkpoint thread took the op
    out of the table, and the forward's pre-hook then skipped its own wait (found by
    a review of the CUDA path; on CPU a wait is the host's, as the test above has it).
    The op is owed to the loop: its next wait orders the loop's stream too, while the
    bucket counts as landed for everything else (later reads are free)."""
    monkeypatch.setattr(_Op, "waits_per_stream", True)
    gathers, _ = _gathers(3, None)
    for b in range(3):
        gathers.queue(b)
    ops = dict(gathers._in_flight)
    gathers.finish_all(by_the_loop=False)  # a read of every parameter, say on a side stream
    assert all(op.waits == 1 for op in ops.values())
    assert not gathers.in_flight and sorted(gathers._owed) == [0, 1, 2]
    gathers.finish(1)  # the forward's pre-hook waits again, on its own stream
    assert ops[1].waits == 2 and sorted(gathers._owed) == [0, 2]
    gathers.finish_all()  # synchronize()
    assert all(op.waits == 2 for op in ops.values()) and not gathers._owed


@pytest.mark.parametrize("waits_per_stream", [False, True])
def test_a_clamp_through_a_read_after_the_step_is_no_write_over_a_landing_gather(
        monkeypatch, waits_per_stream):
    """WGAN's clamp right after opt.step(), parameter by parameter as a read hands
    them out: the read landed the bucket, so neither the read of the next parameter
    nor the forward may take the write for one racing the all-gather (a review found
    the first version of the fix above raising there on CUDA)."""
    from fgpsdp_runtime.param_guards import ParamVersions
    monkeypatch.setattr(_Op, "waits_per_stream", waits_per_stream)
    params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))]
    versions = ParamVersions([params], {id(params[0]): "w0", id(params[1]): "w1"})
    storage = types.SimpleNamespace(flat_param=None, param_shard=None)
    gathers = ParamGathers(_Exchange(), [storage], Timeline(), versions, "two_stage",
                           overlaps_forward=True)
    gathers.queue(0)
    gathers.finish(0, by_the_loop=False)  # handing out w0
    with torch.no_grad():
        params[0].clamp_(-0.5, 0.5)
    gathers.finish(0, by_the_loop=False)  # handing out w1
    gathers.finish(0)  # the forward's pre-hook


def _read_on_rank_0_then_barrier(rank, world_size):
    import time

    import torch
    import torch.distributed as dist
    from torch import nn

    import fgpsdp_runtime as fgp
    from fgpsdp_runtime.plan import OverlapPlan

    class PacedAdamW(torch.optim.AdamW):
        """One step per bucket in two_stage, each 60 ms but rank 1's last bucket's:
        rank 1 queued its last bucket while the one before was still in flight,
        rank 0 (20 ms behind) after it had landed, so the old count (what has not
        landed) had rank 0 start it and rank 1 hold it back."""
        calls = 0

        def step(self, closure=None):
            last = PacedAdamW.calls % buckets == buckets - 1
            PacedAdamW.calls += 1
            if not (rank == 1 and last):
                time.sleep(0.06)
            return super().step(closure)

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(13, 37), nn.Tanh(), nn.Linear(37, 29), nn.Tanh(),
                           nn.Linear(29, 5))
    model = fgp.DistributedDataParallel(module, schedule="two_stage", overlap_plan="layout",
                                        bucket_cap_mb=0.0001)
    model.set_overlap_plan(OverlapPlan(stage1=(), stage2=model.forward_bucket_order,
                                       lookahead=1, source="test"))
    buckets = len(model.buckets)
    opt = fgp.ShardedOptimizer(model, PacedAdamW, lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    norms = []
    for _ in range(3):
        nn.functional.mse_loss(model(torch.randn(8, 13, generator=g)),
                               torch.randn(8, 5, generator=g)).backward()
        if rank == 0:
            time.sleep(0.02)
        opt.step()
        opt.zero_grad()
        if rank == 0:  # a weight norm logged on rank 0 alone
            norms.append(float(sum(p.detach().double().square().sum()
                                   for p in model.parameters())))
        dist.barrier()  # then a collective of every rank (a loss all-reduce, a barrier)
    model.synchronize()
    return norms, [p.detach().clone() for p in model.module.parameters()]


def test_a_read_on_one_rank_after_the_step_waits_only_for_what_every_rank_started():
    """A plan with a lookahead of 1: before, a deadlock (a timing fuzzer found it)."""
    from .dist_harness import run_distributed
    (norms, params0), (_, params1) = run_distributed(2, _read_on_rank_0_then_barrier,
                                                    timeout_s=120, pg_timeout_s=60)
    assert len(norms) == 3
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))


def test_stage_1_all_gathers_take_no_place_in_the_lookahead():
    """Started in backward, kept by the step and waited for by the next forward only:
    counted, they held every stage-2 all-gather back to its forward's wait (review)."""
    gathers, exchange = _gathers(5, 2)
    for b in (2, 1, 0):  # stage 1, from the scheduler thread
        gathers.start(b)
    for b in (4, 3):  # the step queues stage 2 behind them
        gathers.queue(b)
    assert exchange.started == ["b2", "b1", "b0", "b4", "b3"] and not gathers.queued
