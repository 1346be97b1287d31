"""CPU time of one intra-node reduce-scatter / all-gather: gloo (TCP loopback) vs shared memory.

    python bench/node_collectives.py --ranks 2 --mib 16 --iters 20

Spawns ``--ranks`` CPU processes on this machine, runs each collective
``--iters`` times on a float32 bucket of ``--mib`` MiB through both paths
(fgpsdp_runtime.comm's gloo path, fgpsdp_runtime.shared_memory), checks that
both give the same bytes, and prints per-rank CPU milliseconds per operation
(process CPU time, every thread: gloo's transport threads included) and wall
milliseconds.
"""
from __future__ import annotations

import argparse
import os
import resource
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def process_cpu_seconds() -> float:
    """CPU seconds of this process so far, every thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _measure(fn, iters: int) -> tuple[float, float]:
    fn()  # warm: maps the region, sizes gloo's buffers
    dist.barrier()
    cpu, wall = process_cpu_seconds(), time.perf_counter()
    for _ in range(iters):
        fn()
    cpu_ms = (process_cpu_seconds() - cpu) / iters * 1e3
    return cpu_ms, (time.perf_counter() - wall) / iters * 1e3


def _rank(rank: int, world: int, port: int, mib: float, iters: int, queue) -> None:
    from fgpsdp_runtime.group_collectives import all_gather_blocking, reduce_scatter_blocking
    from fgpsdp_runtime.shared_memory import SharedMemoryCollectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    group = dist.new_group(list(range(world)))
    numel = int(mib * 2**20 / 4) // world * world
    bucket = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    chunk_gloo, chunk_shm = torch.empty(numel // world), torch.empty(numel // world)
    gathered_gloo, gathered_shm = torch.empty(numel), torch.empty(numel)
    rs, ag = SharedMemoryCollectives(group), SharedMemoryCollectives(group)
    rows = {
        "reduce-scatter gloo": _measure(
            lambda: reduce_scatter_blocking(group, chunk_gloo, bucket), iters),
        "reduce-scatter shm": _measure(lambda: rs.reduce_scatter(chunk_shm, bucket), iters),
        "all-gather gloo": _measure(
            lambda: all_gather_blocking(group, gathered_gloo, chunk_gloo), iters),
        "all-gather shm": _measure(lambda: ag.all_gather(gathered_shm, chunk_gloo), iters),
    }
    same = torch.equal(chunk_gloo, chunk_shm) and torch.equal(gathered_gloo, gathered_shm)
    queue.put((rank, rows, same))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mib", type=float, default=16.0, help="bucket size (float32)")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args.mib, args.iters, queue))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    results = sorted(queue.get() for _ in procs)
    for p in procs:
        p.join()
    print(f"{args.ranks} ranks, {args.mib:g} MiB float32 bucket, {args.iters} ops each; "
          f"ms per op per rank (CPU: all threads of the process)")
    print(f"{'operation':24s} " + " ".join(f"rank{r} CPU  wall" for r, *_ in results))
    for name in results[0][1]:
        print(f"{name:24s} " + " ".join(f"{rows[name][0]:9.1f} {rows[name][1]:5.1f}"
                                        for _, rows, _ in results))
    print("same bytes on both paths:", all(same for *_, same in results))


if __name__ == "__main__":
    main()
