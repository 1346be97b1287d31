"""fgpsdp under Hugging Face's transformers Trainer: a subclass of five methods.

    pip install transformers accelerate
    torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py fgpsdp params.pt

``FgpsdpTrainer`` lets the Trainer build its optimizer as usual (its class, its
decay / no-decay groups, its arguments), or takes the one given in
``Trainer(optimizers=(opt, None))``, then builds fgpsdp's wrapper and turns the
optimizer into a ShardedOptimizer of that class over those groups
(``ShardedOptimizer.from_optimizer``). Three of its overrides are private
methods of transformers (checked with 5.25.0):

- ``_wrap_model``: the training model is fgpsdp's wrapper, and so is the evaluation
  model once the wrapper exists. It is not ``self.model``, so the Trainer does not hand
  it to accelerate, which would wrap it in torch DDP for training, and move it to its
  device for an evaluation (copying every parameter out of its bucket).
- ``autocast_smart_context_manager`` (public): with ``bf16=True`` the Trainer relies
  on accelerate to cast the forward of the model it prepares, and it does not prepare
  this one: without the override such a run trains in float32, silently.
- ``_clip_grad_norm``: the Trainer's clip (accelerate's, over ``model.parameters()``)
  would see no gradient here and clip nothing; ``opt.clip_grad_norm_`` clips the
  reduced gradient, and its norm is the one the Trainer logs.
- ``_save_optimizer_and_scheduler``: the Trainer saves ``optimizer.state_dict()`` from
  rank 0 alone; ``consolidate_state_dict()`` on every rank first makes that the whole
  state (torch's ZeroRedundancyOptimizer API), which every rank loads on resume.

The wrapper is built in ``create_optimizer``, after the Trainer has moved the model to
its device: on CPU ranks that device is ``cpu:0``, and ``.to("cpu:0")`` copies every
parameter, which a wrapper built before would refuse at the first forward.

``torch`` in place of ``fgpsdp`` runs the plain Trainer (accelerate's torch DDP).
``examples/hf_trainer_compare.py`` runs the comparisons in docs/integrations.md.
"""
from __future__ import annotations

import argparse
import gc
from typing import Optional

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

try:
    from transformers import Trainer, TrainingArguments, set_seed
except ImportError as error:  # (not a dependency of fgpsdp_runtime)
    raise SystemExit(f"this example needs transformers and accelerate "
                     f"(pip install transformers accelerate): {error}")

import fgpsdp_runtime as fgp
from toy_regression import regression_dataset, regression_net

CLIP = 0.05  # max_grad_norm: binds on every step of this model


