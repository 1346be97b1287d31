"""fgpsdp's Fabric strategy against Fabric's own torch DDP strategy, the same loop
(examples/fabric_loop.py), 2 CPU processes with gloo for each run (torchrun).

    pip install lightning
    python examples/fabric_compare.py

Prints the largest parameter difference of each pair after 16 optimizer steps,
clipping on every step and an lr schedule: as they are, with gradient accumulation
(2 batches a step), with bf16 mixed precision, with float16 loss scaling, clipping by
value, with the model and the optimizer set up apart (fabric.setup_module, then
fabric.setup_optimizers), and resumed from the fabric.save at step 8 (a resumed run
that lost the optimizer's state, Adam's moments, would differ from the uninterrupted
one); and that fgpsdp's strategy refuses fabric.clip_gradients by norm where the
optimizer steps part of the model. ``--check`` exits 1 when a pair with fgpsdp differs
by more than 1e-6, or the refusal is missing.
"""
from __future__ import annotations

import os
import tempfile

from compare_runs import (check_refusal, parse_check, print_table, rows_against_torch,
                          run_both, torchrun)

LOOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fabric_loop.py")

# name: the loop's arguments ("saving" runs 16 steps too, saving at step 8)
RUNS = {
    "plain": [],
    "accumulate": ["--accumulate", "2"],
    "bf16": ["--precision", "bf16-mixed"],
    "fp16": ["--precision", "16-mixed"],
    "clip_value": ["--clip", "value"],
    "separate_setup": ["--separate-setup"],
    "saving": ["--save", "{dir}/{system}.ckpt"],
    "resumed": ["--resume", "{dir}/{system}.ckpt"],
}


def main() -> None:
    check = parse_check(__doc__)
    with tempfile.TemporaryDirectory() as tmp:
        out = run_both(RUNS, torchrun(LOOP), tmp)
        rows = rows_against_torch(out, ["plain", "accumulate", "bf16", "fp16", "clip_value",
                                        "separate_setup", "resumed"])
        rows += [(f"{system} saving against {system} plain (the save changes nothing)",
                  out(system, "saving"), out(system, "plain"))
                 for system in ("fgpsdp", "torch")]
        # (Printed, not checked: its label names no fgpsdp run.)
        rows.append(("torch fp16 against torch plain (float16 changes the result)",
                     out("torch", "fp16"), out("torch", "plain")))
        print_table(rows, check)
        # Fabric's clip by norm measures the optimizer's parameters, the sharded clip
        # every reduced gradient: refused where they differ.
        check_refusal("fabric.clip_gradients by norm of an optimizer over the first layer "
                      "alone",
                      torchrun(LOOP)("fgpsdp", os.path.join(tmp, "part.pt"),
                                     ["--optimize", "first-layer", "--steps", "1"]),
                      "steps only some of the model's trainable parameters", check)


if __name__ == "__main__":
    main()
