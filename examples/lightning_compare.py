"""fgpsdp under Lightning's Trainer against Lightning's torch DDP
(examples/lightning_trainer.py, 2 CPU processes with gloo for each run).

    pip install lightning
    python examples/lightning_compare.py

Prints the largest parameter difference of each pair after 2 epochs of 8 batches (16
optimizer steps, 8 with accumulation), clipping on every step: fgpsdp against torch DDP
as they are, with gradient accumulation, with ``ddp_comm_hook=fp16_compress_hook``
(registered on CPU by both strategies of the example; float16 rounds the 1/N division
otherwise, so that pair may differ by 1e-5), clipping by value, a torch optimizer returned
by configure_optimizers (the strategy converts it), a StepLR stepped every 4 steps,
bf16 autocast, a bfloat16 model (``precision="bf16-true"``) clipped by value and by
norm, float16 loss scaling, a second fit with a new Trainer, each step's
per-parameter gradient norms logged in ``on_before_optimizer_step`` (with the
parameters: ``opt.grad_norms()`` against ``p.grad.norm()``), and resumed from
a checkpoint saved after the first epoch (a resumed run that lost the optimizer's
state, Adam's moments, would differ from the uninterrupted one); and that a torch
optimizer returned with a scheduler is refused, and so is a clip by norm of a torch
optimizer over part of the model (Lightning's measures the optimizer's parameters, the
sharded clip every gradient). ``--check`` exits 1 when a pair with fgpsdp differs by
more than 1e-6 (the float16 hook's 1e-5, the bfloat16 model clipped by norm 1e-2), or
a refusal is missing.
"""
from __future__ import annotations

import os
import sys
import tempfile

from compare_runs import (check_refusal, free_port_below_ephemeral_range, parse_check,
                          print_table, rows_against_torch, run_both)

TRAINER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_trainer.py")

# name: the trainer's arguments
RUNS = {
    "plain": [],
    "accumulate": ["--accumulate", "2"],
    "fp16_comm_hook": ["--comm-hook", "fp16_compress_hook"],
    "bf16": ["--precision", "bf16-mixed"],
    # A bfloat16 model: bitwise with clipping by value; by norm torch's clip takes its
    # coefficient in bfloat16 (fgpsdp's in float64), a few bfloat16 places apart.
    "bf16_true": ["--precision", "bf16-true", "--clip-algorithm", "value"],
    "bf16_true_clip_by_norm": ["--precision", "bf16-true"],
    "fp16_scaler": ["--precision", "16-mixed-scaler"],
    "clip_by_value": ["--clip-algorithm", "value"],
    "torch_optimizer": ["--torch-optimizer"],
    "lr_scheduler": ["--scheduler"],
    "refit": ["--refit"],
    # Each step's per-parameter gradient norms (opt.grad_norms() / p.grad.norm()),
    # compared with the parameters.
    "grad_norms": ["--log-grad-norms"],
    "epoch_1": ["--epochs", "1", "--save", "{dir}/{system}.ckpt"],
    "resumed": ["--resume", "{dir}/{system}.ckpt"],
}


def trainer(system: str, params: str, args: list[str]) -> list[str]:
    """The command of one Lightning run, which starts its ranks itself; and a port for
    them in MASTER_PORT, which the run inherits. Lightning would pick a free one, close
    it and bind it later: CI runs this beside the Fabric and Accelerate comparisons,
    whose stores and sockets could take it meanwhile."""
    os.environ["MASTER_PORT"] = str(free_port_below_ephemeral_range())
    return [sys.executable, TRAINER, system, params, *args]


def main() -> None:
    check = parse_check(__doc__)
    with tempfile.TemporaryDirectory() as tmp:
        out = run_both(RUNS, trainer, tmp)
        rows = rows_against_torch(out, [name for name in RUNS if name != "epoch_1"])
        rows.append(("(scale: torch DDP after epoch 1 against epoch 2)", out("torch", "epoch_1"),
                     out("torch", "plain")))
        rows.append(("(scale: torch DDP with fp16_compress_hook against without)",
                     out("torch", "fp16_comm_hook"), out("torch", "plain")))
        # torch's hook casts to float16, then divides by the world size; fgpsdp divides
        # first: gradients below float16's normal range are rounded once more by torch's.
        print_table(rows, check, {"fgpsdp against torch DDP: fp16_comm_hook": 1e-5,
                                  # Up to two bfloat16 places of weights below 1 after
                                  # 16 clipped steps: 3.9e-3 measured.
                                  "fgpsdp against torch DDP: bf16_true_clip_by_norm": 1e-2})
        # Lightning's clip by norm measures the optimizer's parameters alone.
        check_refusal("a clip by norm of an optimizer over part of the model",
                      trainer("fgpsdp", os.path.join(tmp, "no.pt"),
                              ["--head-only-optimizer", "--epochs", "1"]),
                      "steps only some of the model's trainable parameters", check)
        # A scheduler returned with a torch optimizer would schedule it alone.
        check_refusal("a torch optimizer returned with an lr scheduler",
                      trainer("fgpsdp", os.path.join(tmp, "no.pt"),
                              ["--torch-optimizer", "--scheduler", "--epochs", "1"]),
                      "Under Lightning, build the ShardedOptimizer in configure_optimizers", check)


if __name__ == "__main__":
    main()
