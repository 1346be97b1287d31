"""ParamGathers on its own: the order and the lookahead of the parameter all-gathers,
with an exchange that only records (no process group)."""
import types

import pytest

from fgpsdp_runtime.param_gathers import ParamGathers
from fgpsdp_runtime.tracing import Timeline


class _Op:
    """A submitted all-gather that never lands by itself; counts done() calls."""
    asked = 0

    def __init__(self):
        self.landed = False

    def done(self) -> bool:
        _Op.asked += 1
        return self.landed

    def wait(self) -> None:
        self.landed = True


class _Exchange:
    def __init__(self):
        self.started = []

    def start_all_gather(self, output, input, label):
        self.started.append(label)
        return _Op()


def _gathers(buckets: int, lookahead):
    storage = types.SimpleNamespace(flat_param=None, param_shard=None)
    exchange = _Exchange()
    versions = types.SimpleNamespace(written_since_change=lambda bucket: None)
    gathers = ParamGathers(exchange, [storage] * buckets, Timeline(), versions, "two_stage",
                           overlaps_forward=True)
    gathers.lookahead = lookahead
    return gathers, exchange


@pytest.mark.parametrize("lookahead", [None, 200])
def test_a_lookahead_of_every_bucket_starts_all_without_counting(lookahead):
    """The plans' default: before, each queued bucket counted every all-gather in
    flight, 20,000 done() calls a step at 200 buckets (audit h110)."""
    gathers, exchange = _gathers(200, lookahead)
    _Op.asked = 0
    for b in range(200):
        gathers.queue(b)
    assert exchange.started == [f"b{b}" for b in range(200)]
    assert _Op.asked == 0


def test_a_smaller_lookahead_holds_the_rest_and_counts_only_up_to_it():
    gathers, exchange = _gathers(200, 4)
    _Op.asked = 0
    for b in range(200):
        gathers.queue(b)
    assert exchange.started == ["b0", "b1", "b2", "b3"]
    assert gathers.queued
    assert _Op.asked <= 4 * 200  # up to four asked per bucket, not all those in flight
    gathers.finish(10)  # the forward needs bucket 10: every one before it starts too
    assert exchange.started == [f"b{b}" for b in range(11)]
    gathers.start_queued(all_of_them=True)
    assert exchange.started == [f"b{b}" for b in range(200)]
