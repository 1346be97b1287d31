"""Does a long run grow? Per-rank memory and resources over many steps of one wrapper.

A training job runs for days: anything the runtime keeps per step (a list it appends
to, a tensor it holds, a thread or a descriptor it opens) adds up. This trains a
small model with a tied embedding on CPU processes (gloo) for ``--steps`` steps and
takes, on every rank, after a warm-up and then every ``--every`` steps (after
``model.synchronize()`` and a garbage-collector pass): the resident set size, the live
torch tensors, the Python and native threads, the open file descriptors and the
mappings of ``/dev/shm``. torch DDP with torch's AdamW runs the same loop as the
baseline. It prints, per configuration, rank 0's RSS at every reading, its other
figures at the first and the last, and the growth per 1,000 steps (RSS over the last
interval, tensors over the run); a leak shows as tensors, threads or descriptors that
grow, or an RSS that keeps rising after the warm-up.

    python bench/steady_state.py [--steps 4050] [--every 1000] [--world-size 2]
                                 [--configs two_stage,next_forward,...]
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name -> what the loop does. "system": fgpsdp or torch; "clip": clip every other
# step; "accumulate": micro-batches per step (all but the last under no_sync());
# "checkpoint": every 10 steps a module, shard and full optimizer state dict, and
# every 50 a load of them; "eval": a no-grad eval forward every 3 steps; "trace": the
# timeline on (it keeps the latest model.timeline.max_spans spans: set low here).
CONFIGS = {
    "serial": {"schedule": "serial", "clip": True},
    "next_forward": {"schedule": "next_forward", "clip": True},
    "two_stage": {"schedule": "two_stage", "clip": True},
    "two_stage_layout": {"schedule": "two_stage", "clip": True, "overlap_plan": "layout"},
    "everything": {"schedule": "two_stage", "clip": True, "overlap_plan": "layout",
                   "accumulate": 2, "reduce_dtype": "bfloat16", "checkpoint": True,
                   "eval": True, "trace": 1000},
    "torch_ddp": {"system": "torch", "clip": True},
    "torch_ddp_everything": {"system": "torch", "clip": True, "accumulate": 2,
                             "checkpoint": True, "eval": True},
}
VOCAB, DIM = 64, 32


class TiedLM(nn.Module):
    """An embedding, an encoder layer and an output layer tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = nn.TransformerEncoderLayer(DIM, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.block(self.embed(tokens)))


def reading() -> dict[str, int]:
    gc.collect()
    with open("/proc/self/status") as status:
        rss_kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))
    with open("/proc/self/maps") as maps:
        shm_maps = sum("/dev/shm" in line for line in maps)
    return {"rss_kib": rss_kib,
            "tensors": sum(isinstance(o, torch.Tensor) for o in gc.get_objects()),
            "py_threads": threading.active_count(),
            "native_threads": len(os.listdir("/proc/self/task")),
            "fds": len(os.listdir("/proc/self/fd")), "shm_maps": shm_maps}


def train(rank: int, world_size: int, cfg: dict, steps: int, every: int) -> dict:
    import fgpsdp_runtime as fgp
    warnings.simplefilter("ignore", FutureWarning)
    torch.manual_seed(0)
    ours = cfg.get("system", "fgpsdp") == "fgpsdp"
    if ours:
        options = {k: cfg[k] for k in ("schedule", "overlap_plan") if k in cfg}
        if "reduce_dtype" in cfg:
            options["reduce_dtype"] = getattr(torch, cfg["reduce_dtype"])
        model = fgp.DistributedDataParallel(TiedLM(), bucket_cap_mb=0.01, **options)
        opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3)
        if cfg.get("trace"):
            model.timeline.max_spans = cfg["trace"]
            model.timeline.enable()
    else:
        model = nn.parallel.DistributedDataParallel(TiedLM(), bucket_cap_mb=0.01)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)

    def loss() -> torch.Tensor:
        tokens = torch.randint(0, VOCAB, (4, 8), generator=generator)
        out = model(tokens)
        return nn.functional.cross_entropy(out.reshape(-1, VOCAB), tokens.roll(1, 1).reshape(-1))

    readings = {}
    for step in range(1, steps + 1):
        for _ in range(cfg.get("accumulate", 1) - 1):
            with model.no_sync():
                loss().backward()
        loss().backward()
        if cfg.get("clip") and step % 2 == 0:
            if ours:
                opt.clip_grad_norm_(1.0)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cfg.get("eval") and step % 3 == 0:
            model.eval()
            with torch.no_grad():
                loss()
            model.train()
        if cfg.get("checkpoint") and step % 10 == 0:
            module_dict = model.state_dict()
            optimizer_dict = opt.full_state_dict() if ours else opt.state_dict()
            if ours:
                opt.state_dict()  # this rank's shard too
            if step % 50 == 0:
                model.load_state_dict(module_dict)
                opt.load_state_dict(optimizer_dict)
        if step == 50 or (step > 50 and (step - 50) % every == 0) or step == steps:
            if ours:
                model.synchronize()
            readings[step] = reading()
    return readings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4050)
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    args = parser.parse_args()
    if args.steps < 50 + 2 * args.every:
        parser.error("--steps must leave room for three readings: 50 + 2 x --every at least")
    from tests.dist_harness import run_distributed
    print(f"world size {args.world_size}, {args.steps} steps; rank 0's readings at step 50 "
          f"and every {args.every} steps after (RSS: each; the others: first / last). RSS "
          "growth is taken between the last two readings (the allocator grows in steps "
          "early on), tensor growth over the whole run; '(another rank differs)' flags a "
          "rank whose tensors, threads or descriptors changed between its first and last "
          "reading")
    print("| config | RSS MiB | tensors | threads py/native | fds | /dev/shm maps "
          "| RSS KiB per 1k steps, last interval | tensors per 1k steps |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.configs.split(","):
        per_rank = run_distributed(args.world_size, train, CONFIGS[name], args.steps,
                                   args.every, timeout_s=3600)
        mine = per_rank[0]
        at = sorted(mine)
        first, last = mine[at[0]], mine[at[-1]]
        before_last = at[-2]

        def pair(key: str) -> str:
            return f"{first[key]} / {last[key]}"
        others_flat = all(r[at[-1]][k] == r[at[0]][k] for r in per_rank[1:]
                          for k in ("tensors", "py_threads", "native_threads", "fds"))
        rss_growth = ((last["rss_kib"] - mine[before_last]["rss_kib"]) * 1000
                      / (at[-1] - before_last))
        tensor_growth = (last["tensors"] - first["tensors"]) * 1000 / (at[-1] - at[0])
        rss = "/".join(f"{mine[s]['rss_kib'] / 1024:.1f}" for s in at)
        print(f"| {name} | {rss} "
              f"| {pair('tensors')} | {first['py_threads']}/{first['native_threads']} / "
              f"{last['py_threads']}/{last['native_threads']} | {pair('fds')} "
              f"| {pair('shm_maps')} | {rss_growth:+.0f} | {tensor_growth:+.1f}"
              f"{'' if others_flat else ' (another rank differs)'} |", flush=True)


if __name__ == "__main__":
    main()
