"""Bucket layout: which parameter lives where, and which slice each rank owns.

Pure arithmetic, no communication and no tensors, so it can be unit-tested and
property-tested without processes.

[Note: fine-grained slices]
Every bucket is one flat buffer holding several parameters one after another,
each starting aligned as torch would allocate it (param_alignment_for; zeros in
the gaps). The buffer is padded so that it splits into ``world_size`` equal, aligned,
contiguous slices; rank ``r`` owns slice ``r`` of every bucket. Ownership is
at element granularity: a parameter may straddle two or more slices, so every
rank owns (and sends, and receives) the same number of bytes whatever the mix
of tensor sizes. Per-parameter partitioning (ZeroRedundancyOptimizer,
DeepSpeed's group partition) instead hands whole tensors to owners and can be
off by orders of magnitude on a model with one large tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

# Slice starts are aligned to this many bytes so that vectorised kernels and
# NCCL see aligned pointers; padding stays below world_size * SLICE_ALIGN_BYTES.
SLICE_ALIGN_BYTES = 128
# Each parameter's span starts on this many bytes, as a parameter torch allocates on
# its own does (the CPU allocator aligns to 64 bytes): torch's CPU kernels take other
# code paths, which round differently, for a tensor whose data is not so aligned (a
# Linear(64, 1) forward, a batch of 1 or 5, through an MKL gemv), and the parameters
# are the views the forward reads, so a packed layout broke bitwise parity with DDP.
PARAM_ALIGN_BYTES = 64
# On CUDA: torch tells cuBLASLt each operand's alignment, up to 256 bytes, and its
# heuristics choose the kernel by it (ATen's CUDABlas _getAlignment); the caching
# allocator gives a parameter of its own 512. Not yet run on a GPU.
CUDA_PARAM_ALIGN_BYTES = 256


def param_alignment_for(device_type: str) -> int:
    """Where ``plan_buckets`` starts each parameter, for parameters on ``device_type``."""
    return CUDA_PARAM_ALIGN_BYTES if device_type == "cuda" else PARAM_ALIGN_BYTES


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class ParamSpan:
    """One parameter's place in its bucket."""

    param_index: int  # index into the wrapper's list of trainable parameters
    bucket_offset: int  # first element in the bucket's flat buffer
    numel: int
    # The parameter's strides, its elements lying in the span in that memory
    # order: None for row-major; (27, 1, 9, 3) for a channels_last 3x3 conv
    # weight of 3 input channels. See [Note: parameters keep their memory
    # layout] in buckets.py.
    strides: Optional[tuple[int, ...]] = None

    @property
    def bucket_end(self) -> int:
        return self.bucket_offset + self.numel


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that falls into one rank's slice."""

    param_index: int
    param_offset: int  # first element within the parameter, in its span's memory order
    bucket_offset: int  # first element within the bucket's flat buffer
    numel: int


@dataclass(frozen=True)
class BucketLayout:
    """A flat bucket of same-dtype parameters cut into equal slices."""

    index: int
    dtype_name: str  # e.g. "float32"; a string keeps the layout torch-free
    element_size: int
    spans: tuple[ParamSpan, ...]
    world_size: int
    padded_numel: int

    @property
    def numel(self) -> int:
        """Elements up to the last parameter's end (the padding after it excluded;
        the gaps that align each parameter's start included)."""
        return self.spans[-1].bucket_end if self.spans else 0

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def nbytes(self) -> int:
        return self.padded_numel * self.element_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank's slice in the bucket's flat buffer."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def filler_ranges(self) -> tuple[tuple[int, int], ...]:
        """[start, end) ranges of the flat buffer that hold no parameter: the gaps
        that align each parameter's start, then the padding after the last one.
        They take part in every sum, so a buffer gradients are packed into holds
        zeros there."""
        ranges, end = [], 0
        for span in self.spans:
            if span.bucket_offset > end:
                ranges.append((end, span.bucket_offset))
            end = span.bucket_end
        if self.padded_numel > end:
            ranges.append((end, self.padded_numel))
        return tuple(ranges)

    def owned_numel(self, rank: int) -> int:
        """Parameter elements (not padding) in rank's slice."""
        return sum(piece.numel for piece in self.shard_pieces(rank))

    def shard_pieces(self, rank: int) -> tuple[ShardPiece, ...]:
        """The parameter pieces inside rank's slice, in bucket order."""
        start, end = self.shard_range(rank)
        pieces = []
        for span in self.spans:
            lo = max(start, span.bucket_offset)
            hi = min(end, span.bucket_end)
            if lo < hi:
                pieces.append(
                    ShardPiece(
                        param_index=span.param_index,
                        param_offset=lo - span.bucket_offset,
                        bucket_offset=lo,
                        numel=hi - lo,
                    )
                )
        return tuple(pieces)


@dataclass(frozen=True)
class ParamInfo:
    """What the layout needs to know of a parameter."""

    numel: int
    dtype_name: str
    element_size: int
    strides: Optional[tuple[int, ...]] = None  # as ParamSpan.strides


# Default bucket cap: about this many buckets per model, between the bounds.
DEFAULT_BUCKETS_PER_MODEL = 16
DEFAULT_BUCKET_CAP_BOUNDS_MB = (1.0, 25.0)
# As torch DDP: the first bucket backward fills closes at 1 MB (or at the
# bucket cap, if smaller). None: at the bucket cap.
FIRST_BUCKET_CAP_MB: float | None = 1.0


def first_bucket_cap_bytes() -> int | None:
    """``plan_buckets``' first_bucket_cap_bytes for FIRST_BUCKET_CAP_MB (read at each call)."""
    return int(FIRST_BUCKET_CAP_MB * 2**20) if FIRST_BUCKET_CAP_MB else None


