"""The overlap plan: pure, deterministic, serialisable."""
from fgpsdp_runtime.plan import (BucketProfile, LinkModel, OverlapPlan, layout_plan, profile_plan,
                                 profiling_plan)


def test_layout_plan_keeps_last_bucket_for_stage2():
    plan = layout_plan(4, (3, 2, 1, 0))
    assert plan.stage1 == (0, 1, 2) and plan.stage2 == (3,)
    assert layout_plan(1, (0,)).stage1 == ()


def test_profiling_plan_speculates_nothing_and_sends_in_forward_order():
    plan = profiling_plan(4, (3, 2, 1, 0))
    assert plan.stage1 == () and plan.stage2 == (3, 2, 1, 0)
    assert plan.lookahead == 4 and plan.source == "profiling"
    assert OverlapPlan.from_json(plan.to_json()) == plan


def test_plans_keep_every_bucket_in_flight_by_default():
    # A step that does not speculate (clipping active) all-gathers every bucket
    # after the norm, stage 1's too: a lookahead of len(stage2) would leave the
    # link idle between them.
    assert layout_plan(4, (3, 2, 1, 0)).lookahead == 4
    link = LinkModel(latency_s=0.0, bandwidth_Bps=100.0)
    buckets = [BucketProfile(bytes=100, ready_s=0.0), BucketProfile(bytes=100, ready_s=9.5)]
    assert profile_plan(buckets, backward_s=10.0, forward_order=(1, 0), link=link).lookahead == 2
    assert layout_plan(4, (3, 2, 1, 0), lookahead=1).lookahead == 1


def test_plan_round_trips_json():
    plan = layout_plan(5, (4, 3, 2, 1, 0))
    assert OverlapPlan.from_json(plan.to_json()) == plan
    assert "stage1=[0, 1, 2, 3]" in str(plan)


def test_profile_plan_puts_early_buckets_in_stage1():
    link = LinkModel(latency_s=0.0, bandwidth_Bps=100.0)  # 1 s per 100 bytes
    buckets = [BucketProfile(bytes=100, ready_s=0.0), BucketProfile(bytes=100, ready_s=5.0),
               BucketProfile(bytes=100, ready_s=9.5)]
    plan = profile_plan(buckets, backward_s=10.0, forward_order=(2, 1, 0), link=link)
    # bucket 0: RS 0-1, AG 1-2 (fits); bucket 1: RS 5-6, AG 6-7 (fits); bucket 2: last
    assert plan.stage1 == (0, 1) and plan.stage2 == (2,)
    slow = profile_plan(buckets, backward_s=10.0, forward_order=(2, 1, 0),
                        link=LinkModel(latency_s=0.0, bandwidth_Bps=10.0))
    assert slow.stage1 == ()  # nothing fits in backward on a slow link
    assert slow.stage2 == (2, 1, 0)


def test_link_fit_recovers_latency_and_bandwidth():
    from fgpsdp_runtime.plan_profiler import fit_link
    samples = [(b, 0.002 + b / 1e8) for b in (1e6, 4e6, 9e6, 2.5e7)]
    link = fit_link(samples)
    assert abs(link.latency_s - 0.002) < 1e-9 and abs(link.bandwidth_Bps - 1e8) < 1e-2
    # One size only: no latency can be told apart; bandwidth from the totals.
    same = fit_link([(1e6, 0.01), (1e6, 0.03)])
    assert same.latency_s == 0.0 and abs(same.bandwidth_Bps - 2e6 / 0.04) < 1e-6
    # A fit with negative latency makes no sense: fall back the same way.
    odd = fit_link([(1e6, 0.02), (2e6, 0.05)])
    assert odd.latency_s == 0.0
    assert fit_link([]).bandwidth_Bps == float("inf")


def test_busy_seconds_merges_overlapping_spans():
    from fgpsdp_runtime.tracing import busy_seconds
    spans = [("inter-rs", "RS b0", 0.0, 1.0), ("inter-rs", "RS b1", 0.5, 2.0),
             ("inter-rs", "RS b2", 3.0, 4.0), ("intra-rs", "RS b0", 0.0, 10.0)]
    assert busy_seconds(spans, "inter-rs", 0.0, 10.0) == 3.0
    assert busy_seconds(spans, "inter-rs", 1.5, 3.5) == 1.0  # clipped to the window


