"""CUDA-only scenarios, one GPU, one process, an NCCL world of 1 (run by
tests/test_cuda_streams.py in a fresh interpreter: ``python -m tests.cuda_stream_scenarios
CASE``; prints one JSON line).

With one rank every collective is a copy on the link worker's stream, as a
synchronous NCCL collective runs on the current stream without recording its
tensors. A GPU sleep before each reduce-scatter stands in for a slow link, so
that the compute stream runs ahead of the link streams, as it does on a real
cluster: correct stream code gives the same numbers with and without it.
"""
import contextlib
import json
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

import fgpsdp_runtime as fgp
from fgpsdp_runtime import comm
from fgpsdp_runtime.topology import LinkGroups, NodeLayout

from .profile_window_scenarios import SlowNet

_ORIGINAL_RS = comm.start_reduce_scatter
_ORIGINAL_AG = comm.start_all_gather


def _after_a_gpu_sleep(collective, cycles: int):
    """``collective``, first sleeping ``cycles`` on the worker's stream (the current
    one there); itself for 0."""
    def delayed(group, output, input, scratch_slots=1):
        torch.cuda._sleep(cycles)
        return collective(group, output, input, scratch_slots=scratch_slots)
    return delayed if cycles else collective


def _slow_link(cycles: int) -> None:
    comm.start_reduce_scatter = _after_a_gpu_sleep(_ORIGINAL_RS, cycles)


def hierarchical_partial_sum() -> dict:
    """The node's partial sum between the two reduce-scatter phases lives only in the
    workers' tasks: the compute stream must not get its block while the slow second
    phase has not read it."""
    _slow_link(int(1e9))
    world = dist.group.WORLD
    device = torch.device("cuda", torch.cuda.current_device())
    exchange = comm.HierarchicalExchange(NodeLayout(1, 1, hierarchical=True),
                                         LinkGroups(world, world), LinkGroups(world, world),
                                         device, comm.CommStats())
    n = 1 << 22
    sends = [torch.full((n,), float(i + 1), device=device) for i in range(2)]
    outs = [torch.empty(n, device=device) for _ in range(2)]
    ops = [exchange.start_reduce_scatter(o, s, f"b{i}") for i, (o, s) in
           enumerate(zip(outs, sends))]
    # Host-side, not wall-clock: once bucket 1's second phase is queued, both workers
    # hold bucket 1's tasks only, so bucket 0's partial has no host reference left.
    for op in ops:
        op.future.result()
    # The GPU must still be behind (else the check below proves nothing).
    conclusive = not ops[0].done_event.query()
    junk = [torch.full((n,), -7.0, device=device) for _ in range(4)]
    for op in ops:
        op.wait()
    torch.cuda.synchronize()
    exchange.close()
    _slow_link(0)
    return {"wrong": [int((o != float(i + 1)).sum()) for i, o in enumerate(outs)],
            "junk_intact": all(bool((j == -7.0).all()) for j in junk),
            "conclusive": conclusive}


def _train(module_seed: int, schedule: str, delay_cycles: int, steps: int = 6,
           reduce_dtype=None, late_optimizer: bool = False, master_weights: bool = False,
           summoned: bool = False):
    _slow_link(delay_cycles)
    torch.manual_seed(module_seed)
    device = torch.device("cuda", torch.cuda.current_device())
    module = torch.nn.Sequential(*[m for _ in range(8)
                                   for m in (torch.nn.Linear(512, 512), torch.nn.ReLU())])
    dtype = torch.bfloat16 if master_weights else torch.float32
    module = module.to(device, dtype)
    model = fgp.DistributedDataParallel(module, bucket_cap_mb=1, schedule=schedule,
                                        overlap_plan="layout", reduce_dtype=reduce_dtype)
    opt = None if late_optimizer else fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3,
                                                           master_weights=master_weights)
    generator = torch.Generator(device=device).manual_seed(1)
    for _ in range(steps):
        x = torch.randn(256, 512, device=device, generator=generator).to(dtype)
        model(x).float().square().mean().backward()
        if opt is None:  # built between the first backward and its step
            opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3)
        if summoned:  # an edit of every p.grad (half the elements zeroed)
            with opt.summon_full_grads():
                for p in module.parameters():
                    p.grad.view(-1)[::2] = 0
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.synchronize()
    torch.cuda.synchronize()
    _slow_link(0)
    return [p.detach().clone() for p in module.parameters()], model, opt


