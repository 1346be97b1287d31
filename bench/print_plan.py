"""Print the two-stage overlap plan for a workload.

    python bench/print_plan.py --workload gpt2 --world-size 4 --local-size 2 --rate-gbit 1

Builds the workload's buckets as a ``--world-size`` run would, prints the plans
the runtime starts with (``overlap_plan="auto"``: nothing speculated while it
profiles; ``"layout"``: every bucket but the last in stage 1), then profiles a
few single-process iterations (when each bucket's gradients are ready in
backward) and prints the plan the link cost model derives from that profile, as
JSON too. A single process cannot time what a run's forwards wait for the
all-gathers, which prunes stage 1 in the runtime's own profile (see
``plan.profile_plan``): its stage 1 here is the candidates, the most a run
would speculate.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from workloads import CONFIGS, WORKLOADS, build_model, loss_fn, make_batch  # noqa: E402

import fgpsdp_runtime as fgp  # noqa: E402
from fgpsdp_runtime.layout import (ParamInfo, default_bucket_cap_mb,  # noqa: E402
                                   first_bucket_cap_bytes, plan_buckets)
from fgpsdp_runtime.plan import (BucketProfile, LinkModel, layout_plan, profile_plan,  # noqa: E402
                                 profiling_plan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="gpt2", choices=WORKLOADS)
    parser.add_argument("--size", default="cpu", choices=["cpu", "full"])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--local-size", type=int, default=2)
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="default: fgpsdp's own (sized to the model)")
    parser.add_argument("--rate-gbit", type=float, default=1.0,
                        help="inter-node link rate (on one node: its ranks' exchange)")
    parser.add_argument("--latency-ms", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if not 1 <= args.local_size <= args.world_size or args.world_size % args.local_size:
        parser.error(f"--local-size must divide --world-size (got {args.local_size} and "
                     f"{args.world_size})")

    cfg = CONFIGS[(args.workload, args.size)]
    torch.manual_seed(0)
    module = build_model(cfg)
    params = [p for p in module.parameters() if p.requires_grad]
    if args.bucket_cap_mb is None:
        args.bucket_cap_mb = default_bucket_cap_mb(sum(p.numel() * p.element_size() for p in params))
    layouts = plan_buckets([ParamInfo(p.numel(), str(p.dtype).replace("torch.", ""),
                                      p.element_size()) for p in params],
                           bucket_cap_bytes=int(args.bucket_cap_mb * 2**20),
                           world_size=args.world_size,
                           first_bucket_cap_bytes=first_bucket_cap_bytes())
    order = tuple(reversed(range(len(layouts))))
    print(f"{args.workload} ({args.size}): {sum(p.numel() for p in params):,} parameters, "
          f"{len(layouts)} buckets at {args.bucket_cap_mb:.2f} MB")
    print("start plan (auto, while profiling):", profiling_plan(len(layouts), order))
    print("start plan (layout):", layout_plan(len(layouts), order))

    # Profile: when does backward finish each bucket (single process).
    # One process: an in-process store, no port (two profiles run side by side would
    # race for a fixed one).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=120))
    model = fgp.DistributedDataParallel(module, bucket_cap_mb=args.bucket_cap_mb,
                                        schedule="overlap_backward")
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-4)
    ready: dict[int, float] = {}
    start = [0.0]
    model.reducer.bucket_ready_listeners.append(
        lambda b: ready.__setitem__(b, time.perf_counter() - start[0]))
    lf = loss_fn(cfg)
    for step in range(args.steps):
        x, y = make_batch(cfg, step, 0)
        loss = lf(model(x), y)
        ready.clear()
        start[0] = time.perf_counter()
        loss.backward()
        backward_s = time.perf_counter() - start[0]
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
    profiles = [BucketProfile(bytes=l.padded_numel * l.element_size, ready_s=ready.get(b, backward_s))
                for b, l in enumerate(layouts)]
    for b, p in enumerate(profiles):
        print(f"  bucket {b}: {p.bytes / 2**20:7.1f} MiB ready at {p.ready_s * 1e3:7.1f} ms")
    print(f"  backward: {backward_s * 1e3:.1f} ms (single process on this machine)")
    link = LinkModel(latency_s=args.latency_ms / 1e3, bandwidth_Bps=args.rate_gbit * 1e9 / 8)
    nodes = args.world_size // args.local_size
    # Each rail carries (nodes-1)/nodes of 1/local_size of a bucket per phase, and a
    # node's local_size rails share its one network link: (nodes-1)/nodes per node.
    # On one node the exchange is flat: each rank sends (world-1)/world of a bucket
    # (before, 0 here: every bucket looked free to send, all but the last in stage 1).
    fraction = (nodes - 1) / nodes if nodes > 1 else (args.world_size - 1) / args.world_size
    plan = profile_plan(profiles, backward_s, order, link=link, reduce_fraction=fraction)
    print("profile plan:", plan)
    print(plan.to_json())


if __name__ == "__main__":
    main()
