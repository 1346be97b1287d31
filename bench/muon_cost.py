"""What Muon costs per step beside AdamW, under torch DDP and under fgpsdp.

    python bench/muon_cost.py --workload gpt2 --steps 8

Spawns 2 CPU ranks (``--world-size``; gloo over loopback) once per system. Each
builds the workload (bench/workloads.py, its CPU size) and trains ``--steps`` steps,
clipped at 1.0 (``--max-norm``; 0: no clipping), on the workload's synthetic data:

- ``ddp_adamw``: torch DDP, torch.optim.AdamW over every parameter;
- ``ddp_muon``: torch DDP, torch.optim.Muon over the blocks' 2-D weights (lr 0.02)
  and torch.optim.AdamW over the rest (embeddings, biases, norms, the head);
- ``fgpsdp_adamw`` and ``fgpsdp_muon``: the same under fgpsdp (default schedule,
  two_stage), Muon through ``fgp.MuonWithAdamW``, whose step puts each matrix
  together from both ranks' slices.

Printed for rank 0: the median step time after the first two steps (forward,
backward, step; fgpsdp's synchronized at the end, so the step's all-gathers count),
the last step's loss, and the optimizer state this rank holds in MiB; with
``--time-parts``, also its seconds per step in Newton-Schulz and in each of fgpsdp's
two exchanges (the matrices' pieces to the ranks that orthogonalise them, and the
results back: see whole_matrices.py), with the bytes rank 0 sent in each. A clip that
triggers sums the norm in float32 under torch DDP and in float64 under fgpsdp, so
the losses part in their last digits from the first clipped step on; with no
clipping the two systems print the same figures where they train alike.
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
from systems import ADAMW, MAX_NORM, MUON, muon_split  # noqa: E402
from workloads import CONFIGS, build_model, loss_fn, make_batch  # noqa: E402

SYSTEMS = ("ddp_adamw", "ddp_muon", "fgpsdp_adamw", "fgpsdp_muon")


def _state_mib(optimizer: torch.optim.Optimizer) -> float:
    return sum(v.numel() * v.element_size() for s in optimizer.state.values()
               for v in s.values() if torch.is_tensor(v)) / 2**20


def _time_parts(rank: int) -> dict[str, list[float]]:
    """Wrap Newton-Schulz (torch's, which both systems call) and fgpsdp's exchanges
    of the matrices: name -> [seconds, calls, bytes this rank sent], filled as they
    run."""
    import torch.optim._muon as torch_muon

    from fgpsdp_runtime import whole_matrices
    spent: dict[str, list[float]] = {}

    def timed(name_of, fn, sent_of=lambda *a: 0):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                entry = spent.setdefault(name_of(*a), [0.0, 0, 0])
                entry[0] += time.perf_counter() - start
                entry[1] += 1
                entry[2] += sent_of(*a)
        return wrapper
    torch_muon._zeropower_via_newtonschulz = timed(
        lambda *a: "newton_schulz", torch_muon._zeropower_via_newtonschulz)
    whole_matrices.exchange_bytes = timed(
        lambda group, sends, recvs, site: f"exchange: {site}", whole_matrices.exchange_bytes,
        lambda group, sends, recvs, site: sum(t.numel() for j, t in enumerate(sends)
                                              if j != rank))
    return spent


def _rank(rank, world, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    spent = _time_parts(rank) if args.time_parts else {}
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=900))
    cfg = CONFIGS[(args.workload, "cpu")]
    torch.manual_seed(0)
    model = build_model(cfg)
    fgpsdp = args.system.startswith("fgpsdp")
    wrapped = fgp.DistributedDataParallel(model) if fgpsdp \
        else nn.parallel.DistributedDataParallel(model)
    muon, rest = muon_split(wrapped.module)
    if args.system == "ddp_adamw":
        opts = [torch.optim.AdamW(wrapped.parameters(), **ADAMW)]
    elif args.system == "ddp_muon":
        opts = [torch.optim.Muon(muon, **MUON), torch.optim.AdamW(rest, **ADAMW)]
    elif args.system == "fgpsdp_adamw":
        opts = [fgp.ShardedOptimizer(wrapped, torch.optim.AdamW,
                                     max_grad_norm=args.max_norm or None, **ADAMW)]
    else:
        opts = [fgp.ShardedOptimizer(wrapped, fgp.MuonWithAdamW,
                                     max_grad_norm=args.max_norm or None,
                                     param_groups=[{"params": muon, "use_muon": True, **MUON},
                                                   {"params": rest, "use_muon": False,
                                                    **ADAMW}])]
    criterion = loss_fn(cfg)
    steps = []
    for step in range(args.steps):
        x, y = make_batch(cfg, step, rank)
        start = time.perf_counter()
        loss = criterion(wrapped(x), y)
        loss.backward()
        if not fgpsdp and args.max_norm:
            torch.nn.utils.clip_grad_norm_(wrapped.parameters(), args.max_norm)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        if fgpsdp:
            wrapped.synchronize()  # the step's all-gathers landed: its whole cost
        steps.append(time.perf_counter() - start)
    state = sum(_state_mib(o.optim if fgpsdp else o) for o in opts)
    dist.destroy_process_group()
    queue.put({"rank": rank, "steps": steps, "loss": float(loss.detach()), "state": state,
               "spent": spent})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="gpt2")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--port", type=int, default=29641)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--max-norm", type=float, default=MAX_NORM,
                        help="the clip's max norm (0: no clipping)")
    parser.add_argument("--time-parts", action="store_true",
                        help="also print rank 0's seconds per step in Newton-Schulz and "
                        "in fgpsdp's exchanges of the matrices, and the bytes it sent in "
                        "each (over every step)")
    args = parser.parse_args()
    if args.steps < 4:
        parser.error("--steps must be at least 4")
    print(f"torch {torch.__version__}, workload {args.workload}, {args.world_size} CPU ranks, "
          f"{args.steps} steps, " + (f"clipped at {args.max_norm}" if args.max_norm
                                     else "no clipping"))
    print("| system | median step s (after 2) | last loss | optimizer state MiB (rank 0) |")
    print("|---|---:|---:|---:|")
    for system in args.systems.split(","):
        args.system = system
        r0 = sorted(spawn_ranks(_rank, args.world_size, args), key=lambda r: r["rank"])[0]
        print(f"| {system} | {statistics.median(r0['steps'][2:]):.3f} | {r0['loss']:.7f} | "
              f"{r0['state']:.1f} |", flush=True)
        for name, (seconds, calls, sent) in sorted(r0["spent"].items()):
            print(f"|   {name} | {seconds / args.steps:.3f} s per step, {calls} calls"
                  + (f", {sent / args.steps / 2**20:.2f} MiB sent per step" if sent else "")
                  + " | | |", flush=True)


if __name__ == "__main__":
    main()
