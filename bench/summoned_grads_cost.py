"""What ``opt.summon_full_grads()`` costs per step: fgpsdp's step on one workload with no
block, with a block that reads one gradient norm, and with a block that edits every
gradient (a mask), beside ``opt.grad_norms()`` (the per-parameter read, one all-reduce
of a float each) and torch DDP editing its own ``p.grad``.

    python bench/summoned_grads_cost.py --workload gpt2 --world-size 4 --local-size 2

Spawns ``--world-size`` CPU ranks on this machine (gloo over loopback, no network
shaping: the block's all-gather runs at the machine's memory and loopback speed, not a
cluster's). Every variant runs ``--rounds`` times in fresh processes, the variants
alternating within a round; each run times ``--steps`` steps after ``--warmup`` (each
step ends with a barrier, so every rank's step is timed alike) and reports rank 0's
median step and median block (the time inside ``with opt.summon_full_grads():``,
gathering and writing back included). Prints one line per run and a table of the
medians over the rounds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import fgpsdp_runtime as fgp  # noqa: E402
from memory_probe import spawn_ranks  # noqa: E402
from systems import ADAMW, MAX_NORM  # noqa: E402
from workloads import CONFIGS, WORKLOADS, build_model, loss_fn, make_batch  # noqa: E402

VARIANTS = ("none", "read", "edit", "grad_norms", "ddp_edit")


def _masks(module: nn.Module) -> list[torch.Tensor]:
    """A fixed mask per parameter, as a loop keeping some elements' gradients at 0."""
    g = torch.Generator().manual_seed(0)
    return [(torch.rand(p.shape, generator=g) > 0.1).to(p.dtype) for p in module.parameters()]


def _rank(rank, world, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port),
                      LOCAL_WORLD_SIZE=str(args.local_size),
                      LOCAL_RANK=str(rank % args.local_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    cfg = CONFIGS[(args.workload, "cpu")]
    torch.manual_seed(0)
    module = build_model(cfg)
    criterion = loss_fn(cfg)
    masks = _masks(module)
    params = list(module.parameters())
    if args.variant == "ddp_edit":
        model = nn.parallel.DistributedDataParallel(module)
        opt = torch.optim.AdamW(module.parameters(), **ADAMW)
    else:
        model = fgp.DistributedDataParallel(module)
        opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, max_grad_norm=MAX_NORM, **ADAMW)
    steps, blocks = [], []
    for step in range(args.warmup + args.steps):
        x, y = make_batch(cfg, step, rank)
        start = time.perf_counter()
        criterion(model(x), y).backward()
        block_start = time.perf_counter()
        if args.variant == "read":
            with opt.summon_full_grads():
                float(params[0].grad.norm())
        elif args.variant == "edit":
            with opt.summon_full_grads():
                for p, mask in zip(params, masks):
                    p.grad.mul_(mask)
        elif args.variant == "grad_norms":
            opt.grad_norms()
        elif args.variant == "ddp_edit":
            with torch.no_grad():
                for p, mask in zip(params, masks):
                    p.grad.mul_(mask)
            torch.nn.utils.clip_grad_norm_(module.parameters(), MAX_NORM)
        block_end = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        if step >= args.warmup:
            steps.append(time.perf_counter() - start)
            blocks.append(block_end - block_start)
    if args.variant != "ddp_edit":
        model.synchronize()
    dist.barrier()
    queue.put((rank, statistics.median(steps), statistics.median(blocks)))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="gpt2", choices=WORKLOADS)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--local-size", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=4,
                        help="untimed steps first (fgpsdp profiles steps 2-3)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=29851)
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            parser.error(f"unknown variant {v}")
    results: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    port = args.port
    for round_ in range(args.rounds):
        for variant in variants:
            args.variant, args.port = variant, port
            port += 1
            per_rank = sorted(spawn_ranks(_rank, args.world_size, args))
            _, step, block = per_rank[0]
            results[variant].append((step, block))
            print(f"round {round_ + 1} {variant:<12} step {step * 1e3:8.1f} ms  "
                  f"block {block * 1e3:7.1f} ms (rank 0 medians)", flush=True)
    print(f"\n{args.workload}, {args.world_size} ranks ({args.local_size} per node), "
          f"medians over {args.rounds} rounds of rank 0's median over {args.steps} steps")
    print("| variant | step (ms) | block (ms) |\n|---|---:|---:|")
    for variant in variants:
        step = statistics.median(s for s, _ in results[variant])
        block = statistics.median(b for _, b in results[variant])
        print(f"| {variant} | {step * 1e3:.1f} | {block * 1e3:.1f} |")


if __name__ == "__main__":
    main()
