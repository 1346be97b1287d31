"""``opt.step()``'s time on a small model: its forward-ordered step in one inner step
per bucket (``FGPSDP_STEP_CHUNK_MIN_ELEMENTS=1``, as before 2026-12-05) against the
default (one inner step per 2**18 elements of a rank's slices, here one), alternating
step by step in one process so that the host's drift falls on both alike.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/step_chunks.py

The model is an MLP of 115k parameters in small buckets (``--bucket-cap-mb``);
``next_forward`` (no speculative steps: every bucket is stepped in ``opt.step()``).
Rank 0 prints, per setting, the median time of ``opt.step()`` (its inner steps and
the all-gathers it queues; the forward waits for those) and of the whole step, and
the median ratio of the pairs (one step of each, in turn).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import fgpsdp_runtime as fgp
from fgpsdp_runtime.step_chunks import step_chunk_min_elements


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="timed steps of each setting")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--bucket-cap-mb", type=float, default=0.05)
    parser.add_argument("--schedule", default="next_forward")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [nn.Linear(64, 160), nn.GELU()]
    for _ in range(4):
        layers += [nn.Linear(160, 160), nn.GELU()]
    module = nn.Sequential(*layers, nn.Linear(160, 10))
    model = fgp.DistributedDataParallel(module, bucket_cap_mb=args.bucket_cap_mb,
                                        schedule=args.schedule)
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    settings = {"per bucket": 1, "default": step_chunk_min_elements()}
    generator = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(16, 64, generator=generator)
    y = torch.randint(0, 10, (16,), generator=generator)
    times = {name: ([], []) for name in settings}  # (opt.step(), whole step)
    for step in range(2 * (args.warmup + args.steps)):
        name = list(settings)[step % 2]
        opt._step_chunk_min_elements = settings[name]
        start = time.perf_counter()
        nn.functional.cross_entropy(model(x), y).backward()
        before_step = time.perf_counter()
        opt.step()
        after_step = time.perf_counter()
        opt.zero_grad()
        if step >= 2 * args.warmup:
            times[name][0].append(after_step - before_step)
            times[name][1].append(time.perf_counter() - start)
    model.synchronize()
    if dist.get_rank() == 0:
        print(f"{sum(p.numel() for p in module.parameters())} parameters, "
              f"{len(model.buckets)} buckets, {dist.get_world_size()} ranks, {args.schedule}, "
              f"{args.steps} steps of each setting after {args.warmup}, torch {torch.__version__}")
        print(f"{'setting':<12}{'opt.step() ms':>15}{'whole step ms':>15}")
        for name, (steps, wholes) in times.items():
            print(f"{name:<12}{statistics.median(steps) * 1e3:>15.3f}"
                  f"{statistics.median(wholes) * 1e3:>15.3f}")
        (a_step, a_whole), (b_step, b_whole) = times["default"], times["per bucket"]
        print("default / per bucket, median of the pairs: opt.step() "
              f"{statistics.median(a / b for a, b in zip(a_step, b_step)):.3f}, whole step "
              f"{statistics.median(a / b for a, b in zip(a_whole, b_whole)):.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
