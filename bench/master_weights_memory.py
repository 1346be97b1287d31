"""Memory and loss of 16-bit training with float32 master weights, against float32 training.

    python bench/master_weights_memory.py --workload gpt2 --world-size 4 --steps 20

Spawns ``--world-size`` CPU ranks on this machine (gloo over loopback: memory and
loss do not depend on the link) once per system, trains ``--steps`` AdamW steps
(lr 1e-4, as bench/systems.py's, clipped at 1.0) on the workload's synthetic data,
and prints per system: the largest resident-set growth of any rank from just before
the model is built to the peak (``ru_maxrss``); the bytes of training state rank 0
holds between its last backward and step, counted from the tensors themselves
(parameters, the gradients the step reads, optimizer state, master weights and
fgpsdp's 16-bit copy of each slice as last written beside them; torch
DDP's own gradient buckets, which it keeps beside ``param.grad``, are not reachable and
not counted); and rank 0's mean loss over the last 5 steps. Systems:

- ``ddp_fp32``: torch DDP, float32 parameters, AdamW over them;
- ``ddp_bf16_masters``: torch DDP over the bfloat16 model, AdamW over a float32
  master copy of every parameter, copied back after each step (the loop
  ``master_weights`` replaces; tests/master_weights_scenarios.py);
- ``fgpsdp_fp32``: fgpsdp (two_stage), float32 parameters;
- ``fgpsdp_bf16``: fgpsdp over the bfloat16 model, AdamW stepping bfloat16 slices;
- ``fgpsdp_bf16_masters``: the same with ``master_weights=True``;
- ``fsdp_bf16_mixed``: torch FSDP (FSDP1, SHARD_GRAD_OP: ZeRO-2, wrapped in units of
  25 MB as bench/systems.py's) over the float32 model with ``MixedPrecision`` in
  bfloat16 for parameters, reduction and buffers: its sharded float32 parameters are
  the master weights, AdamW steps them. (Its state held is not counted: FSDP keeps it
  in its own flat parameters; the RSS growth is measured.)

Memory beside a small CPU model is dominated by the process itself (torch's
libraries, gloo); the growth isolates what training holds, to the page.
"""
from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import fgpsdp_runtime as fgp  # noqa: E402
from memory_probe import peak_mib, rss_mib, spawn_ranks  # noqa: E402
from systems import ADAMW, BUCKET_CAP_MB, MAX_NORM, _size_wrap_policy  # noqa: E402
from workloads import CONFIGS, WORKLOADS, build_model, loss_fn, make_batch  # noqa: E402

SYSTEMS = ("ddp_fp32", "ddp_bf16_masters", "fgpsdp_fp32", "fgpsdp_bf16", "fgpsdp_bf16_masters",
           "fsdp_bf16_mixed")


class DDPWithMasters:
    """torch DDP over a 16-bit model, AdamW over a float32 copy of every parameter."""

    def __init__(self, model: nn.Module):
        self.model = nn.parallel.DistributedDataParallel(model)
        self.params = list(self.model.parameters())
        self.masters = [p.detach().float().clone() for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, **ADAMW)

    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        torch.nn.utils.clip_grad_norm_(self.masters, MAX_NORM)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _state_tensors(state) -> list[torch.Tensor]:
    return [v for entry in state.values() for v in entry.values() if torch.is_tensor(v)]


def held_bytes(system: str, wrapped, opt) -> float:
    """Training state held between backward and step, from the tensors (see above);
    NaN where not counted."""
    if system == "fsdp_bf16_mixed":
        return float("nan")
    if system == "ddp_fp32":
        params = list(wrapped.parameters())
        return _nbytes(params) + _nbytes(p.grad for p in params) + \
            _nbytes(_state_tensors(opt.state))
    if system == "ddp_bf16_masters":
        params = opt.params
        return _nbytes(params) + _nbytes(p.grad for p in params) + _nbytes(opt.masters) + \
            _nbytes(_state_tensors(opt.opt.state))
    return (_nbytes(s.flat_param for s in wrapped.buckets)
            + _nbytes(s.grad_shard for s in wrapped.buckets)
            + _nbytes(opt._slice_pieces.masters.values())
            + _nbytes(opt._slice_pieces._last_written.values())
            + _nbytes(_state_tensors(opt.optim.state)))


def _rank(rank, world, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    cfg = CONFIGS[(args.workload, "cpu")]
    torch.manual_seed(0)
    before = rss_mib()
    model = build_model(cfg)
    if "bf16" in args.system and args.system != "fsdp_bf16_mixed":
        model = model.to(torch.bfloat16)
    if args.system == "ddp_fp32":
        wrapped = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(wrapped.parameters(), **ADAMW)

        def step():
            torch.nn.utils.clip_grad_norm_(wrapped.parameters(), MAX_NORM)
            opt.step()
            opt.zero_grad(set_to_none=True)
    elif args.system == "fsdp_bf16_mixed":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
        bf16 = torch.bfloat16
        wrapped = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True,
                       sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
                       auto_wrap_policy=_size_wrap_policy(model, BUCKET_CAP_MB),
                       mixed_precision=MixedPrecision(param_dtype=bf16, reduce_dtype=bf16,
                                                      buffer_dtype=bf16))
        opt = torch.optim.AdamW(wrapped.parameters(), **ADAMW)

        def step():
            wrapped.clip_grad_norm_(MAX_NORM)
            opt.step()
            opt.zero_grad(set_to_none=True)
    elif args.system == "ddp_bf16_masters":
        mastered = DDPWithMasters(model)
        wrapped, step, opt = mastered.model, mastered.step, mastered
    else:
        wrapped = fgp.DistributedDataParallel(model)
        opt = fgp.ShardedOptimizer(wrapped, torch.optim.AdamW, max_grad_norm=MAX_NORM,
                                   master_weights=args.system.endswith("masters"), **ADAMW)

        def step():
            opt.step()
            opt.zero_grad(set_to_none=True)
    criterion = loss_fn(cfg)
    losses = []
    for s in range(args.steps):
        x, y = make_batch(cfg, s, rank)
        if "bf16" in args.system and x.is_floating_point():
            x = x.to(torch.bfloat16)
        loss = criterion(wrapped(x).float(), y)
        loss.backward()
        if s == args.steps - 1:
            held = held_bytes(args.system, wrapped, opt)
        step()
        losses.append(float(loss.detach()))
    dist.barrier()
    queue.put((rank, peak_mib() - before, losses, held))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="gpt2", choices=WORKLOADS)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--port", type=int, default=29831)
    args = parser.parse_args()
    n_params = sum(p.numel() for p in build_model(CONFIGS[(args.workload, "cpu")]).parameters())
    print(f"{args.workload} (cpu size, {n_params / 1e6:.1f}M parameters), "
          f"{args.world_size} ranks, {args.steps} AdamW steps, torch {torch.__version__}")
    print(f"{'system':<22} {'RSS growth, max rank (MiB)':>27} {'state held, rank 0 (MiB)':>25} "
          f"{'loss, last 5 steps (rank 0)':>28}")
    for i, system in enumerate(s for s in args.systems.split(",") if s):
        if system not in SYSTEMS:
            parser.error(f"unknown system {system}; choose from {SYSTEMS}")
        args.system, args.port = system, args.port + i
        results = sorted(spawn_ranks(_rank, args.world_size, args))
        growth = max(r[1] for r in results)
        last = results[0][2][-5:]
        print(f"{system:<22} {growth:>27.0f} {results[0][3] / 2**20:>25.1f} "
              f"{sum(last) / len(last):>28.4f}", flush=True)


if __name__ == "__main__":
    main()