def slow_link_same_result() -> dict:
    """Every schedule, speculative steps included (two_stage with the layout plan
    speculates from the first step): a slow link changes no parameter."""
    out = {}
    variants = {"two_stage": dict(schedule="two_stage"),
                "next_forward": dict(schedule="next_forward"),
                "serial": dict(schedule="serial"),
                # a `received` temporary landed (cast) on the speculation stream
                "two_stage_bf16": dict(schedule="two_stage", reduce_dtype=torch.bfloat16),
                # float16 packing (torch's fp16_compress_hook through register_comm_hook)
                "two_stage_fp16": dict(schedule="two_stage", reduce_dtype=torch.float16),
                # stage-1 steps taken at the join with op=None
                "two_stage_late_optimizer": dict(schedule="two_stage", late_optimizer=True),
                # bfloat16 parameters: float32 masters stepped and written back on the
                # speculation stream, before that bucket's all-gather reads the slice
                "two_stage_bf16_masters": dict(schedule="two_stage", master_weights=True),
                # gradients edited in opt.summon_full_grads() after the speculative steps
                # (undone, stepped again), with float32 and with master weights
                "two_stage_summoned": dict(schedule="two_stage", summoned=True),
                "two_stage_bf16_masters_summoned": dict(schedule="two_stage",
                                                        master_weights=True, summoned=True)}
    for name, kwargs in variants.items():
        fast, _, _ = _train(0, delay_cycles=0, **kwargs)
        slow, _, _ = _train(0, delay_cycles=int(2e8), **kwargs)
        out[name] = max(float((a - b).abs().max()) for a, b in zip(fast, slow))
    return out


def shard_round_trip() -> dict:
    """opt.load_state_dict(opt.state_dict()) on an NCCL group: its check across ranks
    must not all-reduce a CPU tensor."""
    _, model, opt = _train(0, "two_stage", 0, steps=2)
    # all_reduce_sum returns early in a world of 1: run the collective anyway, so that
    # a CPU tensor meets NCCL's "no backend for cpu" as it would with 2 ranks.
    model.all_reduce_sum = lambda t: dist.all_reduce(t, group=model.process_group)
    before = [t.clone() for t in opt.optim.state_dict()["state"][0].values()
              if isinstance(t, torch.Tensor)]
    opt.load_state_dict(opt.state_dict())
    after = [t for t in opt.optim.state_dict()["state"][0].values()
             if isinstance(t, torch.Tensor)]
    return {"equal": all(torch.equal(a, b) for a, b in zip(before, after))}


def profile_reads_gpu_time() -> dict:
    """overlap_plan="auto" on CUDA: the profile's backward is the GPU's, not the
    host's, which only enqueues it (before, host clock readings in the hooks)."""
    device = torch.device("cuda", torch.cuda.current_device())
    layers, cycles = 8, int(2e7)
    torch.manual_seed(0)
    slow = SlowNet(layers, width=512, pause=lambda: torch.cuda._sleep(cycles))
    model = fgp.DistributedDataParallel(slow.to(device), bucket_cap_mb=1, schedule="two_stage",
                                        overlap_plan="auto")
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    x = torch.randn(64, 512, device=device)
    host_backward_s, gpu_backward_s = [], []
    for _ in range(5):
        loss = model(x)  # the loss itself: the profiler's origin is the wrapper's forward end
        forward_end = torch.cuda.Event(enable_timing=True)
        forward_end.record()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss.backward()
        host_backward_s.append(time.perf_counter() - t0)
        backward_end = torch.cuda.Event(enable_timing=True)
        backward_end.record()
        torch.cuda.synchronize()
        gpu_backward_s.append(forward_end.elapsed_time(backward_end) / 1e3)
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.synchronize()
    plan = model.plan
    ready = plan.predicted["bucket_ready_s"]
    profiled = gpu_backward_s[1:3]  # steps 2-3, the plan's profile
    gpu = statistics.median(profiled)
    sleep_s = gpu / layers  # about one layer's GPU sleep
    return {"source": plan.source,
            # the host ran well ahead in the profiled steps (the first step pays
            # first-use costs), else the check proves nothing
            "conclusive": max(host_backward_s[1:3]) < 0.5 * min(profiled),
            "backward_matches_gpu": abs(plan.predicted["backward_s"] - gpu) <= 0.1 * gpu,
            "ready_spread": ready[-1] - ready[0] >= 0.5 * gpu,
            # bucket b holds layer 7 - b: each is ready about one sleep after the last
            "ready_in_order": all(b - a >= 0.5 * sleep_s for a, b in zip(ready, ready[1:])),
            "n_buckets": len(ready)}


def _slow_all_gathers(cycles: int) -> None:
    comm.start_all_gather = _after_a_gpu_sleep(_ORIGINAL_AG, cycles)


