"""Stream and allocator safety on CUDA (one GPU; skipped without one).

See tests/cuda_stream_scenarios.py. Each case runs in a fresh interpreter:
NCCL's group and the patched link must not leak into other tests.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(case: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "tests.cuda_stream_scenarios", case],
                          cwd=_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    # NCCL_DEBUG output goes to stdout too: take the marked line.
    line = [l for l in done.stdout.splitlines() if l.startswith("FGPSDP_RESULT ")][-1]
    return json.loads(line[len("FGPSDP_RESULT "):])


def test_partial_sum_outlives_the_slow_phase():
    result = _run("hierarchical_partial_sum")
    assert result["conclusive"], "the GPU ran the slow phase before the host dropped it"
    assert result == {"wrong": [0, 0], "junk_intact": True, "conclusive": True}


def test_slow_link_changes_no_parameter():
    result = _run("slow_link_same_result")
    assert result == {"two_stage": 0.0, "next_forward": 0.0, "serial": 0.0,
                      "two_stage_bf16": 0.0, "two_stage_fp16": 0.0,
                      "two_stage_late_optimizer": 0.0, "two_stage_bf16_masters": 0.0,
                      "two_stage_summoned": 0.0, "two_stage_bf16_masters_summoned": 0.0}


def test_optimizer_shard_round_trip_on_nccl():
    assert _run("shard_round_trip") == {"equal": True}


def test_profile_plan_reads_gpu_time():
    result = _run("profile_reads_gpu_time")
    assert result["conclusive"], "the host waited for the GPU in a profiled backward"
    assert result["n_buckets"] >= 4
    assert result == {"source": "profile", "conclusive": True, "backward_matches_gpu": True,
                      "ready_spread": True, "ready_in_order": True,
                      "n_buckets": result["n_buckets"]}


def test_profile_times_forward_waits_on_the_gpu():
    result = _run("profile_times_forward_waits_on_gpu")
    seconds = result.pop("seconds")
    assert result["conclusive"], f"the host waited for the GPU in a profiled forward: {seconds}"
    assert result == {"n_buckets": result["n_buckets"], "conclusive": True,
                      "slow_link_waits": True, "slow_forward_waits_nothing": True}, seconds
    assert result["n_buckets"] >= 4


def test_timeline_enabled_mid_run_never_syncs_on_a_link_worker():
    assert _run("timeline_enabled_mid_run") == {
        "worker_syncs": [], "reduce_scatters": True, "each_lasts_the_sleep": True,
        "on_the_host_clock": True}


def test_a_read_under_a_side_stream_leaves_the_forward_waiting():
    result = _run("side_stream_read_orders_the_forward")
    assert result["conclusive"], "the all-gathers landed before the forward ran"
    assert result == {"conclusive": True, "ordered": True, "read": True}


def test_a_module_moved_to_the_cpu_right_after_the_step_holds_the_update():
    result = _run("moved_to_the_cpu_right_after_the_step")
    assert result["conclusive"], "the all-gathers landed before the move"
    assert result == {"conclusive": True, "on_the_cpu": True, "diff": 0.0}


def test_parameters_held_from_before_the_step_read_right_after_it_hold_the_update():
    result = _run("held_read_right_after_the_step")
    assert result == {"conclusive": True, "diff": 0.0}, result
