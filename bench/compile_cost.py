"""What torch.compile costs at the start of training, each layer compiled in place.

    python bench/compile_cost.py --workload gpt2 --backend inductor --steps 6

Spawns 2 CPU ranks (gloo over loopback) once per system. Each builds the workload
(bench/workloads.py, its CPU size), compiles each layer of
``compiled_layers(model)`` in place (``layer.compile(backend=...)``, as the
``fgpsdp_compiled_layers`` system of bench/systems.py and torchtune do), wraps it,
and trains ``--steps`` steps of AdamW clipped at 1.0 on the workload's synthetic
data. Systems: ``ddp`` (torch DDP, ``clip_grad_norm_``), ``fgpsdp_next_forward``
and ``fgpsdp_two_stage``. Printed per system, for rank 0: the graphs dynamo made
(``unique_graphs``), the seconds each step took (the first steps carry the
compiles), the sum over the steps before the last two, the mean of the last two, and
the last step's loss.

Inductor's caches start empty for every system (a fresh ``TORCHINDUCTOR_CACHE_DIR``
per run, its default caches on), as on a first run: a graph compiled twice in one
run may still find its kernels in the cache the first compile filled.

The script imports the library from the checkout it lies in: copied into an older
checkout, it measures that one.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
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
from systems import ADAMW, MAX_NORM, compiled_layers  # noqa: E402
from workloads import CONFIGS, build_model, loss_fn, make_batch  # noqa: E402

SYSTEMS = ("ddp", "fgpsdp_next_forward", "fgpsdp_two_stage")


def _rank(rank, world, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(args.cache_dir, f"rank{rank}")
    import torch._dynamo.utils
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=900))
    cfg = CONFIGS[(args.workload, "cpu")]
    torch.manual_seed(0)
    model = build_model(cfg)
    for layer in compiled_layers(model) if args.backend != "none" else ():
        layer.compile(backend=args.backend)
    if args.system == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(wrapped.parameters(), **ADAMW)
    else:
        wrapped = fgp.DistributedDataParallel(model, schedule=args.system[len("fgpsdp_"):])
        opt = fgp.ShardedOptimizer(wrapped, torch.optim.AdamW, max_grad_norm=MAX_NORM, **ADAMW)
    criterion = loss_fn(cfg)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    steps = []
    for step in range(args.steps):
        x, y = make_batch(cfg, step, rank)
        start = time.perf_counter()
        loss = criterion(wrapped(x), y)
        loss.backward()
        if args.system == "ddp":
            torch.nn.utils.clip_grad_norm_(wrapped.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.system != "ddp":
            wrapped.synchronize()  # the step's all-gathers landed: its whole cost
        steps.append(time.perf_counter() - start)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before
    dist.destroy_process_group()
    queue.put({"rank": rank, "graphs": graphs, "steps": steps, "loss": float(loss.detach())})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="gpt2")
    parser.add_argument("--backend", default="inductor", help="none: nothing compiled")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--port", type=int, default=29631)
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3")
    print(f"torch {torch.__version__}, workload {args.workload}, backend {args.backend}, "
          f"2 CPU ranks, layers compiled in place, {args.steps} steps")
    print("| system | graphs | step seconds | first steps sum | last two mean | last loss |")
    print("|---|---:|---|---:|---:|---:|")
    for system in args.systems.split(","):
        args.system = system
        with tempfile.TemporaryDirectory(prefix="compile_cost_") as cache_dir:
            args.cache_dir = cache_dir
            results = sorted(spawn_ranks(_rank, 2, args), key=lambda r: r["rank"])
        r0 = results[0]
        steps = r0["steps"]
        print(f"| {system} | {r0['graphs']} | {' '.join(f'{s:.2f}' for s in steps)} | "
              f"{sum(steps[:-2]):.1f} | {sum(steps[-2:]) / 2:.3f} | {r0['loss']:.5f} |",
              flush=True)


if __name__ == "__main__":
    main()