def _gpu_seconds(cycles: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def _profiled_waits(ag_cycles: int, forward_cycles: int) -> tuple[dict, float]:
    """The auto plan's measured forward waits, and the host's longest forward in the
    profiled steps (2-3)."""
    device = torch.device("cuda", torch.cuda.current_device())
    _slow_all_gathers(ag_cycles)
    torch.manual_seed(0)
    net = SlowNet(8, width=512, pause=lambda: torch.cuda._sleep(int(1e6)),
                  forward_pause=(lambda: torch.cuda._sleep(forward_cycles))
                  if forward_cycles else None)
    model = fgp.DistributedDataParallel(net.to(device), bucket_cap_mb=1, schedule="two_stage",
                                        overlap_plan="auto")
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    x = torch.randn(64, 512, device=device)
    host_forward_s = []
    for _ in range(5):
        t0 = time.perf_counter()
        loss = model(x)
        host_forward_s.append(time.perf_counter() - t0)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.synchronize()
    torch.cuda.synchronize()
    _slow_all_gathers(0)
    waits = {int(b): s for b, s in model.plan.predicted["forward_wait_s"].items()}
    return waits, max(host_forward_s[1:3])


def profile_times_forward_waits_on_gpu() -> dict:
    """overlap_plan="auto" on CUDA: a forward's wait for an all-gather is the compute
    stream's stall (events around its wait for the all-gather's event), not the
    host's, which only enqueues the forward. Slow all-gathers and a quick forward:
    each bucket after the first waits about one all-gather; a slow forward and
    quick all-gathers: none waits."""
    cycles = int(2e7)
    ag_s = _gpu_seconds(cycles)
    slow_link, host_forward_s = _profiled_waits(ag_cycles=cycles, forward_cycles=0)
    slow_forward, _ = _profiled_waits(ag_cycles=0, forward_cycles=cycles)
    later = [w for b, w in slow_link.items() if b != max(slow_link)]  # the first is max(b)
    return {"n_buckets": len(slow_link),
            # the host ran ahead of the GPU, else the check proves nothing
            "conclusive": host_forward_s < 0.5 * ag_s,
            "slow_link_waits": all(w >= 0.5 * ag_s for w in later),
            "slow_forward_waits_nothing": max(slow_forward.values()) < 0.1 * ag_s,
            # what the checks read, for a failure's message
            "seconds": {"all_gather": ag_s, "host_forward": host_forward_s,
                        "slow_link_waits": slow_link, "slow_forward_waits": slow_forward}}


def _four_layers_next_forward():
    """Four 512-wide layers under next_forward (a bucket each, all-gathers from the
    step), AdamW, and a batch: (model, opt, x)."""
    torch.manual_seed(0)
    device = torch.device("cuda", torch.cuda.current_device())
    module = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]).to(device)
    model = fgp.DistributedDataParallel(module, bucket_cap_mb=1, schedule="next_forward",
                                        overlap_plan="layout")
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    return model, opt, torch.randn(64, 512, device=device)


@contextlib.contextmanager
def _stepped_behind_slow_all_gathers(model, opt):
    """``opt.step()`` with every all-gather behind a GPU sleep on the link stream,
    issued on the host side; the block runs while they have not landed. Yields
    whether the case is conclusive: two all-gathers or more, not all landed."""
    _slow_all_gathers(int(1e9))
    try:
        opt.step()
        ops = list(model._gathers._in_flight.values())
        for op in ops:
            op.future.result()  # (host side: every collective was issued)
        yield len(ops) >= 2 and not all(op.done_event.query() for op in ops)
    finally:
        _slow_all_gathers(0)


def _four_layers_after_one_step(x: torch.Tensor) -> list:
    """What one step on ``x`` writes, on a copy of the four layers trained alike and
    synchronized."""
    model, opt, _ = _four_layers_next_forward()
    model(x).square().mean().backward()
    opt.step()
    model.synchronize()
    torch.cuda.synchronize()
    return [p.detach() for p in model.module.parameters()]