def test_timeline_records_only_when_enabled_and_exports_chrome_json():
    import json
    import time
    from fgpsdp_runtime.tracing import Timeline
    timeline = Timeline(rank=3)
    with timeline.span("compute", "forward"):
        pass
    assert timeline.spans() == []
    timeline.enable()
    with timeline.span("compute", "forward"):
        pass
    later = time.perf_counter() + 10.0
    timeline.add("inter-ag", "AG b1", later, later + 0.5)
    trace = json.loads(json.dumps(timeline.chrome_trace()))
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in complete] == ["forward", "AG b1"]
    assert all(e["pid"] == 3 for e in trace["traceEvents"])
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["name"] == "thread_name"}
    assert names[complete[1]["tid"]] == "inter-ag"
    assert abs(complete[1]["dur"] - 0.5e6) < 1.0


def test_profile_plan_times_reduce_scatters_in_their_own_bytes():
    # Gradients reduced in bfloat16 (reduce_dtype): the reduce-scatters take half
    # as long, which leaves room for bucket 1's all-gather before backward ends.
    link = LinkModel(latency_s=0.0, bandwidth_Bps=100.0)  # 1 s per 100 bytes
    same = [BucketProfile(bytes=100, ready_s=0.0), BucketProfile(bytes=100, ready_s=1.0),
            BucketProfile(bytes=100, ready_s=3.0)]
    halved = [BucketProfile(bytes=b.bytes, ready_s=b.ready_s, reduce_bytes=50) for b in same]
    assert profile_plan(same, backward_s=3.5, forward_order=(2, 1, 0), link=link).stage1 == (0,)
    assert profile_plan(halved, backward_s=3.5, forward_order=(2, 1, 0),
                        link=link).stage1 == (0, 1)


def test_overlap_plan_is_public():
    # docs/design.md passes one as DistributedDataParallel(overlap_plan=fgp.OverlapPlan(...)).
    import fgpsdp_runtime as fgp
    assert fgp.OverlapPlan is OverlapPlan and "OverlapPlan" in fgp.__all__


def test_device_marks_read_event_times_in_seconds(monkeypatch):
    """The CUDA profile clock (events on the compute stream), with a fake event:
    seconds from event times, and one device synchronisation before reading."""
    import torch
    from fgpsdp_runtime.plan_profiler import DeviceMarks
    gpu_clock_ms = [0.0]
    log = []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing, "elapsed_time needs timing events"

        def record(self, stream):
            log.append(("record", stream))
            self.at_ms = gpu_clock_ms[0]

        def elapsed_time(self, other):
            return other.at_ms - self.at_ms

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"compute@{device}")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append(("sync", device)))
    marks = DeviceMarks(torch.device("cuda", 1))
    origin = marks.mark()
    gpu_clock_ms[0] = 250.0
    later = marks.mark()
    marks.wait()
    assert marks.seconds(origin, later) == 0.25
    cuda1 = torch.device("cuda", 1)
    assert log == [("record", f"compute@{cuda1}"), ("record", f"compute@{cuda1}"), ("sync", cuda1)]


def test_timeline_reads_synchronise_the_spans_device_not_the_current_one(monkeypatch):
    """A loop that switched devices after the profile's clock started on cuda:1 (or a
    second wrapper on another GPU): reading the spans synchronised the current device,
    and elapsed_time on cuda:1's unfinished events raised (found by review). Stand-ins:
    events on a fake GPU clock."""
    import torch
    from fgpsdp_runtime.tracing import Timeline
    synced = []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.at_ms = 0.0

        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return other.at_ms - self.at_ms

    class FakeStream:
        device = torch.device("cuda", 1)

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    timeline = Timeline()
    timeline.enable()
    timeline.start_cuda_clock(torch.device("cuda", 1))  # as the plan profiler does
    start = timeline.cuda_span_events(FakeStream())
    timeline.end_cuda_span("inter-ag", "AG b0", start, FakeStream())
    assert len(timeline.spans()) == 1
    assert synced == [torch.device("cuda", 1)]


