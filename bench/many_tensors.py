"""Per-step CPU overhead on a model of many small parameter tensors, against torch DDP.

Models with thousands of tensors (per-channel scales, many thin layers) put the
per-parameter Python work in front: gradient hooks, packing, the optimizer's
slice bookkeeping. The compute is kept tiny so that this overhead is what is
timed; no network shaping (ranks on one machine, shared memory between them).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/many_tensors.py \\
        --tensors 5000 --systems ddp,two_stage,next_forward,serial

``two_stage_stage1`` is two_stage with the layout plan (``overlap_plan="layout"``):
stage 1 holds every bucket from the first step, so its speculative steps (and
their undo records) run on every step, as they do where a profiled plan puts
buckets in stage 1 and the gradient norm does not clip.

Rank 0 prints a table: median wall time and CPU time (this process, all its
threads) per step, over the timed steps, and the largest parameter difference
to torch DDP at the end (AdamW, no clipping: bitwise on 2 ranks).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import fgpsdp_runtime as fgp

WIDTH = 64


class Scales(nn.Module):
    """A few small parameters, each a (rows, WIDTH) matrix read as a per-channel scale."""

    def __init__(self, rows: list[int]):
        super().__init__()
        self.scales = nn.ParameterList(nn.Parameter(torch.randn(r, WIDTH) * 0.02) for r in rows)

    def forward(self, x):
        for p in self.scales:
            x = x * (1 + p.mean(0))
        return x


def build(tensors: int, per_module: int = 16) -> nn.Module:
    torch.manual_seed(0)
    # 1 to 64 rows (64 to 4096 elements), log-uniform.
    rows = torch.exp(torch.rand(tensors) * torch.log(torch.tensor(64.0))).long().clamp(1, 64)
    rows = rows.tolist()
    return nn.Sequential(*[Scales(rows[i:i + per_module])
                           for i in range(0, tensors, per_module)])


def train(system: str, tensors: int, steps: int, warmup: int, bucket_cap_mb=None):
    module = build(tensors)
    if system == "ddp":
        model = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif system == "two_stage_stage1":
        # two_stage with every bucket in stage 1 from the first step (the layout
        # plan): what its speculative steps cost on the host.
        model = fgp.DistributedDataParallel(module, schedule="two_stage", overlap_plan="layout",
                                            bucket_cap_mb=bucket_cap_mb)
        opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    else:
        model = fgp.DistributedDataParallel(module, schedule=system, bucket_cap_mb=bucket_cap_mb)
        opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    walls, cpus = [], []
    generator = torch.Generator().manual_seed(dist.get_rank())
    for step in range(warmup + steps):
        x = torch.randn(8, WIDTH, generator=generator)
        wall, cpu = time.perf_counter(), time.process_time()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= warmup:
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    if system != "ddp":
        model.synchronize()
    params = [p.detach().clone() for p in module.parameters()]
    del model, opt
    return statistics.median(walls), statistics.median(cpus), params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=5000)
    parser.add_argument("--systems", default="ddp,two_stage,next_forward,serial")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="every system's bucket cap (default: each one's own)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rows, reference = [], None
    systems = args.systems.split(",")
    if "ddp" in systems:  # the reference first
        systems.remove("ddp")
        systems.insert(0, "ddp")
    for system in systems:
        wall, cpu, params = train(system, args.tensors, args.steps, args.warmup,
                                  args.bucket_cap_mb)
        if system == "ddp":
            reference = params
        diff = max(float((a - b).abs().max()) for a, b in zip(params, reference)) \
            if reference is not None else float("nan")
        rows.append((system, wall, cpu, diff))
        dist.barrier()
    if dist.get_rank() == 0:
        print(f"{args.tensors} tensors, {dist.get_world_size()} ranks, median of {args.steps} "
              f"steps after {args.warmup}, bucket_cap_mb {args.bucket_cap_mb}, "
              f"torch {torch.__version__}")
        print(f"{'system':<18}{'wall ms/step':>14}{'CPU ms/step':>14}{'max |diff| vs ddp':>20}")
        for system, wall, cpu, diff in rows:
            print(f"{system:<18}{wall * 1e3:>14.1f}{cpu * 1e3:>14.1f}{diff:>20.3g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
