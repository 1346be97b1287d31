"""The tensors behind one bucket: flat parameters, gradient slice, send buffer.

[Note: parameters are views of the bucket]
At construction every trainable parameter's storage is moved into its
bucket's flat buffer (``param.data`` becomes a view). The all-gather of
updated slices therefore writes straight into the model's parameters and no
unpack copy is needed; the optimizer's slice tensors are views of the same
buffer, so the inner ``torch.optim`` optimizer updates this rank's slice in
place.

[Note: parameters keep their memory layout]
A parameter stored in another order than row-major (a conv weight after
``model.to(memory_format=torch.channels_last)``, a transposed weight) keeps
that layout, as under torch DDP: its span holds its elements in memory order
and the parameter becomes a view of it with its own strides
(``ParamSpan.strides``), so cuDNN and oneDNN keep running their channels-last
kernels without converting the weight at every forward. Gradients (which
autograd lays out like their parameter) and checkpointed optimizer state move
in and out of a span through ``to_bucket_order``, a view when they already
have that layout. Row-major parameters, and those not dense in memory, are
stored row-major.

[Note: gradient memory]
Only this rank's reduced slice of the gradient (``grad_shard``, 1/N of the
bucket) lives from one step to the next. The full-size send buffer exists
from the first gradient of the bucket until its reduce-scatter has landed,
and each parameter's own ``.grad`` is released as soon as it is packed, so
gradient memory per rank is one slice plus the buckets in flight (ZeRO-2).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .layout import BucketLayout, ParamSpan


class BucketStorage:
    """Flat parameter buffer, persistent gradient slice and transient send buffer."""

    def __init__(self, layout: BucketLayout, params: Sequence[torch.nn.Parameter],
                 slice_index: int, reduce_dtype: Optional[torch.dtype] = None):
        # params[i] is the parameter of layout.spans[i]; slice_index is the
        # slice this rank owns (topology.NodeLayout.slice_index).
        self.layout = layout
        first = params[0]
        self.dtype = first.dtype
        self.device = first.device
        self.set_reduce_dtype(reduce_dtype)
        self.flat_param = torch.zeros(layout.padded_numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for span, param in zip(layout.spans, params):
                view = span_as_param(self.span_view(self.flat_param, span), param.shape,
                                     span.strides)
                view.copy_(param.detach())
                param.data = view
        self.shard_start, self.shard_end = layout.shard_range(slice_index)
        # This rank's slice of the parameters: what its optimizer updates and
        # what it contributes to the all-gather.
        self.param_shard = self.flat_param[self.shard_start:self.shard_end]
        # The reduced, averaged gradient of this rank's slice.
        self.grad_shard = torch.zeros(layout.shard_numel, dtype=self.dtype, device=self.device)
        # False while grad_shard holds nothing: the next reduce-scatter writes
        # into it instead of adding (zero_grad(set_to_none=True) semantics).
        self.grad_shard_valid = False
        self.send_buffer: Optional[torch.Tensor] = None
        # The elements of no parameter: the gaps that align each parameter's start
        # (layout.param_alignment_for) and the tail padding.
        self._filler_index = torch.tensor(
            [i for lo, hi in layout.filler_ranges() for i in range(lo, hi)],
            dtype=torch.long, device=self.device)

    @staticmethod
    def span_view(flat: torch.Tensor, span: ParamSpan) -> torch.Tensor:
        return flat[span.bucket_offset:span.bucket_end]

    def set_reduce_dtype(self, reduce_dtype: Optional[torch.dtype]) -> None:
        """What gradients travel in (None: the parameters' dtype): packed (scaled,
        cast) into it, reduced in it, and cast back into grad_shard when their
        reduce-scatter lands."""
        self.reduce_dtype = reduce_dtype or self.dtype

    def set_grad_dtype(self, dtype: torch.dtype) -> None:
        """Keep the reduced gradient slice in ``dtype`` (float32 under the optimizer's
        ``master_weights``: the slice is what the float32 master weights step with, and
        the clip scales it there). What it holds is kept, cast."""
        if dtype != self.grad_shard.dtype:
            self.grad_shard = self.grad_shard.to(dtype)

    def acquire_send_buffer(self) -> torch.Tensor:
        """The bucket-sized buffer that gradients are packed into."""
        if self.send_buffer is None:
            buf = torch.empty(self.layout.padded_numel, dtype=self.reduce_dtype,
                              device=self.device)
            # Padding and alignment gaps take part in the sum: zeros, in one indexed fill.
            buf.index_fill_(0, self._filler_index, 0)
            self.send_buffer = buf
        return self.send_buffer

    def release_send_buffer(self) -> None:
        self.send_buffer = None

    def invalidate_grad_shard(self) -> None:
        self.grad_shard_valid = False

    def zero_grad_shard(self) -> None:
        self.grad_shard.zero_()
        self.grad_shard_valid = True


def _outer_to_inner(strides: Sequence[int]) -> list[int]:
    return sorted(range(len(strides)), key=lambda d: (-strides[d], d))


def layout_strides(t: torch.Tensor) -> Optional[tuple[int, ...]]:
    """``t``'s strides, kept in its bucket, when it is dense in memory but not
    row-major; None when it is stored row-major (it is, or it is not dense).
    Exact strides, not just an order: a size-1 dim's stride is free, and torch
    reads it (a channels_last ``Conv2d(1, C, k)`` weight is (9, 1, 3, 1), which
    cuDNN's and oneDNN's format choice tells from row-major (9, 9, 3, 1))."""
    if t.dim() < 2 or t.numel() == 0:
        return None
    if tuple(t.stride()) == _row_major_strides(t.shape) \
            or not t.permute(_outer_to_inner(t.stride())).is_contiguous():
        return None
    return tuple(t.stride())


def _row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def memory_dim_order(t: torch.Tensor) -> Optional[tuple[int, ...]]:
    """The order ``t``'s elements lie in its bucket, as its dims longer than 1
    from outermost to innermost; None for row-major order. Ranks must agree on it."""
    strides = layout_strides(t)
    if strides is None:
        return None
    order = tuple(d for d in _outer_to_inner(strides) if t.shape[d] > 1)
    return None if list(order) == sorted(order) else order


def to_bucket_order(t: torch.Tensor, strides: Optional[Sequence[int]]) -> torch.Tensor:
    """``t``'s elements flat, in the order of a span laid out with ``strides``: a
    view when ``t`` is laid out so (size-1 dims aside), else a copy."""
    if strides is None:
        return t.reshape(-1)
    return t.permute(_outer_to_inner(strides)).reshape(-1)


def span_as_param(span: torch.Tensor, shape: Sequence[int],
                  strides: Optional[Sequence[int]]) -> torch.Tensor:
    """A flat span viewed as its parameter: ``shape`` with ``strides`` (row-major if None)."""
    if strides is None:
        return span.view(shape)
    return span.as_strided(shape, strides)
