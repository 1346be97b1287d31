"""Whether a workload's training step runs into subnormal floats, and what they cost.

One process, one thread, no communication: three forward + backward passes of the
workload's model on one batch, with and without ``torch.set_flush_denormal(True)``;
prints the time of the last pass and how many gradient and parameter elements are
subnormal (nonzero, below float32's smallest normal number). Some CPUs run
arithmetic on subnormals many times slower, which then dominates a benchmark's
compute-only floor (BERT on an Intel Xeon VM: docs/benchmarks/2026-12-01-emulated-2x2-schedules-head.md).

    python bench/subnormal_check.py --workload bert
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from workloads import CONFIGS, build_model, loss_fn, make_batch  # noqa: E402

SMALLEST_NORMAL = torch.finfo(torch.float32).tiny


def subnormal_count(tensors) -> int:
    return sum(int(((t.abs() < SMALLEST_NORMAL) & (t != 0)).sum()) for t in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="bert")
    parser.add_argument("--size", default="cpu", choices=["cpu", "full"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = CONFIGS[(args.workload, args.size)]
    for flush in (False, True):
        torch.set_flush_denormal(flush)
        torch.manual_seed(0)
        model = build_model(cfg)
        loss = loss_fn(cfg)
        x, y = make_batch(cfg, 0, 0)
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss(model(x), y).backward()
            seconds = time.perf_counter() - t0
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        print(f"{args.workload} flush_denormal={flush}: forward + backward {seconds:.3f} s; "
              f"subnormal elements: gradients {subnormal_count(grads)}, "
              f"parameters {subnormal_count(model.parameters())}")
    torch.set_flush_denormal(False)


if __name__ == "__main__":
    main()
