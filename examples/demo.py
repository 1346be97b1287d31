"""The main job: train a small GPT with fgpsdp beside torch DDP on CPU processes.

    python examples/demo.py --world-size 4 --steps 30

Both systems see the same data and the same AdamW + clipping; the table is
printed live by rank 0. At the end: optimizer-state bytes per rank and the
largest parameter difference between the two.
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTConfig, lm_loss, synthetic_batch  # noqa: E402

import fgpsdp_runtime as fgp  # noqa: E402


def float64_clip_(params, max_norm):
    grads = [p.grad for p in params if p.grad is not None]
    total = sum(float(g.double().square().sum()) for g in grads) ** 0.5
    coefficient = max_norm / (total + 1e-6)
    if coefficient < 1:
        for g in grads:
            g.mul_(coefficient)


def state_bytes(optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in optimizer.state.values()
               for t in s.values() if isinstance(t, torch.Tensor))


def run(rank: int, world_size: int, port: int, args) -> None:
    torch.set_num_threads(1)
    timeout = timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=args.layers, n_head=4,
                    d_model=args.width)
    torch.manual_seed(0)
    module = GPT(cfg)
    # The same bucket size for both: fgpsdp is not compared with itself at another.
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(module),
                                                    bucket_cap_mb=args.bucket_cap_mb)
    ours = fgp.DistributedDataParallel(module, bucket_cap_mb=args.bucket_cap_mb)
    hyper = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), **hyper)
    opt = fgp.ShardedOptimizer(ours, torch.optim.AdamW, max_grad_norm=1.0, **hyper)
    n_params = sum(p.numel() for p in module.parameters())
    if rank == 0:
        print(f"GPT {cfg.n_layer} layers, width {cfg.d_model}: {n_params:,} parameters; "
              f"{world_size} CPU processes (gloo), AdamW, clip 1.0, batch {args.batch}/rank")
        print(f"{'step':>4} | {'loss fgpsdp':>11} | {'loss DDP':>9} | {'ms fgpsdp':>9} | {'ms DDP':>7}")
        print("-" * 52, flush=True)
    times = {"fgpsdp": [], "ddp": []}
    for step in range(args.steps):
        x, y = synthetic_batch(cfg, args.batch, seed=1000 * step + rank)
        row = {}
        for name, model, optimizer in (("fgpsdp", ours, opt), ("ddp", ref, ref_opt)):
            dist.barrier()
            start = time.perf_counter()
            loss = lm_loss(model(x), y)
            loss.backward()
            if name == "ddp":
                float64_clip_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times[name].append(time.perf_counter() - start)
            row[name] = float(loss.detach())
        if rank == 0:
            print(f"{step:>4} | {row['fgpsdp']:>11.4f} | {row['ddp']:>9.4f} | "
                  f"{1e3 * times['fgpsdp'][-1]:>9.1f} | {1e3 * times['ddp'][-1]:>7.1f}", flush=True)
    ours.synchronize()
    diff = max(float((a.detach() - b.detach()).abs().max()) for a, b in zip(ours.module.parameters(),
                                                         ref.module.parameters()))
    mine = torch.tensor([state_bytes(opt), state_bytes(ref_opt)], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    diffs = [torch.zeros(1, dtype=torch.float64) for _ in range(world_size)]
    dist.all_gather(diffs, torch.tensor([diff], dtype=torch.float64))
    if rank == 0:
        print("-" * 52)
        # Step 0 includes warm-up; leave it out when there is another step to show.
        timed = {k: (v[1:] or v) for k, v in times.items()}  # --steps >= 1
        med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in timed.items()}
        which = "excluding step 0" if args.steps > 1 else "step 0 only"
        print(f"median step time (ms, {which}): fgpsdp {med['fgpsdp']:.1f}, "
              f"DDP {med['ddp']:.1f}  (CPU processes sharing this machine's cores)")
        print("optimizer-state bytes per rank:")
        for r, t in enumerate(gathered):
            print(f"  rank {r}: fgpsdp {int(t[0]):>10,}   DDP {int(t[1]):>10,}")
        print(f"largest |parameter difference| to DDP over all ranks: "
              f"{max(float(d) for d in diffs):.3g}")
    # The models go first, so that the default group is freed inside
    # destroy_process_group() while the tensors of its last collectives still
    # live. Freed later, when the frame ends, the group's destructor waits for
    # its gloo worker thread, which may be freeing that collective's tensors
    # and needs the GIL the destructor holds: the process hung at exit
    # (intermittently, with torch 2.13 on CPU).
    del ours, opt, ref, ref_opt
    gc.collect()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30, help="training steps (at least 1)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--bucket-cap-mb", type=float, default=0.1)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    # This process serves the ranks' store, on a port it binds and holds from the
    # start: a port picked free and bound later by rank 0 could be taken meanwhile.
    store = dist.TCPStore("127.0.0.1", 0, args.world_size, is_master=True,
                          timeout=timedelta(seconds=120), wait_for_workers=False)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(run, args=(args.world_size, store.port, args), nprocs=args.world_size,
                       start_method="spawn")


if __name__ == "__main__":
    main()
