"""fgpsdp in a plain Hugging Face Accelerate loop (no transformers Trainer).

    pip install accelerate
    torchrun --standalone --nproc_per_node 2 examples/accelerate_loop.py fgpsdp params.pt

What differs from accelerate's usual loop (checked with accelerate 1.16.0):

- The model is not passed to ``accelerator.prepare``: accelerate would wrap fgpsdp's
  wrapper in torch DDP (on CPU ranks after ``.to("cpu:0")``, which copies every
  parameter, so fgpsdp refuses at the first forward). Move the module to
  ``accelerator.device`` and wrap it yourself, then prepare the optimizer, the
  dataloader and the lr scheduler as usual.
- ``accelerator.accumulate(model)`` and ``accelerator.backward(loss)`` work as they
  are: accumulate enters the model's own ``no_sync()``, which is fgpsdp's.
- Mixed precision (``Accelerator(mixed_precision="bf16")``): accelerate puts a
  prepared model's forward under autocast; this one is not prepared, so the loop
  enters ``accelerator.autocast()`` around the forward and the loss (without it the
  run is float32, silently).
- Clip with the ShardedOptimizer's ``clip_grad_norm_``: ``accelerator.clip_grad_norm_``
  over ``model.parameters()`` sees no gradient (they are sharded) and clips nothing.
- ``accelerator.save_state`` saves ``optimizer.state_dict()`` from rank 0 alone:
  ``consolidate_state_dict(to=0)`` on every rank first makes it the whole state, which
  ``load_state`` loads on every rank. The model's weights are saved through
  ``register_for_checkpointing``, as the model was not prepared.
- ``accelerator.unwrap_model`` / ``get_state_dict`` / ``save_model`` do not know
  fgpsdp's wrapper (its keys would start with ``module.``): give them ``model.module``.

``torch`` in place of ``fgpsdp`` runs accelerate's own torch DDP.
``examples/accelerate_compare.py`` runs the comparisons in docs/integrations.md.
"""
from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch
import torch.distributed as dist

try:
    from accelerate import Accelerator
    from accelerate.utils import set_seed
except ImportError as error:  # (not a dependency of fgpsdp_runtime)
    raise SystemExit(f"this example needs accelerate (pip install accelerate): {error}")

import fgpsdp_runtime as fgp
from toy_regression import regression_dataset, regression_net

CLIP = 0.05  # max_norm: binds on every step of this model


class Progress:
    """Optimizer steps and batches done: saved with save_state, for a resume."""
    def __init__(self):
        self.steps = self.batches = 0

    def state_dict(self):
        return {"steps": self.steps, "batches": self.batches}

    def load_state_dict(self, state):
        self.steps, self.batches = state["steps"], state["batches"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("system", choices=["fgpsdp", "torch"])
    parser.add_argument("out", help="where rank 0 writes the trained parameters")
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps in all")
    parser.add_argument("--accumulate", type=int, default=1,
                        help="gradient_accumulation_steps")
    parser.add_argument("--mixed-precision", default="no", choices=["no", "bf16"])
    parser.add_argument("--save", help="save_state here after --save-at steps")
    parser.add_argument("--save-at", type=int, default=8)
    parser.add_argument("--resume", help="load_state from this directory first")
    args = parser.parse_args()
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                              mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.accumulate)
    set_seed(0)
    module = regression_net()
    # (No shuffle: the data order of a resumed run is then the uninterrupted one's.)
    loader = torch.utils.data.DataLoader(regression_dataset(), batch_size=4)
    if args.system == "fgpsdp":
        # On the device before wrapping: a wrapper refuses parameters moved after it.
        model = fgp.DistributedDataParallel(module.to(accelerator.device))
        optimizer = sharded = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2,
                                                   weight_decay=0.01)
    else:
        model, optimizer = module, torch.optim.AdamW(module.parameters(), lr=1e-2,
                                                      weight_decay=0.01)
    # (accelerate steps the scheduler once per process at each optimizer step.)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=args.steps * accelerator.num_processes)
    if args.system == "fgpsdp":  # not the model: accelerate would wrap it in torch DDP
        optimizer, loader, scheduler = accelerator.prepare(optimizer, loader, scheduler)
        accelerator.register_for_checkpointing(model)  # its weights in save_state
    else:
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader,
                                                                  scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if args.resume:
        accelerator.load_state(args.resume)

    while progress.steps < args.steps:
        # A resume mid-epoch skips the batches done (none here: step 8 ends an epoch).
        skip = progress.batches % len(loader)
        for x, y in accelerator.skip_first_batches(loader, skip) if skip else loader:
            progress.batches += 1
            with accelerator.accumulate(model):  # fgpsdp's no_sync() between syncs
                # A prepared model runs its forward under the mixed precision's autocast;
                # this one is not prepared, so the loop enters it (a no-op without one).
                with accelerator.autocast() if args.system == "fgpsdp" else nullcontext():
                    loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    if args.system == "fgpsdp":
                        sharded.clip_grad_norm_(CLIP)  # the reduced, sharded gradient
                    else:
                        accelerator.clip_grad_norm_(model.parameters(), CLIP)
                optimizer.step()  # (accelerate skips these while accumulating)
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            progress.steps += 1
            if args.save and progress.steps == args.save_at:
                if args.system == "fgpsdp":
                    sharded.consolidate_state_dict(to=0)  # every rank: a collective
                accelerator.save_state(args.save)
            if progress.steps == args.steps:
                break

    if args.system == "fgpsdp":
        model.synchronize()  # the last step's all-gathers landed
    if accelerator.is_main_process:
        torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, args.out)
    accelerator.wait_for_everyone()
    # torch DDP's runs hung now and then at exit, after training: the reducer freed the
    # gloo group at interpreter exit, whose destructor joins gloo's thread while holding
    # the GIL that thread waits for. Everything that holds the group goes first.
    del model, optimizer, scheduler, loader, module
    if args.system == "fgpsdp":
        del sharded
    accelerator.free_memory()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
