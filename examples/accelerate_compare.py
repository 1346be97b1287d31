"""fgpsdp in a plain Accelerate loop against accelerate's own torch DDP:
examples/accelerate_loop.py, 2 CPU processes with gloo for each run (torchrun).

    pip install accelerate
    python examples/accelerate_compare.py

Prints the largest parameter difference of each pair after 16 optimizer steps, clipping
on every step: as they are, with gradient accumulation (2 batches a step), with bf16
mixed precision, and resumed from the save_state at step 8 (a resumed run that lost the
optimizer's state, Adam's moments, would differ from the uninterrupted one). ``--check``
exits 1 when a pair with fgpsdp differs by more than 1e-6.
"""
from __future__ import annotations

import os
import tempfile

from compare_runs import parse_check, print_table, rows_against_torch, run_both, torchrun

LOOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "accelerate_loop.py")

# name: the loop's arguments ("saving" runs 16 steps too, saving at step 8)
RUNS = {
    "plain": [],
    "accumulate": ["--accumulate", "2"],
    "bf16": ["--mixed-precision", "bf16"],
    "saving": ["--save", "{dir}/{system}_state"],
    "resumed": ["--resume", "{dir}/{system}_state"],
}


def main() -> None:
    check = parse_check(__doc__)
    with tempfile.TemporaryDirectory() as tmp:
        # (torchrun, not `accelerate launch`: it needs no accelerate config, and on CPU
        # accelerate takes the gloo process group from torchrun's environment.)
        out = run_both(RUNS, torchrun(LOOP), tmp)
        rows = rows_against_torch(out, ["plain", "accumulate", "bf16", "resumed"])
        print_table(rows, check)


if __name__ == "__main__":
    main()
