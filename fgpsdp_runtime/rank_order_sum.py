"""The reduce-scatter's sum of the ranks' chunks: one order on every transport.

Shared memory sums a chunk in rounds of a slot's size, gloo's point-to-point
path sums it whole, and the hierarchy sums a node's chunk before the rail's; the
bits of each element must not depend on which of these ran, or on where a round
cut the chunk. ``torch.sum(rows, dim=0)`` does not promise that: on CPU, from 5
rows of float32 or float64 on, it adds some columns in another order than others
depending on the row length (on torch 2.13 the two transports were one bit apart on
some elements with 5 ranks in a node and 25 MB buckets; tests/test_rank_order_sum.py
shows the order). So each element is added here left to right, rank 0's chunk first,
with plain additions whose result depends on nothing but their operands.
"""
from __future__ import annotations

import torch

# torch.sum of 16-bit floats adds in float32 and rounds once; so does this.
_ACCUMULATE_IN_FLOAT32 = (torch.float16, torch.bfloat16)


def sum_in_rank_order(rows: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = ((rows[0, i] + rows[1, i]) + rows[2, i]) + ...`` for a (n, m) ``rows``.

    ``out`` (m elements, ``rows``' dtype) must not overlap ``rows``.
    """
    n = rows.shape[0]
    if n == 1:
        out.copy_(rows[0])
    elif rows.dtype in _ACCUMULATE_IN_FLOAT32:
        total = rows[0].float()
        for row in rows[1:]:
            total.add_(row)
        out.copy_(total)
    else:
        torch.add(rows[0], rows[1], out=out)
        for row in rows[2:]:
            out.add_(row)