def test_timeline_spans_never_wait_for_the_cuda_clock(monkeypatch):
    """start_cuda_clock pins event times to the host clock by waiting for an event
    on the compute stream; a span added meanwhile (the end of backward adds one)
    must not wait for the GPU. Nor does it synchronise the device: that would wait
    for the link streams too, where the next forward's all-gathers are queued (the
    plan profiler's first forward then timed no waits; seen on an H200, where
    tests/test_cuda_streams.py::test_profile_times_forward_waits_on_the_gpu
    failed). Stand-ins: an event whose wait takes 1 s."""
    import threading
    import time
    import torch
    from fgpsdp_runtime.tracing import Timeline

    syncing = threading.Event()

    class FakeEvent:
        def __init__(self, enable_timing=False):
            pass

        def record(self, stream=None):
            pass

        def synchronize(self):
            syncing.set()
            time.sleep(1.0)  # far above the bound below, which a loaded
            # machine's scheduling delays (make test runs two test files at once) stay under

    class FakeStream:
        device = "cuda:0"

    def device_synchronize(device=None):
        raise AssertionError("start_cuda_clock synchronised the whole device")

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", device_synchronize)
    timeline = Timeline()
    timeline.enable()
    worker = threading.Thread(target=lambda: timeline.start_cuda_clock("cuda:0", FakeStream()))
    worker.start()
    assert syncing.wait(5)
    t0 = time.perf_counter()
    timeline.add("compute", "backward (from first gradient)", 0.0, 1.0)
    waited = time.perf_counter() - t0
    worker.join()
    assert waited < 0.5, f"Timeline.add waited {waited:.3f} s for another thread's device sync"


def test_link_workers_cuda_spans_never_synchronise_the_device(monkeypatch):
    """A link worker's first CUDA span must not synchronise the device: that waits
    for the other links' collectives, whose peers on other ranks may be workers
    blocked the same way (a hang). Its start event becomes the origin, tied to
    the host clock when the spans are read. Stand-ins: events on a fake GPU clock."""
    import threading
    import time
    import torch
    from fgpsdp_runtime.tracing import Timeline
    gpu_clock_ms = [100.0]
    syncs = []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self, stream=None):
            self.at_ms = gpu_clock_ms[0]

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return other.at_ms - self.at_ms

    class FakeStream:
        device = "cuda:0"

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(
        threading.current_thread().name))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    timeline = Timeline()
    timeline.enable()

    def link_worker():
        for name, start_ms, end_ms in (("RS b0", 150.0, 250.0), ("RS b1", 250.0, 300.0)):
            gpu_clock_ms[0] = start_ms
            start = timeline.cuda_span_events(FakeStream())
            gpu_clock_ms[0] = end_ms
            timeline.end_cuda_span("intra-rs", name, start, FakeStream())

    worker = threading.Thread(target=link_worker, name="link worker")
    worker.start()
    worker.join()
    assert syncs == [], f"the link worker synchronised the device: {syncs}"
    gpu_clock_ms[0] = 400.0  # the GPU time when the spans are read
    before = time.perf_counter()
    spans = timeline.spans()
    after = time.perf_counter()
    assert "link worker" not in syncs and syncs  # read on this thread, after one sync
    (_, n0, s0, e0), (_, n1, s1, e1) = spans
    assert (n0, n1) == ("RS b0", "RS b1")
    # Each event at (host time of "now") - (400 ms - its GPU time).
    assert before - 0.25 <= s0 <= after - 0.25 and before - 0.15 <= e0 <= after - 0.15
    assert abs((e0 - s0) - 0.1) < 1e-9 and abs(s1 - e0) < 1e-9 and abs((e1 - s1) - 0.05) < 1e-9
    assert timeline.spans()[0][2] == s0  # the origin's host time is kept once found


def _three_candidates():
    # Four buckets, each ready early enough for its exchange to fit in backward,
    # bucket 3 (the first in forward order) last: candidates 0, 1, 2.
    link = LinkModel(latency_s=0.0, bandwidth_Bps=100.0)
    buckets = [BucketProfile(bytes=100, ready_s=3.0 * b) for b in range(4)]
    return buckets, dict(backward_s=10.0, forward_order=(3, 2, 1, 0), link=link)


def test_profile_plan_speculates_only_where_the_forward_waited():
    buckets, kw = _three_candidates()
    assert profile_plan(buckets, **kw).stage1 == (0, 1, 2)
    # Every all-gather outpaced the forward (a fast link): no stage 1, no undo records.
    hidden = profile_plan(buckets, **kw, forward_wait_s={3: 0.0, 2: 0.05})  # <= 1% of backward
    assert hidden.stage1 == () and hidden.stage2 == (3, 2, 1, 0)
    assert hidden.predicted["stage1_candidates"] == [0, 1, 2]
    # It waited for bucket 1 (2nd last in forward order): taking 2 or 1 out of
    # stage 2 lands bucket 1 earlier; taking 0 (after it) lands nothing earlier.
    waited = profile_plan(buckets, **kw, forward_wait_s={3: 0.0, 2: 0.0, 1: 0.3})
    assert waited.stage1 == (1, 2) and waited.stage2 == (3, 0)
    assert waited.predicted["forward_wait_s"] == {"3": 0.0, "2": 0.0, "1": 0.3, "0": 0.0}
    # It waited for the last bucket: every candidate may help.
    assert profile_plan(buckets, **kw, forward_wait_s={0: 0.2}).stage1 == (0, 1, 2)


