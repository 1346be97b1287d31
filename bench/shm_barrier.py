"""The shared-memory barrier: counts in the region against gloo's one-element all-reduce.

    python bench/shm_barrier.py --ranks 2 --rounds 5

Spawns ``--ranks`` CPU processes on this machine (one node, so the wrapper's
exchange runs through shared memory) and measures, per barrier kind
(fgpsdp_runtime/shm_barrier.py; FGPSDP_SHM_BARRIER=gloo is the old one):

- a barrier alone, and a reduce-scatter / all-gather of a 30 KB bucket
  (microseconds per operation, wall and process CPU, rank 0);
- a training step of a 20 x Linear(64, 64) MLP, AdamW, batch 16, at
  ``--bucket-mb`` (0.03: 10 buckets), the default schedule (two_stage), where the
  fixed cost per bucket shows, beside torch DDP on the same model (milliseconds
  per step, rank 0).

Rounds alternate the kinds; medians over rounds are printed.
"""
from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

KINDS = ("native", "gloo")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed(fn, iters: int) -> tuple[float, float]:
    """(wall, CPU) seconds per call of ``fn``, started together on every rank."""
    dist.barrier()
    cpu, wall = _cpu_s(), time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - wall) / iters, (_cpu_s() - cpu) / iters


def _with_barrier(kind: str, build):
    """``build()`` with the barrier kind chosen (read when the shared-memory links are made)."""
    os.environ["FGPSDP_SHM_BARRIER"] = kind
    try:
        return build()
    finally:
        del os.environ["FGPSDP_SHM_BARRIER"]


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(20):
        layers += [torch.nn.Linear(64, 64), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(64, 8))


def _rank(rank: int, world: int, port: int, args, queue) -> None:
    import fgpsdp_runtime as fgp
    from fgpsdp_runtime.shared_memory import SharedMemoryCollectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    group = dist.new_group(list(range(world)))
    numel = 7680 // world * world  # 30 KB of float32
    bucket, chunk, gathered = torch.randn(numel), torch.empty(numel // world), torch.empty(numel)
    links, wrappers = {}, {}
    for kind in KINDS:
        links[kind] = _with_barrier(kind, lambda: SharedMemoryCollectives(group))
        links[kind].prepare(world)
        assert (links[kind]._region_barrier is not None) == (kind == "native"), kind
        model = _with_barrier(kind, lambda: fgp.DistributedDataParallel(
            _mlp(), bucket_cap_mb=args.bucket_mb))
        assert model.node_transport == "shared_memory"
        wrappers[kind] = (model, fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3))
    ddp = torch.nn.parallel.DistributedDataParallel(_mlp())
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 8, (16,), generator=gen)

    def step(model, opt):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    rows: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for kind in KINDS:
            link = links[kind]
            model, opt = wrappers[kind]
            for name, fn, iters in (
                    (f"barrier alone, {kind}", link._barrier, args.iters),
                    (f"reduce-scatter 30 KB, {kind}",
                     lambda: link.reduce_scatter(chunk, bucket), args.iters),
                    (f"all-gather 30 KB, {kind}",
                     lambda: link.all_gather(gathered, chunk), args.iters),
                    (f"MLP step, fgpsdp, {kind} barrier", lambda: step(model, opt), args.steps)):
                fn()  # warm
                rows.setdefault(name, []).append(_timed(fn, iters))
        step(ddp, ddp_opt)
        rows.setdefault("MLP step, torch DDP", []).append(
            _timed(lambda: step(ddp, ddp_opt), args.steps))
    buckets = len(wrappers["native"][0]._buckets)
    if rank == 0:
        queue.put((rows, buckets))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=300, help="collectives per round")
    parser.add_argument("--steps", type=int, default=30, help="training steps per round")
    parser.add_argument("--bucket-mb", type=float, default=0.03)
    args = parser.parse_args()
    os.environ.pop("FGPSDP_SHM_BARRIER", None)
    os.environ.pop("LOCAL_WORLD_SIZE", None)  # one node
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args, queue))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    rows, buckets = queue.get()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"a rank exited with {p.exitcode}")
    print(f"{args.ranks} ranks on one node, torch {torch.__version__}, {os.cpu_count()} CPUs; "
          f"median of {args.rounds} rounds, rank 0; MLP: {buckets} buckets")
    print(f"{'operation':42s} {'wall':>10s} {'CPU':>10s}")
    for name, values in rows.items():
        wall = statistics.median(v[0] for v in values)
        cpu = statistics.median(v[1] for v in values)
        unit, scale = ("ms", 1e3) if "step" in name else ("us", 1e6)
        print(f"{name:42s} {wall * scale:8.1f}{unit} {cpu * scale:8.1f}{unit}")


if __name__ == "__main__":
    main()
