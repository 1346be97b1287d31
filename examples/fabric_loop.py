"""A Lightning Fabric loop, run with fgpsdp's strategy or with Fabric's own DDP.

    pip install lightning
    torchrun --standalone --nproc_per_node 2 examples/fabric_loop.py fgpsdp params.pt

The loop is Fabric's usual one, the same for both systems: only the strategy
differs (``FgpsdpFabricStrategy()`` from ``examples/fabric_strategy.py``, or
``"ddp"``). It sets up the model and a torch AdamW with ``fabric.setup`` (or
``--separate-setup``: ``fabric.setup_module``, then the optimizer over the set-up
model's parameters and ``fabric.setup_optimizers``), accumulates with
``fabric.no_backward_sync``, clips with ``fabric.clip_gradients`` (by norm, or
``--clip value``), steps an lr schedule built on the optimizer Fabric returns,
and saves and resumes with ``fabric.save`` / ``fabric.load``.
``examples/fabric_compare.py`` runs the comparisons.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.distributed as dist

try:
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision.amp import MixedPrecision
except ImportError as error:  # (not a dependency of fgpsdp_runtime)
    raise SystemExit(f"this example needs Lightning (pip install lightning): {error}")

from fabric_strategy import FgpsdpFabricStrategy
from toy_regression import regression_dataset, regression_net

CLIP = {"norm": 0.05, "value": 0.002}  # each binds on every step of this model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("system", choices=["fgpsdp", "torch"])
    parser.add_argument("out", help="where rank 0 writes the trained parameters")
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps in all")
    parser.add_argument("--accumulate", type=int, default=1, help="batches per step")
    parser.add_argument("--precision", default="32-true",
                        choices=["32-true", "bf16-mixed", "16-mixed"])
    parser.add_argument("--clip", default="norm", choices=["norm", "value"])
    parser.add_argument("--optimize", default="all", choices=["all", "first-layer"],
                        help="the parameters the optimizer steps (first-layer: fgpsdp's "
                        "strategy refuses fabric.clip_gradients by norm)")
    parser.add_argument("--separate-setup", action="store_true",
                        help="fabric.setup_module, then fabric.setup_optimizers")
    parser.add_argument("--save", help="fabric.save here after --save-at steps")
    parser.add_argument("--save-at", type=int, default=8)
    parser.add_argument("--resume", help="fabric.load this checkpoint first")
    args = parser.parse_args()
    torch.set_num_threads(1)
    strategy = FgpsdpFabricStrategy() if args.system == "fgpsdp" else "ddp"
    if args.precision == "16-mixed":
        # Float16 loss scaling: Fabric turns "16-mixed" on CPU into bf16, so the
        # plugin is given directly (a torch GradScaler, which fgpsdp's strategy turns
        # into a ShardedGradScaler).
        precision = {"plugins": [MixedPrecision("16-mixed", "cpu")]}
    else:
        precision = {"precision": args.precision}
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, **precision)
    fabric.launch()  # (under torchrun: joins its processes; alone: starts rank 1)
    fabric.seed_everything(0)
    module = regression_net()
    # (No shuffle: the data order of a resumed run is then the uninterrupted one's.)
    loader = fabric.setup_dataloaders(
        torch.utils.data.DataLoader(regression_dataset(), batch_size=4))
    stepped = module if args.optimize == "all" else module[0]
    if args.separate_setup:
        model = fabric.setup_module(module)
        optimizer = fabric.setup_optimizers(
            torch.optim.AdamW(stepped.parameters(), lr=1e-2, weight_decay=0.01))
    else:
        model, optimizer = fabric.setup(
            module, torch.optim.AdamW(stepped.parameters(), lr=1e-2, weight_decay=0.01))
    # On the optimizer Fabric returned (fgpsdp's strategy refuses one built before).
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    progress = {"steps": 0, "batches": 0}
    state = {"model": model, "optimizer": optimizer, "schedule": schedule}
    if args.resume:
        progress.update(fabric.load(args.resume, state))

    while progress["steps"] < args.steps:
        # A resume mid-epoch skips the batches done (none here: step 8 ends an epoch).
        skip = progress["batches"] % len(loader)
        for x, y in itertools.islice(loader, skip, None):
            progress["batches"] += 1
            stepping = progress["batches"] % args.accumulate == 0
            with fabric.no_backward_sync(model, enabled=not stepping):
                loss = torch.nn.functional.mse_loss(model(x), y)
                fabric.backward(loss / args.accumulate)
            if not stepping:
                continue
            if args.clip == "norm":
                # (Under float16 loss scaling the first steps overflow: the step is
                # skipped, so the clip must not raise on them.)
                fabric.clip_gradients(model, optimizer, max_norm=CLIP["norm"],
                                      error_if_nonfinite=False)
            else:
                fabric.clip_gradients(model, optimizer, clip_val=CLIP["value"])
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()
            progress["steps"] += 1
            if args.save and progress["steps"] == args.save_at:
                # Every rank: for the sharded optimizer, Fabric calls its
                # consolidate_state_dict() (a collective), then rank 0 saves.
                fabric.save(args.save, {**state, **progress})
            if progress["steps"] == args.steps:
                break

    if fabric.global_rank == 0:
        # (A state_dict waits for the last step's all-gathers to land.)
        torch.save({k: v.detach().clone() for k, v in module.state_dict().items()},
                   args.out)
    fabric.barrier()
    # torch DDP on gloo may hang at interpreter exit (see accelerate_loop.py): everything
    # that holds the process group goes first.
    del model, optimizer, schedule, state, loader, module, stepped
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
