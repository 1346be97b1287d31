"""The overlap plan of the two-stage schedule, and the link cost model behind it.

Pure: no communication, no tensors. A plan is frozen, printable and
JSON-serialisable, and the same on every rank (it is computed from the
layout and from profile figures that every rank derives identically, or
that rank 0 broadcasts), because it fixes the order of collectives.

Stage 1 (during backward): for each bucket in ``stage1`` (in that order), once
its reduce-scatter has landed, a speculative optimizer step on this rank's
slice and the bucket's all-gather start while backward goes on.
Stage 2 (next forward): the remaining buckets are stepped after the global
norm is known and all-gathered in ``stage2`` order, the order forward needs
them; forward waits for each just before use.
"""
from __future__ import annotations

import dataclasses
import json
import operator
from dataclasses import asdict, dataclass, field
from typing import Mapping, Optional, Sequence


@dataclass(frozen=True)
class LinkModel:
    """Time to move bytes over one link class: latency + bytes / bandwidth."""

    latency_s: float
    bandwidth_Bps: float

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_Bps


@dataclass(frozen=True)
class BucketProfile:
    """Measured in a profiled iteration: when backward finished the bucket."""

    bytes: int
    ready_s: float  # since the forward ended (backward's start, give or take the loss)
    # The reduce-scatter's bytes when gradients travel in another dtype than
    # the parameters (DistributedDataParallel's reduce_dtype); None: ``bytes``.
    reduce_bytes: Optional[int] = None

    @property
    def reduce_scatter_bytes(self) -> int:
        return self.bytes if self.reduce_bytes is None else self.reduce_bytes


@dataclass(frozen=True)
class OverlapPlan:
    stage1: tuple[int, ...]  # speculative step + all-gather during backward, in this order
    stage2: tuple[int, ...]  # stepped after the norm, all-gathered in forward order
    # All-gathers in flight ahead of forward. The plans below put them all in
    # flight (the bucket count, not len(stage2): a step that does not
    # speculate, clipping being active, sends every bucket after the norm):
    # the all-gather lands in the parameters themselves, so more in flight
    # costs no memory, and fewer left the link idle between the inter- and
    # intra-node phases (measured on the emulated cluster). A smaller value
    # bounds transport buffers (a fixed plan may set it).
    lookahead: int
    # "layout" (every bucket but the last in stage 1), "profiling" (auto, until
    # its profile is done: no stage 1), "profile", or a caller's own label
    source: str = "layout"
    predicted: Optional[dict] = field(default=None, compare=False)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "OverlapPlan":
        data = json.loads(text)
        return OverlapPlan(stage1=tuple(data["stage1"]), stage2=tuple(data["stage2"]),
                           lookahead=data["lookahead"], source=data["source"],
                           predicted=data.get("predicted"))

    def __str__(self) -> str:
        return (f"OverlapPlan(source={self.source}, stage1={list(self.stage1)}, "
                f"stage2={list(self.stage2)}, lookahead={self.lookahead})")


def checked_plan(plan: object, n_buckets: int) -> OverlapPlan:
    """``plan`` with plain ints and tuples (numpy's ints become ``int``, so that it
    still goes to JSON), or the error that names what is wrong: each of the
    ``n_buckets`` buckets in exactly one stage, as ints, and a lookahead of at
    least 1 (or None). The scheduler indexes lists with them, so a float must not
    get that far."""
    if not isinstance(plan, OverlapPlan):
        raise TypeError(f"an overlap plan must be an fgp.OverlapPlan, got {type(plan).__name__}")

    def indices(name: str, values: object) -> tuple[int, ...]:
        # (An ordered collection: a list, a tuple, a numpy array; not a set.)
        if isinstance(values, (str, bytes, Mapping, set, frozenset)) \
                or not hasattr(values, "__len__") or not hasattr(values, "__iter__"):
            raise TypeError(f"overlap plan {name} must be a sequence of bucket indices, "
                            f"got {values!r}")
        return tuple(_plain_int(f"overlap plan {name}", v) for v in values)
    stage1, stage2 = indices("stage1", plan.stage1), indices("stage2", plan.stage2)
    if sorted(stage1 + stage2) != list(range(n_buckets)):
        raise ValueError(f"overlap plan must place each of the {n_buckets} buckets in exactly "
                         f"one stage, got stage1={list(stage1)} stage2={list(stage2)}")
    lookahead = plan.lookahead
    if lookahead is not None:
        lookahead = _plain_int("overlap plan lookahead", lookahead)
        if lookahead < 1:
            raise ValueError(f"overlap plan lookahead must be >= 1, got {lookahead}")
    return dataclasses.replace(plan, stage1=stage1, stage2=stage2, lookahead=lookahead)


def _plain_int(what: str, value: object) -> int:
    if not isinstance(value, bool):  # (an int to Python, never meant as one here)
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{what} must hold ints, got {value!r}")


def profiling_plan(n_buckets: int, forward_order: Sequence[int]) -> OverlapPlan:
    """While ``overlap_plan="auto"`` profiles its first steps: nothing is speculated.

    Every undo record holds a copy of its slice's parameters and optimizer
    state, so the layout plan's stage 1 (nearly every bucket) would raise a
    rank's peak memory by up to one more set of its optimizer state in the
    first steps, for a few steps' speed. Without speculation the profile also
    times backward and the reduce-scatters undisturbed by stage-1 steps and
    all-gathers.
    """
    return OverlapPlan(stage1=(), stage2=tuple(forward_order),
                       lookahead=max(1, n_buckets), source="profiling")


