"""Settings the loop changes after two_stage's scheduler thread started: its speculative
steps follow them, bitwise torch DDP (fgpsdp_runtime/thread_settings.py)."""
import threading

import pytest
import torch

from fgpsdp_runtime.speculation import hyperparameters, same_hyperparameters
from fgpsdp_runtime.thread_settings import ThreadSettings

from . import thread_settings_scenarios
from .dist_harness import run_distributed


def _can_flush() -> bool:
    can = torch.set_flush_denormal(True)
    torch.set_flush_denormal(False)
    return can


def _in_a_new_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def test_a_thread_adopts_the_loop_threads_settings():
    threads = torch.get_num_threads()
    before = _in_a_new_thread(lambda: ThreadSettings.of_this_thread(True))
    loop = ThreadSettings(True, threads + 2)

    def change_adopt_and_read():
        # As the scheduler thread: started before the loop changed its settings.
        loop.adopt()
        return ThreadSettings.of_this_thread(True)

    try:
        adopted = _in_a_new_thread(change_adopt_and_read)
        flushes_here = ThreadSettings.of_this_thread(True).flush_denormal
    finally:
        flushing = torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
    if not flushing:
        pytest.skip("this CPU cannot flush subnormals")
    assert before.flush_denormal is False
    assert adopted == loop
    assert not flushes_here  # that thread's mode only


def test_flushing_turned_on_after_the_first_step_trains_like_torch_ddp():
    """Before, the scheduler thread kept the flush mode it started with: subnormal
    Adam state in the speculated slices that torch DDP's step flushed."""
    for rank, (differing, commits, _) in enumerate(run_distributed(
            2, thread_settings_scenarios.flushing_turned_on_after_the_first_step)):
        assert commits > 0, rank  # the speculative steps were kept
        assert differing == 0, (rank, differing)


def test_flushing_turned_on_between_backward_and_step_trains_like_torch_ddp():
    """The scheduler thread adopts the mode the loop had at the forward: speculative
    steps that ran before the loop turned flushing on are redone by the step."""
    if not _can_flush():
        pytest.skip("this CPU cannot flush subnormals")
    for rank, (differing, _, rollbacks) in enumerate(run_distributed(
            2, thread_settings_scenarios.flushing_turned_on_between_backward_and_step)):
        assert differing == 0, (rank, differing)
        assert rollbacks > 0, rank  # stage 1 had stepped when the mode changed


def test_the_speculative_record_holds_the_flush_mode_for_cpu_arithmetic_only():
    if not _can_flush():
        pytest.skip("this CPU cannot flush subnormals")
    groups = [{"params": [], "lr": 0.1}]
    try:
        for cpu in (True, False):
            before = hyperparameters(groups, cpu_arithmetic=cpu)
            torch.set_flush_denormal(True)
            assert same_hyperparameters(before, hyperparameters(groups, cpu_arithmetic=cpu)) \
                is not cpu
            torch.set_flush_denormal(False)
    finally:
        torch.set_flush_denormal(False)


def test_a_default_dtype_changed_between_backward_and_step_trains_like_torch_ddp():
    """torch's NAdam creates its step counts in the default dtype: before, the
    speculative steps' were float32 where torch DDP's step made float64 ones."""
    for rank, (differing, _, rollbacks) in enumerate(run_distributed(
            2, thread_settings_scenarios.default_dtype_changed_between_backward_and_step)):
        assert differing == 0, (rank, differing)
        assert rollbacks > 0, rank  # stage 1 had stepped when the dtype changed


def test_two_stage_clips_as_serial_after_the_loop_changes_its_thread_count():
    """The end-to-end view of tests/test_ops.py's thread-count test of the norm kernel."""
    two_stage = run_distributed(2, thread_settings_scenarios.clip_after_the_thread_count_changes,
                                "two_stage")
    serial = run_distributed(2, thread_settings_scenarios.clip_after_the_thread_count_changes,
                             "serial")
    for rank, (ours, ref) in enumerate(zip(two_stage, serial)):
        # every clipped step (2, 5, 8, 11) speculated and rolled back; the step after
        # one does not speculate, the next commits
        assert ours["commits"] == 5 and ours["rollbacks"] == 4, (rank, ours["commits"],
                                                                 ours["rollbacks"])
        assert ours["totals"] == ref["totals"], rank
        for a, b in zip(ours["params"], ref["params"]):
            assert torch.equal(a, b), rank
