"""This rank's figures of the global gradient norm, and the norm from their sum.

Every clip, and the step's skip on an inf or NaN, takes one norm over the whole
model. Each rank gives float64 [sum of squares, non-finite flag] of what it
counts: its reduced slices (with a ``model_parallel_group``, only the elements
model_parallel_norm.py says it counts) and, with ``clip_ignored_parameters``,
the gradients of the parameters the wrapper leaves to the user (1/r each where
r ranks hold them). The wrapper's group sums them, then the model- and
pipeline-parallel groups. When to measure (per bucket before a speculative
step, once per step, again after a clip) is the optimizer's.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.distributed as dist

from .group_collectives import all_reduce_held
from .ignored_params import ignored_gradients, squares_of
from .ops import multi_tensor_sq_norm

if TYPE_CHECKING:  # imported for annotations only
    from .ddp import DistributedDataParallel


class NormFigures:
    def __init__(self, model: "DistributedDataParallel",
                 counted: Sequence[Optional[list[tuple[int, int]]]],
                 clip_ignored_parameters: bool, ignored_parameter_replicas: int,
                 model_parallel_group: Optional[dist.ProcessGroup],
                 pipeline_parallel_group: Optional[dist.ProcessGroup]):
        self._model = model
        # Per bucket: the (lo, hi) ranges of this rank's slice the norm counts, or
        # None for all of it (model_parallel_norm.counted_ranges).
        self._counted = counted
        self._clip_ignored = clip_ignored_parameters
        self._replicas = ignored_parameter_replicas
        # The groups the norm is summed over after the wrapper's, in that order.
        self._groups = [(group, what) for group, what in (
            (model_parallel_group, "norm over the model-parallel group"),
            (pipeline_parallel_group, "norm over the pipeline-parallel group"))
            if group is not None]

    @property
    def sums_over_model_parallel(self) -> bool:
        return bool(self._groups)

    def of_bucket(self, b: int) -> torch.Tensor:
        """Those of what the norm counts of bucket b's reduced slice: all of it, but
        with a model_parallel_group only the parameters this rank counts."""
        shard = self._model.buckets[b].grad_shard
        ranges = self._counted[b]
        if ranges is None:
            return multi_tensor_sq_norm([shard])
        figures = multi_tensor_sq_norm([shard[lo:hi] for lo, hi in ranges]) if ranges \
            else torch.zeros(2, dtype=torch.float64, device=shard.device)
        # An inf or NaN counts wherever it is, as Megatron's found_inf: a replica's
        # gradient that differs from the first rank's must still skip the step.
        figures[1] += (~torch.isfinite(shard)).any().to(torch.float64)
        return figures

    def ignored_grads(self) -> list[torch.Tensor]:
        """With ``clip_ignored_parameters``: this rank's gradients of the parameters
        the wrapper leaves to the user, which the norm covers and the clip scales."""
        if not self._clip_ignored:
            return []
        return ignored_gradients(self._model.named_ignored_parameters())

    def add_ignored(self, local: torch.Tensor) -> None:
        """Adds to ``local`` those of ``ignored_grads()``, after this rank's slices':
        each rank's own are counted once, or 1/r each where r ranks hold them
        (``ignored_parameter_replicas``). Nothing to do (no tensor made) without
        ``clip_ignored_parameters``."""
        grads = self.ignored_grads()
        if grads:
            mine = multi_tensor_sq_norm(squares_of(grads)).to(local.device)
            if self._replicas != 1:  # (exact for a power of 2)
                mine[0] /= self._replicas
            local += mine

    def summed_over_model_parallel(self, figures: torch.Tensor) -> torch.Tensor:
        """``figures`` (summed over the wrapper's group) summed over the
        model_parallel_group, then over the pipeline_parallel_group, where given."""
        if not self._groups:
            return figures
        figures = figures.clone()
        for group, what in self._groups:
            all_reduce_held(figures, dist.ReduceOp.SUM, group, what)
        return figures


def norm_from(sq_sum: float, nonfinite: float) -> float:
    """The L2 norm from all-reduced [sum of squares, non-finite flag]: NaN where an
    element is NaN, as torch's clip_grad_norm_ returns then (also once
    clip_grad_value_ has clamped the infs beside it), inf where one is inf."""
    if math.isnan(sq_sum):
        return math.nan
    return math.inf if nonfinite else math.sqrt(sq_sum)