def layout_plan(n_buckets: int, forward_order: Sequence[int],
                lookahead: Optional[int] = None) -> OverlapPlan:
    """Before any profile: every bucket but the last to be reduced goes to stage 1.

    Buckets are reduced in index order; the last one lands after backward has
    ended, so stepping it early hides nothing.
    """
    stage1 = tuple(range(max(0, n_buckets - 1)))
    stage2 = tuple(b for b in forward_order if b not in stage1)
    return OverlapPlan(stage1=stage1, stage2=stage2, lookahead=lookahead or max(1, n_buckets))


def profile_plan(buckets: Sequence[BucketProfile], backward_s: float, forward_order: Sequence[int],
                 *, link: LinkModel, reduce_fraction: float = 1.0,
                 lookahead: Optional[int] = None,
                 forward_wait_s: Optional[Mapping[int, float]] = None,
                 undo_bytes: Optional[Sequence[int]] = None,
                 undo_budget_bytes: Optional[float] = None) -> OverlapPlan:
    """Stage 1 = the buckets whose exchange fits in the network's idle time in
    backward, and whose early all-gather the next forward would otherwise wait for.

    Simulates the bottleneck link in backward: reduce-scatters in bucket
    order, each starting when its bucket is ready and the link is free; a
    bucket is a candidate if its all-gather, queued behind the reduce-scatters
    already issued, still finishes before backward ends. ``reduce_fraction``
    scales bytes to what crosses that link per phase (1/local_size for the
    inter-node rail under the hierarchy).

    ``forward_wait_s`` (per bucket: how long the profiled forwards, with every
    all-gather in stage 2, waited for it) prunes the candidates; see
    [Note: stage 1 only where the forward waits]. ``undo_bytes`` (per bucket:
    its undo record) and ``undo_budget_bytes`` bound what stage 1 holds at the
    step: candidates are kept in forward order while their records fit.
    """
    link_free = 0.0
    candidates, finish = [], {}
    for b, bucket in enumerate(buckets):
        rs_done = max(link_free, bucket.ready_s) + link.seconds(
            bucket.reduce_scatter_bytes * reduce_fraction)
        link_free = rs_done
        ag_done = rs_done + link.seconds(bucket.bytes * reduce_fraction)
        finish[b] = ag_done
        if ag_done <= backward_s and b < len(buckets) - 1:
            candidates.append(b)
            link_free = ag_done  # the all-gather occupies the link too
    # Dropping a candidate only frees link time in backward: the rest still fit.
    stage1 = candidates
    if forward_wait_s is not None:
        stage1 = _where_forward_waits(stage1, forward_order, forward_wait_s, backward_s)
    if undo_bytes is not None and undo_budget_bytes is not None:
        stage1 = _within_budget(stage1, forward_order, undo_bytes, undo_budget_bytes)
    stage2 = tuple(b for b in forward_order if b not in stage1)
    predicted = {"backward_s": backward_s, "allgather_done_s": {str(b): finish[b] for b in finish},
                 "stage1_candidates": list(candidates)}
    if forward_wait_s is not None:
        predicted["forward_wait_s"] = {str(b): forward_wait_s.get(b, 0.0) for b in forward_order}
    if undo_bytes is not None:
        predicted["undo_bytes"] = sum(undo_bytes[b] for b in stage1)
    return OverlapPlan(stage1=tuple(stage1), stage2=stage2,
                       lookahead=lookahead or max(1, len(buckets)), source="profile",
                       predicted=predicted)


# [Note: stage 1 only where the forward waits]
# A stage-1 bucket costs an undo record (a copy of its slice's parameters,
# gradient and optimizer state: four slices for AdamW) from its reduce-scatter
# to the step, its step's copies, and, when clipping undoes the step, its
# all-gather twice. It pays only if the next forward would wait for that
# bucket's all-gather, or for one queued behind it: stage-2 all-gathers run in
# forward order, so taking a bucket out of stage 2 lands every later one
# earlier, and none before it. The profiled steps run every all-gather in
# stage 2, so the training loop's waits for them (in forward, or in a
# synchronize() after the step) say where that is: a candidate stays if the
# waits at and after it in forward order add up to more than 1% of backward.
# So a link that outpaces the forward, as inside a node, leaves stage 1 empty
# (the forward waits at most for its first bucket, never a candidate: it is
# reduced last). The 1% is for the waits together, which a slightly slow link
# spreads thinly over many buckets; a thread's wake-up is no reason to hold a
# slice of optimizer state twice.
_WAIT_TOLERANCE = 0.01


def _where_forward_waits(candidates: Sequence[int], forward_order: Sequence[int],
                         forward_wait_s: Mapping[int, float], backward_s: float) -> list[int]:
    tolerance = _WAIT_TOLERANCE * backward_s
    position = {b: i for i, b in enumerate(forward_order)}
    # The waits a candidate at position i can shorten: its own and every later one's.
    later_waits, total = [0.0] * len(forward_order), 0.0
    for i in reversed(range(len(forward_order))):
        total += forward_wait_s.get(forward_order[i], 0.0)
        later_waits[i] = total
    return [b for b in candidates if later_waits[position[b]] > tolerance]


def _within_budget(candidates: Sequence[int], forward_order: Sequence[int],
                   undo_bytes: Sequence[int], budget: float) -> list[int]:
    """The candidates earliest in forward order (each lands every later
    all-gather earlier) while their undo records fit in ``budget``."""
    position = {b: i for i, b in enumerate(forward_order)}
    kept, held = set(), 0
    for b in sorted(candidates, key=position.__getitem__):
        if held + undo_bytes[b] > budget:
            continue
        kept.add(b)
        held += undo_bytes[b]
    return [b for b in candidates if b in kept]
