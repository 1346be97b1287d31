"""The benchmark driver's own arithmetic (bench/ is not a package: imported by path)."""
import os
import sys
import threading
import time

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


@pytest.fixture(scope="module")
def bench_modules():
    sys.path.insert(0, BENCH)
    try:
        import emulated
        import systems
        import train_rank
        yield systems, emulated, train_rank
    finally:
        sys.path.remove(BENCH)


def test_system_names(bench_modules):
    systems, _, _ = bench_modules
    assert systems.fgpsdp_variant("fgpsdp") == {}
    assert systems.fgpsdp_variant("fgpsdp_flat") == {"topology": "flat"}
    assert systems.fgpsdp_variant("fgpsdp_gloo_intra")["topology"].shared_memory is False
    assert systems.fgpsdp_variant("fgpsdp_next_forward") == {"schedule": "next_forward"}
    assert systems.fgpsdp_variant("fgpsdp_sideways") is None
    assert systems.fgpsdp_variant("ddp") is None
    assert systems.split_bucket_suffix("fgpsdp_next_forward_bucket8") == ("fgpsdp_next_forward", 8.0)
    assert systems.split_bucket_suffix("ddp_bucket2.5") == ("ddp", 2.5)
    assert systems.split_bucket_suffix("fsdp_hybrid_zero2") == ("fsdp_hybrid_zero2", None)
    assert systems.is_system("ddp") and systems.is_system("fsdp_grad_op_bucket4")
    assert not systems.is_system("fgpsdp_bucket") and not systems.is_system("mpi_bucket8")


def test_thread_cpu_seconds_names_python_threads(bench_modules):
    _, _, train_rank = bench_modules
    spun = threading.Event()

    def spin_then_sleep():
        stop = time.thread_time() + 0.2
        while time.thread_time() < stop:
            pass
        spun.set()
        time.sleep(0.5)

    worker = threading.Thread(target=spin_then_sleep, name="fgpsdp-test-spinner")
    worker.start()
    spun.wait()
    seconds = train_rank.thread_cpu_seconds()
    worker.join()
    assert seconds.get("fgpsdp-test-spinner", 0.0) >= 0.1  # kernel ticks: 0.2 s spun
    assert "MainThread" in seconds


def test_cpu_roles_split_threads(bench_modules):
    _, emulated, _ = bench_modules
    ranks = [{"cpu_s_per_step_by_thread": {"MainThread": 1.0, "fgpsdp-inter-rs": 0.25,
                                           "native:gloo_tcp_loop": 0.5}},
             {"cpu_s_per_step_by_thread": {"MainThread": 2.0, "fgpsdp-scheduler": 0.25}}]
    assert emulated.cpu_roles(ranks) == {"training thread": 3.0, "fgpsdp threads": 0.5,
                                         "other threads": 0.5}
