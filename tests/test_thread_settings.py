"""Settings the loop changes after two_stage's scheduler thread started: its speculative
steps follow them, bitwise torch DDP (fgpsdp_runtime/thread_settings.py)."""
import threading

import pytest
import torch

from fgpsdp_runtime.thread_settings import ThreadSettings

from . import thread_settings_scenarios
from .dist_harness import run_distributed


def _in_a_new_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def test_a_thread_adopts_the_loop_threads_settings():
    default_count = _in_a_new_thread(torch.get_num_threads)
    threads = torch.get_num_threads()
    try:
        torch.set_flush_denormal(True)
        torch.set_default_device("meta")
        torch.set_num_threads(default_count + 2)
        loop = ThreadSettings.of_this_thread(True)
    finally:
        torch.set_default_device("cpu")
        torch.set_num_threads(threads)
        flushing = torch.set_flush_denormal(False)
    if not flushing:
        pytest.skip("this CPU cannot flush subnormals")
    assert loop == ThreadSettings(True, torch.device("meta"), default_count + 2)
    assert _in_a_new_thread(lambda: ThreadSettings.of_this_thread(True)) == \
        ThreadSettings(False, torch.device("cpu"), default_count)

    def adopt_and_read():
        loop.adopt()
        return ThreadSettings.of_this_thread(True)

    assert _in_a_new_thread(adopt_and_read) == loop


def test_flushing_turned_on_after_the_first_step_trains_like_torch_ddp():
    """Before, the scheduler thread kept the flush mode it started with: subnormal
    Adam state in the speculated slices that torch DDP's step flushed."""
    for rank, (differing, commits) in enumerate(run_distributed(
            2, thread_settings_scenarios.flushing_turned_on_after_the_first_step)):
        assert commits > 0, rank  # the speculative steps were kept
        assert differing == 0, (rank, differing)


def test_a_default_dtype_changed_between_backward_and_step_trains_like_torch_ddp():
    """torch's NAdam creates its step counts in the default dtype: before, the
    speculative steps' were float32 where torch DDP's step made float64 ones."""
    for rank, (differing, _) in enumerate(run_distributed(
            2, thread_settings_scenarios.default_dtype_changed_between_backward_and_step)):
        assert differing == 0, (rank, differing)