def test_profile_plan_keeps_undo_records_within_a_budget():
    buckets, kw = _three_candidates()
    undo = [400, 400, 800, 400]
    # Earliest in forward order first, each if it still fits: 2 (800 > 700) does
    # not, 1 does, 0 no longer does (800 > 700).
    plan = profile_plan(buckets, **kw, undo_bytes=undo, undo_budget_bytes=700)
    assert plan.stage1 == (1,) and plan.predicted["undo_bytes"] == 400
    assert profile_plan(buckets, **kw, undo_bytes=undo, undo_budget_bytes=800).stage1 == (2,)
    assert profile_plan(buckets, **kw, undo_bytes=undo, undo_budget_bytes=0).stage1 == ()
    unbounded = profile_plan(buckets, **kw, undo_bytes=undo)
    assert unbounded.stage1 == (0, 1, 2) and unbounded.predicted["undo_bytes"] == 1600


def test_thin_waits_over_many_buckets_count_together():
    # A link a little slower than compute: 20 buckets each wait 0.9% of backward,
    # under the 1% a single wait would need, 18% in all.
    n = 20
    link = LinkModel(latency_s=0.0, bandwidth_Bps=1e9)
    buckets = [BucketProfile(bytes=100, ready_s=b / n) for b in range(n)]
    order = tuple(reversed(range(n)))
    waits = {b: 0.009 for b in range(n)}
    plan = profile_plan(buckets, backward_s=1.0, forward_order=order, link=link,
                        forward_wait_s=waits)
    # Candidates 0-18; the later waits add to more than 1% down to bucket 1 (two
    # waits, 1.8%), not at bucket 0 (its own 0.9% alone).
    assert plan.predicted["stage1_candidates"] == list(range(n - 1))
    assert plan.stage1 == tuple(range(1, n - 1))


def test_timeline_keeps_the_latest_spans_within_its_cap():
    """An enabled timeline kept every span: about 2 KB a step, without bound over
    a long run (h108). It keeps the latest max_spans and counts the dropped."""
    import pytest
    from fgpsdp_runtime.tracing import Timeline
    assert Timeline().max_spans == Timeline.DEFAULT_MAX_SPANS == 100_000
    timeline = Timeline(max_spans=5)
    timeline.enable()
    for i in range(8):
        timeline.add("compute", f"step {i}", float(i), i + 0.5)
    assert _span_names(timeline) == [f"step {i}" for i in range(3, 8)]
    assert timeline.dropped == 3
    timeline.max_spans = 2
    assert _span_names(timeline) == ["step 6", "step 7"]
    assert timeline.dropped == 6
    timeline.max_spans = None
    for i in range(8, 20):
        timeline.add("compute", f"step {i}", float(i), i + 0.5)
    assert len(timeline.spans()) == 14 and timeline.dropped == 6
    timeline.clear()
    assert timeline.spans() == [] and timeline.dropped == 0
    with pytest.raises(ValueError, match="max_spans"):
        timeline.max_spans = 0


def test_checked_plan_names_what_is_wrong_and_keeps_plain_ints():
    """Before, a float bucket index passed the plan's check and failed in the
    step's all-gathers ("list indices must be integers"), numpy ints passed and
    broke to_json(), a stage given as a list failed on a concatenation, and a
    lookahead of 1.5 or True passed."""
    import numpy as np
    import pytest
    from fgpsdp_runtime.plan import checked_plan
    plan = checked_plan(OverlapPlan(stage1=[np.int64(0)], stage2=(np.int64(1), 2),
                                    lookahead=np.int64(3)), 3)
    assert plan.stage1 == (0,) and plan.stage2 == (1, 2) and plan.lookahead == 3
    assert all(type(b) is int for b in plan.stage1 + plan.stage2 + (plan.lookahead,))
    assert OverlapPlan.from_json(plan.to_json()) == plan
    for bad, match in [(OverlapPlan(stage1=(0.0,), stage2=(1.0,), lookahead=2), "stage1 must hold ints"),
                       (OverlapPlan(stage1=(True,), stage2=(0,), lookahead=2), "stage1 must hold ints"),
                       (OverlapPlan(stage1=(), stage2="01", lookahead=2), "stage2 must be a sequence"),
                       (OverlapPlan(stage1=(), stage2=(0, 1), lookahead=1.5), "lookahead must hold ints"),
                       (OverlapPlan(stage1=(), stage2=(0, 1), lookahead=True), "lookahead must hold ints"),
                       ({"stage1": (), "stage2": (0, 1)}, "must be an fgp.OverlapPlan")]:
        with pytest.raises(TypeError, match=match):
            checked_plan(bad, 2)
    with pytest.raises(ValueError, match="exactly one stage"):
        checked_plan(OverlapPlan(stage1=(0,), stage2=(0,), lookahead=2), 2)
    with pytest.raises(ValueError, match="lookahead must be >= 1"):
        checked_plan(OverlapPlan(stage1=(), stage2=(0, 1), lookahead=0), 2)
    assert checked_plan(OverlapPlan(stage1=(), stage2=(0, 1), lookahead=None), 2).lookahead is None


