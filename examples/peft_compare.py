"""LoRA fine-tuning with peft under fgpsdp against torch DDP: examples/peft_lora.py,
2 CPU processes with gloo for each run (torchrun).

    pip install transformers peft
    python examples/peft_compare.py

Prints the largest difference of the merged weights of each pair after 12 steps,
clipping on every step: as they are, with torch DDP's clip summing its norm in float64
as fgpsdp's does (the flag changes torch's run only), with gradient checkpointing
(reentrant and not), with the output layer trained whole beside the adapters (peft's
``modules_to_save``), and resumed from the adapter and optimizer state saved at step 6
(a resumed run that lost the optimizer's state, Adam's moments, would differ from the
uninterrupted one). ``--check`` exits 1 when a pair with fgpsdp differs by more than
1e-6.
"""
from __future__ import annotations

import os
import tempfile

from compare_runs import parse_check, print_table, rows_against_torch, run_both, torchrun

LOOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peft_lora.py")

# name: the loop's arguments ("saving" runs 12 steps too, saving at step 6)
RUNS = {
    "plain": [],
    "torch_clip_in_float64": ["--float64-clip"],
    "checkpointing_reentrant": ["--checkpointing", "reentrant"],
    "checkpointing_nonreentrant": ["--checkpointing", "nonreentrant"],
    "lm_head_trained": ["--modules-to-save", "lm_head"],
    "saving": ["--save", "{dir}/{system}_saved"],
    "resumed": ["--resume", "{dir}/{system}_saved"],
    "six_steps": ["--steps", "6"],
}


def main() -> None:
    check = parse_check(__doc__)
    with tempfile.TemporaryDirectory() as tmp:
        out = run_both(RUNS, torchrun(LOOP), tmp)
        rows = rows_against_torch(out, [name for name in RUNS
                                        if name not in ("saving", "six_steps")])
        rows.append(("(scale: torch DDP after 6 steps against 12)", out("torch", "six_steps"),
                     out("torch", "plain")))
        print_table(rows, check)


if __name__ == "__main__":
    main()
