"""A rank that ends (an exception after backward) while a peer is slower than the
exit's join timeout: its link worker is left in a shared-memory barrier, which
polls; without the exit's abort of that wait, the worker took the GIL back
during interpreter finalization and the process aborted ("terminate called
without an active exception", exit code -6) after its traceback."""
import os
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch.distributed as dist

from fgpsdp_runtime import shutdown

_RANK = textwrap.dedent("""
    import os, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    import fgpsdp_runtime as fgp
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", int(os.environ["PORT"]), 2, is_master=False,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(
        torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)]),
        bucket_cap_mb=0.005, schedule=os.environ["SCHEDULE"])
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    for step in range(3):
        loss = model(torch.randn(8, 32)).square().mean()
        if step == 2 and rank == 0:
            time.sleep(float(os.environ["SLOW_S"]))
        loss.backward()  # rank 1's reduce-scatters wait for rank 0's
        if step == 2 and rank == 1:
            raise RuntimeError("injected after backward")
        opt.step()
        opt.zero_grad()
""")


@pytest.mark.parametrize("schedule", ["next_forward", "serial"])
def test_exit_while_a_peer_is_slow_does_not_abort(schedule):
    # The ranks' store, served from here on a port bound and held from the start
    # (one picked free and bound later could be taken meanwhile by a parallel test).
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    port = store.port
    slow_s = shutdown.EXIT_JOIN_TIMEOUT_S + 2.0  # past the exit's join timeout
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PORT=str(port),
               SCHEDULE=schedule, SLOW_S=str(slow_s), OMP_NUM_THREADS="1",
               FGPSDP_SHARED_MEMORY="1")
    procs = [subprocess.Popen([sys.executable, "-W", "ignore", "-c", _RANK],
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert "injected after backward" in outs[1], outs[1][-3000:]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert "terminate called" not in out, (rank, out[-3000:])
        assert p.returncode == 1, (rank, p.returncode, out[-3000:])
