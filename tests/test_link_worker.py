"""The link worker's futures: resolved in submission order, and a call that finished whole
on the worker is resolved there, without a hop to the finishing thread."""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from fgpsdp_runtime.link_worker import LinkWorker


def _resolution_order(n: int, finishing_share: float, seed: int):
    """Submit ``n`` calls, a share of which hand back a finishing step that sleeps (as a
    posted point-to-point call waits); return the order the futures resolved in and the
    thread that resolved each."""
    worker = LinkWorker("test-order", torch.device("cpu"), in_flight=2)
    rng = random.Random(seed)
    order, threads, lock = [], {}, threading.Lock()
    futures = []
    for i in range(n):
        delay = rng.random() * 0.002 if rng.random() < finishing_share else None

        def call(delay=delay):
            return None if delay is None else (lambda: time.sleep(delay))

        def note(future, i=i):
            with lock:
                order.append(i)
                threads[i] = threading.current_thread().name
        future = worker.submit(call)
        future.add_done_callback(note)
        futures.append(future)
    for future in futures:
        future.result(timeout=30)
    worker.close()
    worker.join(timeout=10)
    return order, threads


def test_futures_resolve_in_submission_order_with_finishing_calls_between():
    order, _ = _resolution_order(400, finishing_share=0.4, seed=0)
    assert order == list(range(400))


def test_a_call_that_finished_whole_resolves_on_the_worker():
    # Nothing is ever handed to the finishing thread: every future resolves on the
    # worker itself (before, each went through "fgpsdp-test-order-wait": one more
    # thread wake-up per shared-memory collective).
    order, threads = _resolution_order(50, finishing_share=0.0, seed=1)
    assert order == list(range(50))
    assert set(threads.values()) == {"fgpsdp-test-order"}


@pytest.mark.parametrize("in_flight", [1, 2])
def test_a_call_submitted_after_close_raises_instead_of_never_running(in_flight):
    # Before, it went into the queue behind the worker's last item and its
    # waiter (a step's future.result()) waited forever.
    worker = LinkWorker("test-closed", torch.device("cpu"), in_flight=in_flight)
    ran = []
    before = worker.submit(lambda: ran.append(0))
    worker.close()
    worker.close()  # twice is harmless
    with pytest.raises(RuntimeError, match="closed"):
        worker.submit(lambda: ran.append(1))
    before.result(timeout=10)  # what came before the close still runs
    worker.join(timeout=10)
    assert ran == [0] and not worker.is_alive()


def test_a_failure_resolves_in_order_between_finishing_calls():
    worker = LinkWorker("test-fail", torch.device("cpu"), in_flight=2)
    order = []

    def slow():
        return lambda: time.sleep(0.05)

    def fails():
        raise ValueError("boom")
    futures = [worker.submit(slow), worker.submit(fails), worker.submit(lambda: None)]
    for i, future in enumerate(futures):
        future.add_done_callback(lambda f, i=i: order.append(i))
    assert futures[0].result(timeout=10) is None
    assert isinstance(futures[1].exception(timeout=10), ValueError)
    assert futures[2].result(timeout=10) is None
    worker.close()
    worker.join(timeout=10)
    assert order == [0, 1, 2]


def test_one_hardware_queue_with_several_nccl_communicators_warns(monkeypatch):
    """CUDA_DEVICE_MAX_CONNECTIONS=1 serialises the link workers' NCCL kernels in
    launch order, which differs between ranks: said at wrapping, not left to hang."""
    import warnings
    from fgpsdp_runtime.gpu_setup import warn_if_one_hardware_queue
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.warns(RuntimeWarning, match=r"CUDA_DEVICE_MAX_CONNECTIONS=1 .* 4 NCCL "
                      r"communicators at once"):
        warn_if_one_hardware_queue(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_one_hardware_queue(1)  # one communicator: one launch order
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
        warn_if_one_hardware_queue(4)
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
        warn_if_one_hardware_queue(4)
