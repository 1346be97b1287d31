"""How the forward-ordered step is cut into inner optimizer steps (pure arithmetic).

Under the schedules whose all-gathers overlap the next forward, opt.step() steps
the buckets in forward order, in runs of consecutive buckets ("chunks"), and
queues each chunk's all-gathers as soon as it is stepped, so that the next
forward's first buckets are on the wire while later slices are stepped. The
inner optimizers are element-wise, so one step per chunk equals one step over
all of them. Each inner step costs a fixed few hundred microseconds of Python
(torch's step, the group copies of step_wide_state.py) whatever its size, so a
small model is stepped in fewer chunks: one per ``FGPSDP_STEP_CHUNK_MIN_ELEMENTS``
elements of a rank's slices, at most MAX_STEP_CHUNKS (a 5-bucket MLP of 115k
parameters, 2 CPU ranks, next_forward: the whole step in 0.84-0.87x the time in
one inner step instead of five, docs/benchmarks/2026-12-05-step-chunks-cpu.md).
The count is the same on every rank: the shard sizes are.
"""
from __future__ import annotations

import os
from typing import Sequence

# The forward-ordered step runs the inner optimizer at most this many times per step.
MAX_STEP_CHUNKS = 16


def step_chunk_min_elements() -> int:
    """The fewest elements of a rank's slices per inner step:
    ``FGPSDP_STEP_CHUNK_MIN_ELEMENTS``, 2**18 by default (with 1, every model is
    chunked as finely as MAX_STEP_CHUNKS allows, as before 2026-12-05)."""
    value = int(os.environ.get("FGPSDP_STEP_CHUNK_MIN_ELEMENTS", str(1 << 18)))
    if value < 1:
        raise ValueError(f"FGPSDP_STEP_CHUNK_MIN_ELEMENTS must be >= 1, got {value}")
    return value


def step_chunk_count(shard_elements: int, min_elements: int) -> int:
    """Inner steps for ``shard_elements`` elements of a rank's slices: between 1 and
    MAX_STEP_CHUNKS, one per ``min_elements``."""
    return max(1, min(MAX_STEP_CHUNKS, shard_elements // min_elements))


def split_evenly(items: Sequence[int], parts: int) -> list[list[int]]:
    """Consecutive runs of ``items``, at most ``parts`` of them, sizes differing by <= 1."""
    n = len(items)
    parts = max(1, min(parts, n))
    bounds = [n * i // parts for i in range(parts + 1)]
    return [list(items[lo:hi]) for lo, hi in zip(bounds, bounds[1:]) if lo < hi]
