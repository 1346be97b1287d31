"""Inter-node reduce-scatter / all-gather on the emulated link: gloo's collectives vs fgpsdp's.

    sudo bench/cluster.sh run 1gbit -- 'OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run \
        --nnodes=$NNODES --nproc_per_node=2 --node_rank=$NODE_RANK --master_addr=$MASTER_ADDR \
        --master_port=29533 bench/rail_collectives.py --mib 25'

Four ranks on two emulated nodes; ranks with the same local index form a rail
(the inter-node group of the hierarchy). Each operation runs ``--iters`` times
on a float32 buffer of ``--mib`` MiB, first on rail 0 alone, then on both rails
at once (they share the one shaped link, as the hierarchy's rails do here).
Rank 0 prints ms per op, the rate each rail got (bytes one rank sends / time)
and CPU ms per op (every thread of the process). The gloo rows are what
fgpsdp's exchange ran before: all_to_all_single plus a sum, and all_gather_into_tensor;
"all-gather sends first" is fgpsdp's all-gather as it posted its messages before
receives went first (each piece's send, then its receive).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from node_collectives import process_cpu_seconds  # bench/ is on the path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=25.0)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--piece-kib", type=float, default=None,
                        help="fgpsdp's message size (default: gloo_collectives.PIECE_BYTES)")
    args = parser.parse_args()
    from fgpsdp_runtime import gloo_collectives
    from fgpsdp_runtime.group_collectives import all_gather_blocking, reduce_scatter_blocking

    if args.piece_kib is not None:
        gloo_collectives.PIECE_BYTES = int(args.piece_kib * 1024)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if dist.get_world_size() != 4:
        raise SystemExit("run on 2 nodes x 2 ranks")
    rails = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    rail = rails[rank % 2]
    numel = int(args.mib * 2**20 / 4) // 2 * 2
    bucket = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    received, gathered, chunk = torch.empty(numel), torch.empty(numel), torch.empty(numel // 2)

    def gloo_reduce_scatter():
        dist.all_to_all_single(received, bucket, group=rail)
        torch.sum(received.view(2, -1), dim=0, out=chunk)

    def all_gather_sends_first():
        # fgpsdp's order up to d13d0af: each piece's send, then its
        # receive ([Note: receives first] in gloo_collectives.py).
        me = dist.get_rank(rail)
        peer = dist.get_global_rank(rail, 1 - me)
        chunks = gathered.view(2, -1)
        chunks[me].copy_(bucket[:numel // 2])
        piece = max(1, gloo_collectives.PIECE_BYTES // 4)
        works = []
        for i, (mine, theirs) in enumerate(zip(chunks[me].split(piece),
                                               chunks[1 - me].split(piece))):
            works.append(dist.isend(mine, peer, group=rail, tag=i))
            works.append(dist.irecv(theirs, peer, group=rail, tag=i))
        for work in works:
            work.wait()

    operations = {
        "reduce-scatter gloo": gloo_reduce_scatter,
        "reduce-scatter fgpsdp": lambda: reduce_scatter_blocking(rail, chunk, bucket),
        "all-gather gloo": lambda: dist.all_gather_into_tensor(gathered, bucket[:numel // 2],
                                                                group=rail),
        "all-gather fgpsdp": lambda: all_gather_blocking(rail, gathered, bucket[:numel // 2]),
        "all-gather sends first": all_gather_sends_first,
    }
    sent_bytes = numel * 4 / 2  # one rank sends half the buffer in either operation
    rows = []
    for name, op in operations.items():
        for rails_active in (1, 2):
            active = rank % 2 < rails_active
            if active:
                op()  # warm: connections, buffers
            dist.barrier()
            cpu, wall = process_cpu_seconds(), time.perf_counter()
            if active:
                for _ in range(args.iters):
                    op()
            wall = (time.perf_counter() - wall) / args.iters
            cpu = (process_cpu_seconds() - cpu) / args.iters
            rows.append((name, rails_active, wall, cpu) if active else None)
            dist.barrier()
    everyone = [None] * 4
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        print(f"{args.mib:g} MiB float32 buffer, {args.iters} ops; rail 0 = ranks 0, 2; "
              f"fgpsdp pieces of {gloo_collectives.PIECE_BYTES / 1024:g} KiB; "
              f"per rank: ms per op, Gbit/s its rail got, CPU ms per op")
        print(f"{'operation':24s} {'rails':>5s} {'ms':>7s} {'Gbit/s':>7s} {'CPU ms':>7s}")
        for i, row in enumerate(rows):
            walls = [r[i][2] for r in everyone if r[i] is not None]
            cpus = [r[i][3] for r in everyone if r[i] is not None]
            slowest = max(walls)
            print(f"{row[0]:24s} {row[1]:5d} {slowest * 1e3:7.0f} "
                  f"{sent_bytes * 8 / slowest / 1e9:7.2f} {sum(cpus) / len(cpus) * 1e3:7.0f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
