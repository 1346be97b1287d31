"""fgpsdp under PyTorch Lightning's Trainer: its DDP strategy with fgpsdp's wrapper.

    pip install lightning
    python examples/lightning_trainer.py fgpsdp params.pt --epochs 2

``FgpsdpStrategy`` is Lightning's ``DDPStrategy`` with fgpsdp's wrapper in place of
torch's. Lightning wraps the model before it calls ``configure_optimizers()``, so
the ShardedOptimizer can be built there on ``self.trainer.strategy.model``; a torch
optimizer returned alone is converted into one by the strategy
(``ShardedOptimizer.from_optimizer``). What differs from a torch DDP LightningModule:

- lr schedulers returned with a torch optimizer were built on it: that is refused
  (they would schedule it alone); build the ShardedOptimizer in
  ``configure_optimizers`` and the schedulers on it.

- Clipping: Lightning's ``gradient_clip_val`` clips the tensors of
  ``optimizer.param_groups``, which here are this rank's slices without ``.grad``
  before the step: it would clip nothing. The strategy routes Lightning's clip to
  the optimizer's own ``clip_grad_norm_`` (``clip_grad_value_`` for
  ``gradient_clip_algorithm="value"``), after the loss scaler's ``unscale_`` under
  float16 loss scaling, which Lightning does not call for this optimizer. A
  LightningModule's ``configure_gradient_clipping`` that calls
  ``self.clip_gradients`` goes the same way.
- ``DDPStrategy(ddp_comm_hook=...)``: torch's ``fp16_compress_hook`` and
  ``bf16_compress_hook`` (also as ``ddp_comm_wrapper`` of ``allreduce_hook``) set the
  dtype gradients travel in; other hooks are refused. Lightning registers the hook on
  CUDA only, asserting a torch DDP wrapper there: the strategy registers it itself,
  on any device (``--comm-hook``).
- Float16 loss scaling takes fgpsdp's scaler through Lightning's plugin
  (``--precision 16-mixed-scaler``); torch's is refused at the step.
- ``precision="bf16-true"`` (a bfloat16 model, stepped in bfloat16 as under torch
  DDP) needs nothing; clipping by norm rounds apart there: torch's clip takes its
  coefficient in bfloat16, fgpsdp's in float64.
- Per-parameter gradient norms (Lightning's ``grad_norm(module, 2)``, logged in
  ``on_before_optimizer_step``) read ``p.grad``, which is None here: they would log
  nothing. ``optimizer.grad_norms()`` gives them, a collective every rank's hook
  makes (``--log-grad-norms`` saves them beside the parameters).
- Checkpoints need nothing: Lightning saves a sharded optimizer by calling
  ``consolidate_state_dict()`` on every rank and ``state_dict()`` on rank 0 (as for
  torch's ZeroRedundancyOptimizer), which gives the whole optimizer state.

``torch`` in place of ``fgpsdp`` runs the same with Lightning's torch DDP strategy;
``--save CKPT`` saves a checkpoint after training and ``--resume CKPT`` resumes from
one; ``--refit`` fits again with a new Trainer. Rank 0 writes the trained parameters
to the output file. ``examples/lightning_compare.py`` runs the comparisons in
docs/integrations.md.
"""
from __future__ import annotations

import argparse
import gc
import weakref
from typing import Optional

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader

try:
    import lightning.pytorch as pl
    from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
    from lightning.pytorch.plugins.precision import MixedPrecision
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.utilities import GradClipAlgorithmType
except ImportError as error:  # (not a dependency of fgpsdp_runtime)
    raise SystemExit(f"this example needs PyTorch Lightning (pip install lightning): {error}")

import fgpsdp_runtime as fgp
from toy_regression import regression_dataset, regression_net

CLIP = 0.05  # binds on every step of this model

# ShardedOptimizers converted from a torch optimizer over only some of the model's
# trainable parameters: Lightning's clip by norm measures the optimizer's parameters,
# the sharded clip every reduced gradient of the model.
_PARTIAL: "weakref.WeakSet[fgp.ShardedOptimizer]" = weakref.WeakSet()


def register_comm_hook_on_any_device(strategy: DDPStrategy) -> None:
    """Lightning's ``_register_ddp_hooks`` with its device test left out: Lightning
    registers ``ddp_comm_hook`` on CUDA only (asserting a torch DDP wrapper there, an
    AssertionError with fgpsdp's); fgpsdp takes torch's reduce-dtype hooks on any
    device, and torch DDP its float16 ones on gloo too."""
    _register_ddp_comm_hook(model=strategy.model, ddp_comm_state=strategy._ddp_comm_state,
                            ddp_comm_hook=strategy._ddp_comm_hook,
                            ddp_comm_wrapper=strategy._ddp_comm_wrapper)


