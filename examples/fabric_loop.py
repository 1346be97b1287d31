"""fgpsdp in a Lightning Fabric loop, against Fabric's own DDP strategy.

    pip install lightning
    torchrun --standalone --nproc_per_node 2 examples/fabric_loop.py fgpsdp params.pt

What differs from Fabric's usual loop (checked with Lightning 2.6.6, strategy="ddp"):

- The model is not given to ``fabric.setup`` / ``setup_module``: Fabric's DDP
  strategy would wrap fgpsdp's wrapper in torch DDP
  (which trains the same, but all-reduces every full gradient into ``.grad`` on
  top of fgpsdp's reduce-scatter, silently). Wrap the module yourself, build the
  ShardedOptimizer on the wrapper and give ``fabric.setup_optimizers`` the
  optimizer alone (its step, zero_grad and state_dict then go through Fabric).
  ``fabric.setup_dataloaders`` as usual.
- ``fabric.backward(loss)`` works as it is.
- Accumulation: ``fabric.no_backward_sync`` takes only a model Fabric set up (it
  raises TypeError otherwise): enter the wrapper's own ``model.no_sync()``. (Set up,
  it would enter the outer torch DDP's ``no_sync`` alone, never fgpsdp's.)
- Mixed precision (``precision="bf16-mixed"``): Fabric casts the forward of a model
  it set up; this one is not, so the loop enters ``fabric.autocast()`` around the
  forward and the loss (without it the run is float32, silently).
- Clip with the ShardedOptimizer's ``clip_grad_norm_``: ``fabric.clip_gradients``
  goes over ``optimizer.param_groups``, this rank's slices with no ``.grad``: by
  norm it clips nothing and returns 0, silently; by value torch raises.
- ``fabric.save`` / ``fabric.load`` of {"model": model.module, "optimizer":
  optimizer} need nothing more: Fabric saves an optimizer that has
  ``consolidate_state_dict`` by calling it on every rank and ``state_dict()`` on
  rank 0, the whole state, which loads on every rank (so does Fabric's
  ``optimizer.state_dict()``; the ShardedOptimizer's own, ``sharded.state_dict()``,
  is this rank's shard: saved from rank 0, the load is refused on rank 1).
  ``model.module``: the keys are then torch DDP's (no ``module.`` prefix).

``torch`` in place of ``fgpsdp`` runs Fabric's own torch DDP.
``examples/fabric_compare.py`` runs the comparisons.
"""
from __future__ import annotations

import argparse
import itertools
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist

try:
    from lightning.fabric import Fabric
except ImportError as error:  # (not a dependency of fgpsdp_runtime)
    raise SystemExit(f"this example needs Lightning (pip install lightning): {error}")

import fgpsdp_runtime as fgp
from toy_regression import regression_dataset, regression_net

CLIP = 0.05  # max_norm: binds on every step of this model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("system", choices=["fgpsdp", "torch"])
    parser.add_argument("out", help="where rank 0 writes the trained parameters")
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps in all")
    parser.add_argument("--accumulate", type=int, default=1, help="batches per step")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--save", help="fabric.save here after --save-at steps")
    parser.add_argument("--save-at", type=int, default=8)
    parser.add_argument("--resume", help="fabric.load this checkpoint first")
    args = parser.parse_args()
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", precision=args.precision)
    fabric.launch()  # (under torchrun: joins its processes; alone: starts rank 1)
    fabric.seed_everything(0)
    module = regression_net()
    # (No shuffle: the data order of a resumed run is then the uninterrupted one's.)
    loader = fabric.setup_dataloaders(
        torch.utils.data.DataLoader(regression_dataset(), batch_size=4))
    if args.system == "fgpsdp":
        # On the device before wrapping (a wrapper refuses parameters moved after it);
        # not through fabric.setup: Fabric's DDP strategy would wrap it in torch DDP.
        model = fgp.DistributedDataParallel(fabric.to_device(module))
        sharded = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.01)
        optimizer = fabric.setup_optimizers(sharded)  # the optimizer alone
        no_sync, autocast = model.no_sync, fabric.autocast
        saved = model.module  # torch DDP's keys
    else:
        model, optimizer = fabric.setup(
            module, torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.01))
        no_sync, autocast = partial(fabric.no_backward_sync, model), nullcontext
        saved = model
    progress = {"steps": 0, "batches": 0}
    if args.resume:
        progress.update(fabric.load(args.resume, {"model": saved, "optimizer": optimizer}))

    while progress["steps"] < args.steps:
        # A resume mid-epoch skips the batches done (none here: step 8 ends an epoch).
        skip = progress["batches"] % len(loader)
        for x, y in itertools.islice(loader, skip, None):
            progress["batches"] += 1
            stepping = progress["batches"] % args.accumulate == 0
            with nullcontext() if stepping else no_sync():  # no reduction between steps
                # Fabric casts the forward of a model it set up; this one it did not
                # (a no-op at 32-true, and for the torch run: its model is set up).
                with autocast():
                    loss = torch.nn.functional.mse_loss(model(x), y)
                fabric.backward(loss / args.accumulate)
            if not stepping:
                continue
            if args.system == "fgpsdp":
                sharded.clip_grad_norm_(CLIP)  # the reduced, sharded gradient
            else:
                fabric.clip_gradients(model, optimizer, max_norm=CLIP)
            optimizer.step()
            optimizer.zero_grad()
            progress["steps"] += 1
            if args.save and progress["steps"] == args.save_at:
                # Every rank: for the sharded optimizer, Fabric calls its
                # consolidate_state_dict() (a collective), then rank 0 saves.
                fabric.save(args.save, {"model": saved, "optimizer": optimizer, **progress})
            if progress["steps"] == args.steps:
                break

    if args.system == "fgpsdp":
        model.synchronize()  # the last step's all-gathers landed
    if fabric.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in module.state_dict().items()},
                   args.out)
    fabric.barrier()
    # torch DDP on gloo may hang at interpreter exit (see accelerate_loop.py): everything
    # that holds the process group goes first.
    del model, optimizer, saved, loader, module, no_sync
    if args.system == "fgpsdp":
        del sharded
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
