"""The runtime's daemon threads are stopped and joined at exit (see shutdown.py)."""
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from fgpsdp_runtime import shutdown
from fgpsdp_runtime.link_worker import LinkWorker


def test_stop_all_ends_idle_workers():
    worker = LinkWorker("test-idle", torch.device("cpu"))
    shutdown.stop_all(timeout_s=5.0)
    assert not worker._thread.is_alive()


def test_stop_all_waits_at_most_its_timeout():
    release = threading.Event()
    worker = LinkWorker("test-stuck", torch.device("cpu"))
    worker.submit(lambda: release.wait(10.0))  # a collective whose peer is gone
    started = time.monotonic()
    shutdown.stop_all(timeout_s=0.3)
    assert time.monotonic() - started < 2.0
    assert worker._thread.is_alive()
    release.set()
    worker.join(5.0)
    assert not worker._thread.is_alive()


def test_exit_lets_submitted_work_finish(tmp_path):
    # Without the exit hook the interpreter ends the daemon thread mid-task
    # (in a C++ call this can abort the process); with it the task completes.
    marker = tmp_path / "done"
    code = textwrap.dedent(f"""
        import time, torch
        from fgpsdp_runtime.link_worker import LinkWorker
        worker = LinkWorker("test-exit", torch.device("cpu"))
        worker.submit(lambda: (time.sleep(0.5), open({str(marker)!r}, "w").write("ok")))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", code], env=env, timeout=120,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0, proc.stdout
    assert marker.read_text() == "ok"


def test_a_worker_never_waits_for_itself():
    # The garbage collector may finalize a model on one of its own worker threads.
    worker = LinkWorker("test-self", torch.device("cpu"))
    done = worker.submit(lambda: shutdown.stop_and_join([worker], timeout_s=5.0))
    done.result(timeout=3.0)  # joining itself would raise RuntimeError here
    worker.join(5.0)
    assert not worker._thread.is_alive()


def test_a_worker_posts_ahead_and_resolves_in_order():
    """With two calls in flight the worker posts the next call while the first one
    is unfinished; futures resolve in submission order, a failure only its own."""
    worker = LinkWorker("test-in-flight", torch.device("cpu"), in_flight=2)
    release_first = threading.Event()
    second_posted = threading.Event()
    third_posted = threading.Event()
    order = []

    def first():
        def finish():
            assert release_first.wait(5.0)
            order.append(1)
        return finish

    def second():
        second_posted.set()

        def finish():
            raise RuntimeError("second failed")
        return finish

    def third():
        third_posted.set()  # needs a slot: only once the first has finished
        order.append(3)
        return None

    futures = [worker.submit(first), worker.submit(second), worker.submit(third)]
    assert second_posted.wait(5.0)  # posted while the first is still unfinished
    assert not third_posted.wait(0.2)  # two calls in flight at most
    assert not futures[0].done()
    release_first.set()
    futures[0].result(timeout=5.0)
    with pytest.raises(RuntimeError, match="second failed"):
        futures[1].result(timeout=5.0)
    futures[2].result(timeout=5.0)
    assert order == [1, 3]
    shutdown.stop_and_join([worker], timeout_s=5.0)
    assert not worker._thread.is_alive() and not worker._finisher.is_alive()


def test_a_wrapper_freed_as_the_interpreter_ends_says_nothing():
    # torch.compile's caches hold the wrapper until the interpreter empties its
    # modules; its __del__ then called into an emptied module and printed
    # "Exception ignored in ... __del__ ... 'NoneType' object is not callable".
    code = textwrap.dedent("""
        import os, torch, torch.nn as nn, torch.distributed as dist
        import fgpsdp_runtime as fgp
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

        class ReadsItsParameters(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

            def forward(self, x):
                return self.b(torch.tanh(self.a(x.to(next(self.parameters()).dtype))))

        for _ in range(1):
            model = fgp.DistributedDataParallel(ReadsItsParameters(), schedule="two_stage",
                                                bucket_cap_mb=0.0001)
            opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
            run = torch.compile(model, backend="eager")
            for _ in range(4):
                run(torch.randn(4, 8)).square().mean().backward()
                opt.step()
                opt.zero_grad()
            model.synchronize()
        dist.destroy_process_group()
        print("trained")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, timeout=300,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0 and "trained" in proc.stdout, proc.stdout
    assert "Exception ignored" not in proc.stdout, proc.stdout


def _what_a_gloo_worker_may_still_hold(rank: int, world_size: int) -> dict:
    import weakref

    import torch.nn as nn

    import fgpsdp_runtime as fgp
    from fgpsdp_runtime import group_collectives

    torch.manual_seed(0)
    # Buffers (a broadcast at each forward), a frozen 1 MiB weight (broadcast at
    # construction, in place: not copied, not held), and 2 ranks of one node
    # (shared memory, whose regions are agreed on by a broadcast and an all-reduce).
    frozen = nn.Linear(512, 512, bias=False).requires_grad_(False)
    model = fgp.DistributedDataParallel(
        nn.Sequential(frozen, nn.Linear(512, 4), nn.BatchNorm1d(4)))
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=0.1, max_grad_norm=1.0)
    model(torch.randn(8, 512)).sum().backward()
    opt.step()
    flag = torch.ones(3)
    model.all_reduce_sum(flag)
    dropped = weakref.ref(flag)
    del flag
    opt.full_state_dict()
    model.synchronize()
    held = group_collectives._held_past_gloo_worker
    return {"kept": dropped() is not None,
            "held": {site: len(tensors) for site, tensors in held.items()},
            "bytes": {site: sum(t.numel() * t.element_size() for t in tensors)
                      for site, tensors in held.items()}}


def test_the_tensors_of_finished_gloo_collectives_outlive_the_callers_references():
    """See [Note: tensors a finished gloo collective still holds]: a gloo thread
    freeing a collective's last tensor reference needs the GIL, which older torch's
    destroy_process_group() holds while it joins that thread (a hang at a job's end
    on torch 2.4.1). The runtime keeps its own collectives' tensors until the next
    call from the same place."""
    from .dist_harness import run_distributed
    for result in run_distributed(2, _what_a_gloo_worker_may_still_hold):
        assert result["kept"]
        held = result["held"]
        assert held.get("wrapper all-reduce") == 1
        mappings = [site for site in held if site.startswith("shared-memory mapping")]
        assert len(mappings) == 2 and all(held[site] == 2 for site in mappings), held
        assert held.get("buffer broadcast", 0) >= 1
        assert result["bytes"]["buffer broadcast"] < 4096  # the BatchNorm's, not the frozen
        assert held.get("optimizer state gather") == 2
        # Object collectives (object_collectives.py): size, sizes, pickle, pickles.
        assert held.get("set-up checks") == 6 and held.get("optimizer state metadata") == 6
