"""Stage-1 all-gathers yield the bottleneck link to reduce-scatters."""
from __future__ import annotations

import threading
import time

import torch

from fgpsdp_runtime.comm import LinkWorker

from .dist_harness import run_distributed


def test_wait_idle_waits_for_running_and_queued_tasks():
    worker = LinkWorker("test-idle", torch.device("cpu"))
    release = threading.Event()
    finished = []
    worker.submit(lambda: release.wait(5))
    worker.submit(lambda: finished.append(time.perf_counter()))
    waited = threading.Event()
    waiter = threading.Thread(target=lambda: (worker.wait_idle(), waited.set()))
    waiter.start()
    assert not waited.wait(0.2)  # both tasks still pending
    release.set()
    assert waited.wait(5)
    assert finished  # the queued task ran before wait_idle returned
    worker.wait_idle()  # idle: returns at once
    worker.close()
    worker.join(5)


def test_wait_idle_counts_failed_tasks():
    worker = LinkWorker("test-idle-error", torch.device("cpu"))
    future = worker.submit(lambda: 1 / 0)
    worker.wait_idle()
    assert isinstance(future.exception(), ZeroDivisionError)
    worker.close()
    worker.join(5)


def _order_of_phases(rank, world, local_size, yield_to_rs):
    """A big reduce-scatter, then a small all-gather; when did each inter phase run?"""
    import torch.distributed as dist

    from fgpsdp_runtime.comm import CommStats, FlatExchange, HierarchicalExchange
    from fgpsdp_runtime.topology import NodeLayout, create_link_groups
    from fgpsdp_runtime.tracing import Timeline

    timeline = Timeline(rank)
    timeline.enable()
    if local_size:
        layout = NodeLayout(world_size=world, local_size=local_size, hierarchical=True)
        exchange = HierarchicalExchange(layout, create_link_groups(layout, None),
                                        create_link_groups(layout, None), torch.device("cpu"),
                                        CommStats(), timeline)
        rs_lane, ag_lane = "inter-rs", "inter-ag"
    else:
        exchange = FlatExchange(dist.new_group(), dist.new_group(), torch.device("cpu"),
                                CommStats(), timeline)
        rs_lane, ag_lane = "flat-rs", "flat-ag"
    n = 4_000_000 * world
    rs_ops = [exchange.start_reduce_scatter(torch.empty(n // world), torch.ones(n), label=f"b{i}")
              for i in range(3)]
    flat = torch.zeros(world * 8)
    ag = exchange.start_all_gather(flat, flat[rank * 8:(rank + 1) * 8] + 0, label="b9",
                                   yield_to_reduce_scatters=yield_to_rs)
    for op in rs_ops:
        op.wait()
    ag.wait()
    exchange.close()
    spans = timeline.spans()
    rs_end = max(e for lane, name, s, e in spans if lane == rs_lane and name.startswith("RS"))
    ag_start = min(s for lane, name, s, e in spans if lane == ag_lane and name == "AG b9")
    return ag_start >= rs_end


def test_yielding_all_gather_starts_after_the_reduce_scatters():
    # Flat and 2 nodes x 2: the bottleneck phase waits for this rank's reduce-scatters.
    assert all(run_distributed(2, _order_of_phases, 0, True))
    assert all(run_distributed(4, _order_of_phases, 2, True))
    # Without yielding it starts at once, beside the first reduce-scatter: the check can fail.
    assert not any(run_distributed(2, _order_of_phases, 0, False))
