"""fgpsdp under PyTorch Lightning's Trainer: a strategy of four lines.

    pip install lightning
    python examples/lightning_trainer.py fgpsdp params.pt --steps 16

``FgpsdpStrategy`` is Lightning's ``DDPStrategy`` with fgpsdp's wrapper in place of
torch's. Lightning wraps the model before it calls ``configure_optimizers()``, so
the ShardedOptimizer is built there on ``self.trainer.strategy.model``. Two things
differ from a torch DDP LightningModule:

- Clipping: Lightning's ``gradient_clip_val`` clips the tensors of
  ``optimizer.param_groups``, which here are this rank's slices without ``.grad``
  before the step: it would clip nothing. ``configure_gradient_clipping`` below
  calls ``optimizer.clip_grad_norm_`` instead (or build the optimizer with
  ``max_grad_norm=``).
- Checkpoints need nothing: Lightning saves a sharded optimizer by calling
  ``consolidate_state_dict()`` on every rank and ``state_dict()`` on rank 0 (as for
  torch's ZeroRedundancyOptimizer), which gives the whole optimizer state.

The other arguments: ``torch`` runs the same with Lightning's torch DDP strategy;
``--save CKPT`` saves a checkpoint after training and ``--resume CKPT`` resumes from
one. Rank 0 writes the trained parameters to the output file.
``examples/lightning_compare.py`` runs the comparisons in the README.
"""
from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
except ImportError as error:  # (not a dependency of fgpsdp_runtime)
    raise SystemExit(f"this example needs PyTorch Lightning (pip install lightning): {error}")

import fgpsdp_runtime as fgp

CLIP = 0.05  # binds on every step of this model


class FgpsdpStrategy(DDPStrategy):
    """Lightning's DDP strategy, with fgpsdp's wrapper in place of torch DDP's."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return fgp.DistributedDataParallel(model, **self._ddp_kwargs)


class Regression(pl.LightningModule):
    def __init__(self, system: str):
        super().__init__()
        self.system = system
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                       torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        if self.system == "fgpsdp":
            return fgp.ShardedOptimizer(self.trainer.strategy.model, torch.optim.AdamW,
                                        lr=1e-2, weight_decay=0.01)
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                    gradient_clip_algorithm=None):
        if self.system == "fgpsdp":
            if gradient_clip_val:
                optimizer.clip_grad_norm_(gradient_clip_val)  # every rank: a collective
        else:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_train_end(self):
        wrapper = self.trainer.strategy.model
        if isinstance(wrapper, fgp.DistributedDataParallel):
            wrapper.synchronize()  # the last step's all-gathers landed
        if self.trainer.global_rank == 0:
            torch.save({k: v.detach().clone() for k, v in self.net.state_dict().items()},
                       self.out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("system", choices=["fgpsdp", "torch"])
    parser.add_argument("out", help="where rank 0 writes the trained parameters")
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps in all")
    parser.add_argument("--save", help="save a checkpoint here after training")
    parser.add_argument("--resume", help="resume from this checkpoint")
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(123)
    x = torch.randn(64, 8, generator=g)
    y = (x.sum(1, keepdim=True) * 0.5).tanh() + 0.1 * torch.randn(64, 1, generator=g)
    pl.seed_everything(0, verbose=False)
    model = Regression(args.system)
    model.out = args.out
    strategy = (FgpsdpStrategy if args.system == "fgpsdp" else DDPStrategy)(
        process_group_backend="gloo")
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy,
                         max_steps=args.steps, gradient_clip_val=CLIP, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    # shuffle=False: a run resumed at an epoch's end sees the batches it would have.
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False),
                ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)


if __name__ == "__main__":
    main()