def sharded(optimizer) -> Optional[fgp.ShardedOptimizer]:
    """The ShardedOptimizer, or the one inside accelerate's AcceleratedOptimizer; None
    before create_optimizer has built it."""
    while optimizer is not None and not isinstance(optimizer, fgp.ShardedOptimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


class FgpsdpTrainer(Trainer):
    def create_optimizer(self, model=None):
        # The Trainer's (its class and groups), or one given in Trainer(optimizers=...).
        built = super().create_optimizer(model)
        if sharded(built) is None:
            self.optimizer = fgp.ShardedOptimizer.from_optimizer(
                fgp.DistributedDataParallel(self.model), built)
        return self.optimizer

    def _wrap_model(self, model, training=True, dataloader=None):
        # Training, and evaluating once training has begun: the wrapper. Given the
        # module, the evaluation loop would let accelerate move it to its device
        # ("cpu:0" on CPU), copying every parameter out of its bucket. (Before
        # training, the module is not wrapped yet.)
        optimizer = sharded(self.optimizer)
        return model if optimizer is None else optimizer.model

    def autocast_smart_context_manager(self, cache_enabled=True):
        # bf16=True / fp16=True: accelerate casts the forward of a model it prepared;
        # the Trainer does not prepare a model _wrap_model wrapped, so cast here.
        return self.accelerator.autocast()

    def _clip_grad_norm(self, model):
        return sharded(self.optimizer).clip_grad_norm_(self.args.max_grad_norm)

    def _save_optimizer_and_scheduler(self, output_dir):
        sharded(self.optimizer).consolidate_state_dict(to=0)  # every rank: a collective
        super()._save_optimizer_and_scheduler(output_dir)


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = regression_net()

    def forward(self, x, y):
        return {"loss": torch.nn.functional.mse_loss(self.net(x), y)}


class Samples(Dataset):
    def __init__(self):
        self.x, self.y = regression_dataset().tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("system", choices=["fgpsdp", "torch"])
    parser.add_argument("out", help="where rank 0 writes the trained parameters")
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps in all")
    parser.add_argument("--accumulate", type=int, default=1,
                        help="gradient_accumulation_steps")
    parser.add_argument("--output-dir", default="hf_trainer_output",
                        help="the Trainer's output_dir (its checkpoints)")
    parser.add_argument("--save-steps", type=int, default=0,
                        help="save a checkpoint every this many steps (0: never)")
    parser.add_argument("--resume", help="resume from this checkpoint directory")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="evaluate every this many steps (0: never)")
    parser.add_argument("--lr-scheduler", default="linear",
                        help="lr_scheduler_type (reduce_lr_on_plateau needs --eval-every)")
    parser.add_argument("--optim", default="adamw_torch", help="the Trainer's optim=")
    parser.add_argument("--given-optimizer", action="store_true",
                        help="give the Trainer a torch AdamW: Trainer(optimizers=(opt, None))")
    parser.add_argument("--evaluate-first", action="store_true",
                        help="trainer.evaluate() before trainer.train()")
    args = parser.parse_args()
    torch.set_num_threads(1)
    training = TrainingArguments(
        output_dir=args.output_dir, use_cpu=True, ddp_backend="gloo", max_grad_norm=CLIP,
        learning_rate=1e-2, weight_decay=0.01, optim=args.optim, max_steps=args.steps,
        per_device_train_batch_size=4, gradient_accumulation_steps=args.accumulate,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 1,
        logging_steps=4, report_to="none", seed=0, disable_tqdm=True,
        remove_unused_columns=False, bf16=args.bf16, lr_scheduler_type=args.lr_scheduler,
        # (The plateau schedule halves the lr after each evaluation that did not improve
        # the best loss tenfold: every one after the first, here.)
        lr_scheduler_kwargs=({"patience": 0, "factor": 0.5, "threshold": 0.9}
                             if args.lr_scheduler == "reduce_lr_on_plateau" else {}),
        eval_strategy="steps" if args.eval_every else "no", eval_steps=args.eval_every or None,
        metric_for_best_model="eval_loss" if args.eval_every else None,
        label_names=["y"])  # (so that an evaluation computes the loss)
    set_seed(0)
    module = Regression()
    given = ((torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.01), None)
             if args.given_optimizer else (None, None))
    trainer = (FgpsdpTrainer if args.system == "fgpsdp" else Trainer)(
        model=module, args=training, train_dataset=Samples(), optimizers=given,
        eval_dataset=Samples() if args.eval_every or args.evaluate_first else None)
    if args.evaluate_first:
        trainer.evaluate()
    trainer.train(resume_from_checkpoint=args.resume)
    if args.system == "fgpsdp":
        trainer.model_wrapped.synchronize()  # the last step's all-gathers landed
    if dist.get_rank() == 0:
        torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, args.out)
        # (The plain Trainer's is torch DDP, but not after an evaluate() before train().)
        wrapped = type(trainer.model_wrapped)
        print(f"[{args.system}] trained {wrapped.__module__}.{wrapped.__qualname__}",
              flush=True)
    dist.barrier()
    # What holds the gloo group goes first (torch DDP's models): freed at interpreter
    # exit instead, after the group is destroyed, its destructor can hang, joining
    # gloo's thread while holding the GIL that thread waits for (seen under accelerate).
    trainer.accelerator.free_memory()
    del trainer, module
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
