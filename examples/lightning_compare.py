"""fgpsdp under Lightning's Trainer against Lightning's torch DDP
(examples/lightning_trainer.py, 2 CPU processes with gloo for each run).

    pip install lightning
    python examples/lightning_compare.py

Prints the largest parameter difference of each pair after 2 epochs of 8 batches
(16 optimizer steps, 8 with accumulation), clipping on every step: fgpsdp against torch DDP as they are, with gradient
accumulation, bf16 autocast, float16 loss scaling, a second fit with a new Trainer,
and resumed from a checkpoint saved after the first epoch (a resumed run that lost
the optimizer's state, Adam's moments, would differ from the uninterrupted one).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch

TRAINER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_trainer.py")

# name: the trainer's arguments
RUNS = {
    "plain": [],
    "accumulate": ["--accumulate", "2"],
    "bf16": ["--precision", "bf16-mixed"],
    "fp16_scaler": ["--precision", "16-mixed-scaler"],
    "refit": ["--refit"],
    "epoch_1": ["--epochs", "1", "--save", "{dir}/{system}.ckpt"],
    "resumed": ["--resume", "{dir}/{system}.ckpt"],
}


def run(command: list[str], tries: int = 3) -> None:
    """Lightning's torch DDP runs on CPU abort now and then at exit, after training
    ("terminate called without an active exception", SIGABRT; also without fgpsdp
    imported): such a run is run again, and said so."""
    for attempt in range(1, tries + 1):
        code = subprocess.run(command).returncode
        if code == 0:
            return
        print(f"[lightning_compare] exit code {code} (try {attempt} of {tries}): "
              + " ".join(command[1:]), flush=True)
    raise SystemExit(f"failed {tries} times: {' '.join(command)}")


def max_diff(a: str, b: str) -> float:
    pa, pb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return max(float((pa[k] - pb[k]).abs().max()) for k in pa)


# --check: what fgpsdp's runs may differ by (float32 rounding of the clip's norm).
TOLERANCE = 1e-6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help=f"exit 1 if a pair with fgpsdp differs by more than {TOLERANCE:g}")
    check = parser.parse_args().check
    with tempfile.TemporaryDirectory() as tmp:
        out = lambda system, name: os.path.join(tmp, f"{system}_{name}.pt")  # noqa: E731
        for name, extra in RUNS.items():
            for system in ("torch", "fgpsdp"):
                args = [a.format(dir=tmp, system=system) for a in extra]
                run([sys.executable, TRAINER, system, out(system, name), *args])
        rows = [(f"fgpsdp against torch DDP: {name}", out("fgpsdp", name), out("torch", name))
                for name in RUNS if name != "epoch_1"]
        rows += [(f"{system} resumed against {system} uninterrupted",
                  out(system, "resumed"), out(system, "plain")) for system in ("fgpsdp", "torch")]
        rows.append(("(scale: torch DDP after epoch 1 against epoch 2)", out("torch", "epoch_1"),
                     out("torch", "plain")))
        print(f"\n{'pair':<52} max |param difference|")
        failed = []
        for label, a, b in rows:
            diff = max_diff(a, b)
            print(f"{label:<52} {diff:.3g}")
            if "fgpsdp" in label and not diff <= TOLERANCE:
                failed.append(label)
        if check and failed:
            raise SystemExit(f"over {TOLERANCE:g}: {'; '.join(failed)}")


if __name__ == "__main__":
    main()