def timeline_enabled_mid_run() -> dict:
    """model.timeline.enable() after the first step, with no plan profiler to pin
    the CUDA clock: no link worker synchronises the device (across ranks that can
    hang), and the spans read back are GPU times on the host clock: a
    reduce-scatter behind a GPU sleep lasts at least the sleep and lies between
    the host's readings before the steps and after reading the spans."""
    cycles = int(2e8)
    sleep_s = _gpu_seconds(cycles)
    model, opt, x = _four_layers_next_forward()

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step()
    model.synchronize()
    torch.cuda.synchronize()
    _slow_link(cycles)
    syncing_threads = []
    original_synchronize = torch.cuda.synchronize

    def recording_synchronize(device=None):
        syncing_threads.append(threading.current_thread().name)
        return original_synchronize(device)
    torch.cuda.synchronize = recording_synchronize
    try:
        model.timeline.enable()
        before = time.perf_counter()
        step()
        step()
        model.synchronize()
        spans = model.timeline.spans()
        after = time.perf_counter()
    finally:
        torch.cuda.synchronize = original_synchronize
        _slow_link(0)
    reduce_scatters = [(start, end) for lane, _, start, end in spans if lane.endswith("-rs")]
    return {"worker_syncs": [n for n in syncing_threads if n != threading.main_thread().name],
            "reduce_scatters": len(reduce_scatters) >= 2,
            "each_lasts_the_sleep": all(end - start >= 0.9 * sleep_s
                                        for start, end in reduce_scatters),
            "on_the_host_clock": all(before <= start and end <= after
                                     for start, end in reduce_scatters)}


def side_stream_read_orders_the_forward() -> dict:
    """A read of the parameters right after the step under a side stream (an EMA's)
    lands the all-gathers on that stream; the next forward, on the default stream,
    must still wait for them (before 2026-12-05 the read took them out of the
    forward's waits). The all-gathers sit behind a GPU sleep on the link stream:
    once the default stream has run the forward, they must have landed."""
    cycles = int(1e9)
    model, opt, x = _four_layers_next_forward()
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.synchronize()
    torch.cuda.synchronize()
    model(x).square().mean().backward()
    _slow_all_gathers(cycles)
    try:
        opt.step()  # starts every all-gather, each behind the sleep on the link stream
        ops = list(model._gathers._in_flight.values())
        side = torch.cuda.Stream(x.device)
        with torch.cuda.stream(side):
            read = [p.detach() for p in model.parameters()]  # lands them on `side`
        for op in ops:
            op.future.result()  # (host side: every collective was issued)
        model(x)
        conclusive = len(ops) >= 2 and not all(op.done_event.query() for op in ops)
        torch.cuda.current_stream(x.device).synchronize()
        ordered = all(op.done_event.query() for op in ops)
    finally:
        _slow_all_gathers(0)
    model.synchronize()
    torch.cuda.synchronize()
    return {"conclusive": conclusive, "ordered": ordered, "read": len(read) == 8}


def moved_to_the_cpu_right_after_the_step() -> dict:
    """PyTorch Lightning's teardown, ``lightning_module.cpu()``, right after the last
    step, its all-gathers behind a GPU sleep on the link stream: the CPU copies must
    hold the updated parameters (``nn.Module._apply`` reads the ``_parameters``
    tables, which land the all-gathers first; before 2026-12-06 the copies held the
    old values of every bucket but this rank's slices)."""
    model, opt, x = _four_layers_next_forward()
    model(x).square().mean().backward()
    with _stepped_behind_slow_all_gathers(model, opt) as conclusive:
        model.module.cpu()
    moved = [p.detach().clone() for p in model.module.parameters()]
    expected = [p.cpu() for p in _four_layers_after_one_step(x)]
    return {"conclusive": conclusive, "on_the_cpu": all(p.device.type == "cpu" for p in moved),
            "diff": max(float((a - b).abs().max()) for a, b in zip(moved, expected))}


def held_read_right_after_the_step() -> dict:
    """torch_ema's update over parameters held from before the step, right after it,
    the all-gathers behind a GPU sleep on the link stream: the torch call lands them
    first (held_param_reads.py), and orders the reading stream after them."""
    model, opt, x = _four_layers_next_forward()
    held = list(model.module.parameters())
    shadow = [p.detach().clone() for p in held]
    model(x).square().mean().backward()
    with _stepped_behind_slow_all_gathers(model, opt) as conclusive, torch.no_grad():
        for s, p in zip(shadow, held):
            s.copy_(p)  # as torch_ema's update reads them
    torch.cuda.synchronize()
    expected = _four_layers_after_one_step(x)
    return {"conclusive": conclusive,
            "diff": max(float((a - b).abs().max()) for a, b in zip(shadow, expected))}


CASES = {f.__name__: f for f in (hierarchical_partial_sum, slow_link_same_result,
                                 shard_round_trip, profile_reads_gpu_time,
                                 profile_times_forward_waits_on_gpu, timeline_enabled_mid_run,
                                 side_stream_read_orders_the_forward,
                                 moved_to_the_cpu_right_after_the_step,
                                 held_read_right_after_the_step)}

if __name__ == "__main__":
    torch.cuda.set_device(0)
    # No port, no MASTER_ADDR inherited from a surrounding job: a store in this process.
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        print("FGPSDP_RESULT " + json.dumps(CASES[sys.argv[1]]()), flush=True)
    finally:
        dist.destroy_process_group()