def test_a_held_timeline_keeps_every_span_and_the_users():
    """The plan profiler holds the timeline for its window. Before, a small
    max_spans left it the last few spans (it planned from a link model fitted to
    them), and a user who had enabled the timeline and disabled it lost every span
    at the window's end, or, disabled before, kept the profile's instead."""
    from fgpsdp_runtime.tracing import Timeline
    timeline = Timeline(max_spans=2)
    timeline.hold()
    for i in range(5):
        timeline.add("compute", f"step {i}", float(i), i + 0.5)
    assert len(timeline.spans()) == 5 and timeline.dropped == 0
    timeline.max_spans = 3  # (the user's, while held: applies at release)
    assert len(timeline.spans()) == 5
    timeline.release()  # never enabled by the user: off and empty
    assert not timeline.enabled and timeline.spans() == [] and timeline.dropped == 0

    timeline.enable()
    timeline.add("compute", "mine", 0.0, 1.0)
    timeline.hold()
    timeline.add("compute", "mine, held", 1.0, 2.0)
    timeline.disable()
    assert timeline.enabled  # (held)
    timeline.add("compute", "profile", 2.0, 3.0)
    timeline.release()  # off, with what was recorded while the user wanted it
    assert not timeline.enabled
    assert _span_names(timeline) == ["mine", "mine, held"]

    timeline.clear()
    timeline.max_spans = 3
    timeline.enable()
    for i in range(3):
        timeline.add("compute", f"mine {i}", float(i), i + 0.5)
    timeline.disable()  # before the hold
    timeline.hold()
    for i in range(4):
        timeline.add("compute", f"profile {i}", float(i), i + 0.5)
    timeline.release()  # the profile's spans go, not the user's under the cap
    assert _span_names(timeline) == ["mine 0", "mine 1", "mine 2"]
    timeline.max_spans = 2  # (the oldest go, so many fewer of the user's)
    timeline.hold()
    timeline.add("compute", "profile", 9.0, 9.5)
    timeline.release()
    assert _span_names(timeline) == ["mine 1", "mine 2"]

    timeline.clear()
    timeline.hold()
    timeline.add("compute", "profile", 1.0, 2.0)
    timeline.release()  # disabled before the hold, cleared since: empty
    assert timeline.spans() == []

    timeline.max_spans = None
    timeline.enable()
    timeline.add("compute", "U0", 0.0, 1.0)
    timeline.disable()
    timeline.hold()
    timeline.add("compute", "P1", 1.0, 2.0)
    timeline.enable()  # (during the hold: from here the user's again)
    timeline.add("compute", "U2", 2.0, 3.0)
    timeline.disable()
    timeline.add("compute", "P3", 3.0, 4.0)
    timeline.release()
    assert _span_names(timeline) == ["U0", "U2"]
    timeline.clear()
    timeline.hold()
    timeline.add("compute", "P0", 0.0, 1.0)
    timeline.enable()
    timeline.disable()
    timeline.release()
    assert timeline.spans() == []
    timeline.release()  # (unbalanced: nothing happens)
    assert not timeline.enabled

    timeline.clear()
    timeline.max_spans = 3
    timeline.enable()
    timeline.hold()
    for i in range(5):
        timeline.add("compute", f"step {i}", float(i), i + 0.5)
    timeline.release()  # the user's: on, within its cap again
    assert timeline.enabled and _span_names(timeline) == \
        ["step 2", "step 3", "step 4"] and timeline.dropped == 2


def _span_names(timeline) -> list[str]:
    return [name for _, name, *_ in timeline.spans()]