def default_bucket_cap_mb(param_bytes: int) -> float:
    """The bucket cap when the caller gives none: 1/16 of the model, 1 to 25 MB.

    [Note: why not torch DDP's fixed 25 MB]
    A bucket is also the unit of the parameter exchange the next forward
    waits for, and the last bucket to be reduced holds the first layers: its
    reduce-scatter, step and all-gather sit between backward and the next
    forward. With 25 MB buckets a model of 17M parameters has two or three
    buckets and little to pipeline; with ~16 the exchange follows forward
    layer by layer (measured on the emulated cluster, 13-24M-parameter
    models: 1-21% shorter steps and peak memory down to DDP's, while torch DDP
    gained nothing from smaller buckets; docs/benchmarks/*-bucket-*.md). The
    upper bound is DDP's 25 MB, so a large model gets DDP's bucketing and its
    per-collective overhead, not more.
    """
    lo, hi = DEFAULT_BUCKET_CAP_BOUNDS_MB
    return min(hi, max(lo, param_bytes / DEFAULT_BUCKETS_PER_MODEL / 2**20))


def plan_buckets(
    params: Sequence[ParamInfo],
    *,
    bucket_cap_bytes: int,
    world_size: int,
    first_bucket_cap_bytes: int | None = None,
    bucket_caps_bytes: Sequence[int] | None = None,
    order: Iterable[int] | None = None,
    align_bytes: int = SLICE_ALIGN_BYTES,
    param_align_bytes: int = PARAM_ALIGN_BYTES,
) -> tuple[BucketLayout, ...]:
    """Group parameters into buckets of at most ``bucket_cap_bytes`` each.

    ``order`` is the order gradients are expected to become ready (by default
    reverse registration order, as backward usually produces them). A bucket
    holds one dtype and closes once its parameters' bytes reach the cap (torch
    DDP's rule), so they exceed it only by its last parameter (the buffer also
    holds the alignment gaps, under ``param_align_bytes`` a parameter). The first bucket to close
    closes at ``first_bucket_cap_bytes`` when that is smaller (torch DDP's
    1 MB first bucket): backward fills it first, and the sooner it closes the
    sooner the links start. ``bucket_caps_bytes`` (torch DDP's
    ``bucket_cap_mb_list``) replaces both: the k-th bucket to close closes at
    its k-th entry, the last one standing for all later buckets.
    A new dtype closes the open bucket of another dtype only for that dtype:
    each dtype fills its own open bucket so interleaved dtypes do not produce
    a flood of tiny buckets.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if bucket_cap_bytes < 0:  # (0: each parameter in a bucket of its own, as in torch)
        raise ValueError(f"bucket_cap_bytes must be >= 0, got {bucket_cap_bytes}")
    first_cap = bucket_cap_bytes if first_bucket_cap_bytes is None else \
        min(bucket_cap_bytes, first_bucket_cap_bytes)
    order = list(range(len(params)))[::-1] if order is None else list(order)
    if sorted(order) != list(range(len(params))):
        raise ValueError("order must be a permutation of the parameter indices")

    # Per dtype: the spans of the bucket being filled and its byte count.
    open_buckets: dict[str, list[ParamSpan]] = {}
    open_bytes: dict[str, int] = {}
    closed: list[tuple[str, int, list[ParamSpan]]] = []  # (dtype, elsize, spans)
    elsize_of: dict[str, int] = {}

    def close(dtype_name: str) -> None:
        spans = open_buckets.pop(dtype_name, None)
        open_bytes.pop(dtype_name, None)
        if spans:
            closed.append((dtype_name, elsize_of[dtype_name], spans))

    for index in order:
        info = params[index]
        if info.numel <= 0:
            continue  # an empty parameter has nothing to reduce or own
        dtype_name = info.dtype_name
        elsize_of[dtype_name] = info.element_size
        nbytes = info.numel * info.element_size
        spans = open_buckets.setdefault(dtype_name, [])
        param_align = max(1, param_align_bytes // info.element_size)
        offset = _round_up(spans[-1].bucket_end, param_align) if spans else 0
        spans.append(ParamSpan(param_index=index, bucket_offset=offset, numel=info.numel,
                               strides=info.strides))
        open_bytes[dtype_name] = open_bytes.get(dtype_name, 0) + nbytes
        # As torch DDP does: a bucket closes once it reaches the cap, so it
        # exceeds the cap only by its last parameter. Closing before a
        # parameter that would overflow would instead leave a layer's bias
        # (ready just before its weight in backward) a tiny bucket of its own,
        # and every bucket costs a collective per phase.
        if bucket_caps_bytes:
            cap = bucket_caps_bytes[min(len(closed), len(bucket_caps_bytes) - 1)]
        else:
            cap = bucket_cap_bytes if closed else first_cap
        if open_bytes[dtype_name] >= cap:
            close(dtype_name)
    for dtype_name in list(open_buckets):
        close(dtype_name)

    layouts = []
    for bucket_index, (dtype_name, elsize, spans) in enumerate(closed):
        numel = spans[-1].bucket_end
        align_elems = max(1, align_bytes // elsize)
        padded = _round_up(numel, world_size * align_elems)
        layouts.append(
            BucketLayout(
                index=bucket_index,
                dtype_name=dtype_name,
                element_size=elsize,
                spans=tuple(spans),
                world_size=world_size,
                padded_numel=padded,
            )
        )
    return tuple(layouts)


def owned_numel(layouts: Iterable[BucketLayout], rank: int) -> int:
    """Parameter elements (padding excluded) whose state ``rank`` owns."""
    return sum(layout.owned_numel(rank) for layout in layouts)
