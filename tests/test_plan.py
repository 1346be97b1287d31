"""The overlap plan: pure, deterministic, serialisable."""
from fgpsdp_runtime.plan import BucketProfile, LinkModel, OverlapPlan, layout_plan, profile_plan


def test_layout_plan_keeps_last_bucket_for_stage2():
    plan = layout_plan(4, (3, 2, 1, 0))
    assert plan.stage1 == (0, 1, 2) and plan.stage2 == (3,)
    assert layout_plan(1, (0,)).stage1 == ()


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
