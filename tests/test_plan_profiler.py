"""overlap_plan="auto": what its profile window makes of unusual loops, and the
two_stage schedule under gradient accumulation without no_sync()."""
import json

from fgpsdp_runtime.plan import _where_forward_waits

from .dist_harness import run_calls
from .profile_window_scenarios import (joined_before_the_window, profile_window,
                                       speculation_budget_elsewhere,
                                       undo_bytes_before_state_exists)

_CASES = ("plain", "no_sync_step", "no_sync_window", "user_timeline", "slow_forward",
          "no_undo_memory", "slow_all_gathers", "slow_forward_on_rank_0")


def _sane_profile(plan: dict) -> None:
    predicted = plan["predicted"]
    ready, backward = predicted["bucket_ready_s"], predicted["backward_s"]
    # Four layers of a 3 ms backward each, timed from the forward's end.
    assert 0.006 < backward < 0.5, backward
    assert all(0 < r <= backward for r in ready), (ready, backward)
    assert ready == sorted(ready), ready


def test_profile_window_unusual_loops():
    calls = [(profile_window, case) for case in _CASES]
    calls.append((profile_window, "always_no_sync", "auto", 13))
    calls.append((profile_window, "accumulate_synced", "layout"))
    calls.append((speculation_budget_elsewhere,))
    calls.append((undo_bytes_before_state_exists,))
    calls.append((joined_before_the_window,))
    hand_plans = [(profile_window, case) for case in ("hand_plan_before_window",
                                                      "hand_plan_in_window")]
    calls += hand_plans
    results = run_calls(2, calls, timeout_s=600)
    # model.set_overlap_plan under "auto" ends the profile: its plan stays, speculates,
    # and the timeline the window held is off and empty again.
    for call in hand_plans:
        for r in results[call]:
            assert json.loads(r["plan"])["source"] == "by hand", (call, r["plan"])
            assert r["equal_to_serial"] and r["commits"] > 0, (call, r)
            assert not r["timeline_enabled"] and r["timeline_spans"] == 0, (call, r)
        calls.remove(call)
    # A rank joined through the window times no waits; the active one waits for no
    # candidate: no stage 1 (it was [0, 1, 2] from the joined rank's waits).
    joined, active = results[(joined_before_the_window,)]
    assert joined["local_forward_wait_s"] == {}, joined
    assert sum(active["local_forward_wait_s"].get(b, 0.0) for b in (2, 1, 0)) < 0.01, active
    assert joined["plan"] == active["plan"], (joined, active)
    planned = json.loads(active["plan"])
    assert planned["source"] == "profile" and planned["stage1"] == [], planned
    calls.remove((joined_before_the_window,))
    for ranks in results[(speculation_budget_elsewhere,)]:
        assert len(ranks) == 2, ranks
        assert "schedule='next_forward'" in ranks[0] and "overlap_plan='layout'" in ranks[1], ranks
    calls.remove((speculation_budget_elsewhere,))
    # A layer the optimizer has no state for yet (first used at step 4): its undo
    # record counted as it will be (the AdamW state of the other layers per element),
    # up to the two 0-dim step counts it will add.
    for r in results[(undo_bytes_before_state_exists,)]:
        assert r["late_buckets"], r
        for b in r["late_buckets"]:
            assert 0 <= r["step6"][b] - r["step3"][b] <= 2 * 4, r
            assert r["step3"][b] >= 4 * 4 * 2080, r  # parameter, gradient, two states
    calls.remove((undo_bytes_before_state_exists,))
    for call in calls:
        ranks = results[call]
        assert len({r["plan"] for r in ranks}) == 1, f"{call[1]}: ranks run different plans"
        assert all(r["equal_to_serial"] for r in ranks), f"{call[1]}: differs from serial"
    plans = {call[1]: json.loads(results[call][0]["plan"]) for call in calls}
    for case in _CASES:
        assert plans[case]["source"] == "profile", case
        # A step entirely under no_sync() reduces at the step: no backward to time
        # (its round used to be timed from the forward of the step before).
        _sane_profile(plans[case])
    for case in _CASES:  # stage 1 follows from what the profile measured
        plan, predicted = plans[case], plans[case]["predicted"]
        waits = {int(b): s for b, s in predicted["forward_wait_s"].items()}
        candidates = predicted["stage1_candidates"]
        expected = [] if case == "no_undo_memory" else _where_forward_waits(
            candidates, (3, 2, 1, 0), waits, predicted["backward_s"])
        assert plan["stage1"] == expected, (case, predicted)
        # AdamW: parameter, gradient, exp_avg and exp_avg_sq of a 2,080-element slice
        # (a Linear(64, 64) over 2 ranks), and two 0-dim step counts, per bucket.
        assert predicted["undo_bytes"] == len(expected) * (4 * 4 * 2080 + 2 * 4), case
    # A link that outpaces the forward: it waits at most for the first bucket in forward
    # order, which stage 1 cannot take (it is reduced last): none speculates.
    slow = plans["slow_forward"]
    assert slow["stage1"] == [] and slow["predicted"]["stage1_candidates"] == [0, 1, 2], slow
    assert plans["no_undo_memory"]["predicted"]["stage1_candidates"] == [0, 1, 2]
    # All-gathers slower than the forward (20 ms each, on the link worker): it waits
    # about one all-gather for every bucket, and every candidate speculates.
    gathers = plans["slow_all_gathers"]
    waits = gathers["predicted"]["forward_wait_s"]
    assert all(waits[str(b)] > 0.01 for b in (2, 1, 0)), waits
    assert gathers["stage1"] == [0, 1, 2], gathers
    assert all(r["commits"] > 0 for r in results[(profile_window, "slow_all_gathers")])
    # Only rank 1 waits (rank 0's forward is slower than the all-gathers): the plan,
    # which rank 0 makes, takes rank 1's waits, and every candidate speculates.
    uneven = results[(profile_window, "slow_forward_on_rank_0")]
    rank0_waits, rank1_waits = (r["local_forward_wait_s"] for r in uneven)
    assert sum(rank0_waits.get(b, 0.0) for b in (2, 1, 0)) < 0.01, rank0_waits
    assert all(rank1_waits.get(b, 0.0) > 0.01 for b in (2, 1, 0)), rank1_waits
    planned = plans["slow_forward_on_rank_0"]
    for b in range(4):
        assert planned["predicted"]["forward_wait_s"][str(b)] == max(
            rank0_waits.get(b, 0.0), rank1_waits.get(b, 0.0)), (b, planned, uneven)
    assert planned["stage1"] == [0, 1, 2], planned
    # Steps 2-3 reduced in no backward: the window ran again (steps 4-5).
    assert plans["no_sync_window"]["source"] == "profile"
    # A loop that never reduces in backward: after four more windows, no stage 1.
    assert plans["always_no_sync"]["source"] == "profiling"
    assert plans["always_no_sync"]["stage1"] == []
    # The user's enable() inside the window: on at the end, with its spans.
    user = results[(profile_window, "user_timeline")]
    assert all(r["timeline_enabled"] and r["timeline_spans"] > 0 for r in user)
    plain = results[(profile_window, "plain")]
    assert not any(r["timeline_enabled"] or r["timeline_spans"] for r in plain)

    # Accumulation over reduced backwards (steps 1-4, then single backwards, layout
    # plan: stage 1 from the first step): step 1's speculation is undone by the
    # second micro-batch's forward; steps 2-4 do not speculate; step 5 has one
    # backward, so step 6 speculates again and commits.
    accumulated = results[(profile_window, "accumulate_synced", "layout")]
    stage1 = len(plans["accumulate_synced"]["stage1"])
    assert stage1 == accumulated[0]["n_buckets"] - 1
    for r in accumulated:
        assert (r["rollbacks"], r["commits"]) == (stage1, stage1), r
