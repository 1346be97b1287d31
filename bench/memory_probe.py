"""Resident memory per rank, step by step, for one system on one workload.

    python bench/memory_probe.py --workload gpt2 --systems ddp,fgpsdp --world-size 4

Spawns ``--world-size`` CPU ranks on this machine (gloo over loopback, no
network shaping: memory does not depend on the link) and prints, per system,
the resident set after construction and after each step, and the peak
(``ru_maxrss``), for the rank with the highest peak. Each system runs in fresh
processes, so peaks do not carry over.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from systems import build_system, is_system, set_max_norm  # noqa: E402
from workloads import CONFIGS, WORKLOADS, build_model, loss_fn, make_batch  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def spawn_ranks(target, world_size: int, args) -> list:
    """``target(rank, world_size, args, queue)`` in ``world_size`` fresh processes (so
    that no peak carries over from another run); what each put on the queue."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world_size, args, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    return results


def _rank(rank, world, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port),
                      LOCAL_WORLD_SIZE=str(args.local_size), LOCAL_RANK=str(rank % args.local_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    cfg = CONFIGS[(args.workload, args.size)]
    set_max_norm(args.max_norm)  # a spawned process starts from the module default
    torch.manual_seed(0)
    model = build_model(cfg)
    before = rss_mib()
    system = build_system(args.system, model, loss_fn(cfg), cfg.batch)
    trace = [("model", before), ("built", rss_mib())]
    for step in range(args.steps):
        x, y = make_batch(cfg, step, rank)
        system.train_step(x, y)
        trace.append((f"step {step + 1}", rss_mib()))
    system.finish_step()
    dist.barrier()
    queue.put((rank, trace, peak_mib(), system.schedule_info()))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="gpt2", choices=WORKLOADS)
    parser.add_argument("--size", default="cpu", choices=["cpu", "full"])
    parser.add_argument("--systems", default="ddp,fgpsdp")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--local-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--port", type=int, default=29731)
    parser.add_argument("--max-norm", type=float, default=1.0,
                        help="every system clips at this total norm (1e9: never clips, so "
                             "fgpsdp's two_stage keeps speculating)")
    args = parser.parse_args()
    for i, system in enumerate(s for s in args.systems.split(",") if s):
        if not is_system(system):
            parser.error(f"unknown system {system}")
        args.system, args.port = system, args.port + i
        results = spawn_ranks(_rank, args.world_size, args)
        rank, trace, peak, info = max(results, key=lambda r: r[2])
        steps = " ".join(f"{rss:.0f}" for _, rss in trace)
        print(f"{system:<20} peak {peak:7.0f} MiB (rank {rank}); RSS MiB after "
              f"{', '.join(name for name, _ in trace)}: {steps}", flush=True)
        if info.get("plan"):
            plan = json.loads(info["plan"])
            predicted = plan.get("predicted") or {}
            undo = predicted.get("undo_bytes")
            print(f"{'':<20} plan from {plan['source']}: stage 1 = {plan['stage1']} of "
                  f"candidates {predicted.get('stage1_candidates', '-')}, undo records "
                  f"{'-' if undo is None else f'{undo / 2**20:.1f} MiB'}; speculative steps "
                  f"committed {info['speculative_commits']}, rolled back "
                  f"{info['speculative_rollbacks']} (rank {rank})", flush=True)


if __name__ == "__main__":
    main()