class FgpsdpStrategy(DDPStrategy):
    """Lightning's DDP strategy, with fgpsdp's wrapper in place of torch DDP's."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return fgp.DistributedDataParallel(model, **self._ddp_kwargs)

    def _register_ddp_hooks(self) -> None:
        register_comm_hook_on_any_device(self)

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        clip_sharded_optimizers(self.precision_plugin)

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """A torch optimizer from ``configure_optimizers`` becomes a ShardedOptimizer
        of its class and groups (one returned without lr schedulers: a scheduler
        returned with it was built on it, and would schedule it alone)."""
        super().setup_optimizers(trainer)
        if len(self.optimizers) > 1:  # (every rank alike)
            raise ValueError("fgpsdp: one optimizer per model: return one from "
                             "configure_optimizers, with a param group for each part of "
                             "the model (manual optimization too)")
        try:
            converted = [fgp.ShardedOptimizer.from_optimizer(self.model, optimizer)
                         for optimizer in self.optimizers]
        except ValueError as error:  # (every rank alike: from_optimizer agrees first)
            if "lr scheduler" not in str(error):
                raise
            raise ValueError(f"{error}. Under Lightning, build the ShardedOptimizer in "
                             "configure_optimizers, fgp.ShardedOptimizer(self.trainer."
                             "strategy.model, torch.optim.AdamW, ...), and its schedulers on "
                             "it") from error
        for optimizer, sharded in zip(self.optimizers, converted):
            if isinstance(optimizer, fgp.ShardedOptimizer):
                continue  # built by configure_optimizers: its groups hold slices
            given = {id(p) for group in optimizer.param_groups for p in group["params"]}
            if not all(id(p) in given for _, p in self.model.named_trainable_parameters()
                       if p.requires_grad):
                _PARTIAL.add(sharded)
        self.optimizers = converted


class TorchDDPStrategy(DDPStrategy):
    """Lightning's torch DDP strategy, registering ``ddp_comm_hook`` on CPU too (for
    the comparison)."""

    def _register_ddp_hooks(self) -> None:
        register_comm_hook_on_any_device(self)


def clip_sharded_optimizers(plugin) -> None:
    """Route the precision plugin's clip (``gradient_clip_val``) to a ShardedOptimizer's own."""
    lightning_clip = plugin.clip_gradients
    if getattr(lightning_clip, "routes_sharded", False):
        return  # setup runs again: a second fit, a validate or test of the same Trainer

    def clip_gradients(optimizer, clip_val=0.0,
                       gradient_clip_algorithm=GradClipAlgorithmType.NORM):
        if not isinstance(optimizer, fgp.ShardedOptimizer):
            lightning_clip(optimizer, clip_val, gradient_clip_algorithm)
            return
        if not clip_val or clip_val <= 0:
            return
        # Under float16 loss scaling Lightning leaves the gradients scaled for this
        # optimizer (it reads it as one that unscales itself): unscale first.
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None:
            scaler.unscale_(optimizer)
        # Every rank: a collective, as Lightning calls it.
        if GradClipAlgorithmType(gradient_clip_algorithm) == GradClipAlgorithmType.VALUE:
            optimizer.clip_grad_value_(clip_val)
        elif optimizer in _PARTIAL:  # (every rank alike: the groups agree)
            raise ValueError(
                "fgpsdp: gradient_clip_val (by norm) clips by the norm of the optimizer's "
                "parameters, and this optimizer steps only some of the model's trainable "
                "parameters, while the sharded clip measures them all: freeze the others "
                "(requires_grad_(False)) before fit")
        else:
            optimizer.clip_grad_norm_(clip_val)

    clip_gradients.routes_sharded = True
    plugin.clip_gradients = clip_gradients


class Regression(pl.LightningModule):
    def __init__(self, system: str, out: str, torch_optimizer: bool = False,
                 scheduler: bool = False, log_grad_norms: bool = False,
                 head_only: bool = False):
        super().__init__()
        self.system, self.out = system, out  # out: where rank 0 saves the parameters
        self.torch_optimizer = torch_optimizer  # fgpsdp: the strategy converts it
        self.head_only = head_only  # a torch optimizer over the last layer alone
        self.scheduler = scheduler  # a StepLR returned with the optimizer
        self.net = regression_net()
        # Each step's per-parameter gradient norms, saved beside the parameters.
        self.grad_norms: Optional[list[list[float]]] = [] if log_grad_norms else None

    def on_before_optimizer_step(self, optimizer):
        if self.grad_norms is None:
            return
        if isinstance(optimizer, fgp.ShardedOptimizer):
            # param.grad is None here: the reduced gradients are in the slices. A
            # collective (every rank runs this hook); in parameter order.
            norms = [float(norm) for norm in optimizer.grad_norms().values()]
        else:  # what Lightning's grad_norm(self.net, 2) logs, less its total
            norms = [float(p.grad.norm()) for p in self.net.parameters()]
        self.grad_norms.append(norms)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        if self.system == "fgpsdp" and not self.torch_optimizer:
            optimizer = fgp.ShardedOptimizer(self.trainer.strategy.model, torch.optim.AdamW,
                                             lr=1e-2, weight_decay=0.01)
        else:
            params = self.net[2].parameters() if self.head_only else self.parameters()
            optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
        if not self.scheduler:
            return optimizer
        return {"optimizer": optimizer,
                "lr_scheduler": {"interval": "step",  # halves the lr every 4 steps
                                 "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 4,
                                                                              gamma=0.5)}}

    def on_train_end(self):
        wrapper = self.trainer.strategy.model
        if isinstance(wrapper, fgp.DistributedDataParallel):
            wrapper.synchronize()  # the last step's all-gathers landed
        if self.trainer.global_rank == 0:
            saved = {k: v.detach().clone() for k, v in self.net.state_dict().items()}
            if self.grad_norms is not None:
                saved["grad_norms"] = torch.tensor(self.grad_norms)
            torch.save(saved, self.out)


def make_trainer(args: argparse.Namespace) -> pl.Trainer:
    hook = None if args.comm_hook is None else getattr(default_hooks, args.comm_hook)
    strategy = (FgpsdpStrategy if args.system == "fgpsdp" else TorchDDPStrategy)(
        process_group_backend="gloo", ddp_comm_hook=hook)
    plugins, precision = [], args.precision
    if precision == "16-mixed-scaler":  # float16 loss scaling: fgpsdp's scaler for fgpsdp
        scaler = fgp.ShardedGradScaler("cpu") if args.system == "fgpsdp" \
            else torch.amp.GradScaler("cpu")
        plugins, precision = [MixedPrecision("16-mixed", "cpu", scaler=scaler)], None
    return pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy,
                      max_epochs=args.epochs, gradient_clip_val=CLIP,
                      gradient_clip_algorithm=args.clip_algorithm,
                      accumulate_grad_batches=args.accumulate, precision=precision,
                      plugins=plugins, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("system", choices=["fgpsdp", "torch"])
    parser.add_argument("out", help="where rank 0 writes the trained parameters")
    parser.add_argument("--epochs", type=int, default=2,
                        help="epochs in all (8 batches each)")
    parser.add_argument("--save", help="save a checkpoint here after training")
    parser.add_argument("--resume", help="resume from this checkpoint")
    parser.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    parser.add_argument("--precision", default="32-true",
                        choices=["32-true", "bf16-mixed", "bf16-true", "16-mixed-scaler"])
    parser.add_argument("--clip-algorithm", default="norm", choices=["norm", "value"],
                        help="gradient_clip_algorithm")
    parser.add_argument("--refit", action="store_true",
                        help="fit again with a new Trainer (--epochs more)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--comm-hook", choices=["fp16_compress_hook"],
                        help="DDPStrategy(ddp_comm_hook=...): torch's hook of that name")
    parser.add_argument("--torch-optimizer", action="store_true",
                        help="configure_optimizers returns a torch AdamW under fgpsdp too "
                        "(the strategy converts it)")
    parser.add_argument("--scheduler", action="store_true",
                        help="configure_optimizers returns a StepLR too (stepped every 4 "
                        "steps; refused with --torch-optimizer under fgpsdp)")
    parser.add_argument("--head-only-optimizer", action="store_true",
                        help="configure_optimizers returns a torch AdamW over the last "
                        "layer alone (with clipping by norm: refused under fgpsdp)")
    parser.add_argument("--log-grad-norms", action="store_true",
                        help="save each step's per-parameter gradient norms (fgpsdp: "
                        "opt.grad_norms(), torch: p.grad.norm()) beside the parameters")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # shuffle=False: a resumed run sees the batches the uninterrupted one saw.
    data = DataLoader(regression_dataset(), batch_size=4, shuffle=False)
    pl.seed_everything(0, verbose=False)
    model = Regression(args.system, args.out, args.torch_optimizer or args.head_only_optimizer,
                       args.scheduler, args.log_grad_norms, args.head_only_optimizer)
    trainer = make_trainer(args)
    trainer.fit(model, data, ckpt_path=args.resume)
    if args.refit:
        # The first Trainer's wrapper and optimizer hold the parameters while they
        # live: a second wrapper of them is refused. Rebinding drops them.
        trainer = make_trainer(args)
        trainer.fit(model, data)
    if args.save:
        trainer.save_checkpoint(args.save)
    # Lightning leaves the process group up: torch DDP's runs then aborted now and then
    # at exit ("terminate called without an active exception"), fgpsdp imported or not.
    # (Not seen since in the runs here; compare_runs.py still runs such a run again.)
    # What holds the group goes first, as in accelerate_loop.py.
    del trainer, model
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()

if __name__ == "__main__":
    main()
