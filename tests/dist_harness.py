"""Run a function on N CPU processes with gloo and collect every rank's result.

Each run starts fresh processes. Not forks of pytest (it may have started
OpenMP threads) but of a forkserver: one single-threaded process that imports
torch and the package once, so a rank starts at once instead of after the
seconds an import of torch takes on CI's two cores (most of the suite's time
was spent there). A rank gets the parent's environment as it is at the call
(a test may set variables first) for what is read after the import of torch
(our variables, LOCAL_WORLD_SIZE); what torch reads at its import comes from
the forkserver's start. The forkserver imports this checkout's package (the
repository root is put first on PYTHONPATH here), and a rank ends as a
spawned one does, running the atexit handlers (the runtime's thread shutdown)
before it exits. ``FGPSDP_TEST_START_METHOD=spawn`` spawns instead. A rank's
exception is re-raised in the test with its traceback; a hang is cut by a
timeout instead of stalling CI.
"""
from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 180
DEFAULT_PG_TIMEOUT_S = 60.0  # the process groups' (init_process_group(timeout=...))
START_METHOD = os.environ.get("FGPSDP_TEST_START_METHOD", "forkserver")
# The forkserver is a fresh interpreter: it finds packages through PYTHONPATH,
# not through this process's sys.path (a venv's editable install may map
# fgpsdp_runtime to another checkout).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
# Imported once by the forkserver (before any rank starts; a failed import is
# left to the ranks, which then import it themselves).
mp.set_forkserver_preload(["torch", "torch.distributed", "fgpsdp_runtime", "tests.scenarios"])


def destroys_its_group(fn: Callable) -> Callable:
    """Marks a scenario that may destroy the default group itself: the harness then
    destroys it after the scenario only if it is still there."""
    fn.destroys_its_group = True
    return fn


def _rendezvous_store(rank: int, world_size: int, out_dir: str, timeout_s: float):
    """The run's TCP store. Rank 0 binds port 0 and keeps it, then names the port in
    a file of the run's directory, which the others read: no port is picked first and
    bound later, which another test run in parallel (pytest -n) could take meanwhile,
    or whose store the other ranks could join."""
    import torch.distributed as dist
    path = os.path.join(out_dir, "store_port")
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        with open(path + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(path + ".tmp", path)  # whole or absent, never half written
        return store
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if os.path.exists(os.path.join(out_dir, "rank0.pkl")):  # its result, an error
            raise RuntimeError("rank 0 ended before it named the store's port")
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 named no store port within {timeout_s} s")
        time.sleep(0.005)
    with open(path) as f:
        port = int(f.read())
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)


def _worker(rank: int, world_size: int, fn: Callable, args: tuple,
            out_dir: str, pg_timeout_s: float, environ: dict[str, str]) -> None:
    os.environ.clear()  # a fork holds the forkserver's, from when it started
    os.environ.update(environ)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    result: dict[str, Any]
    try:
        import fgpsdp_runtime
        if not os.path.abspath(fgpsdp_runtime.__file__).startswith(_ROOT + os.sep):
            raise RuntimeError(f"rank imported {fgpsdp_runtime.__file__}, not this checkout's")
        store = _rendezvous_store(rank, world_size, out_dir, pg_timeout_s)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout_s))
        del store  # the group holds it
        # Every rank connected before any runs fn: one whose fn makes no collective
        # (a local check) destroyed its group and exited while a peer was still in
        # gloo's connectFullMesh, which then failed ("Connection closed by peer").
        dist.barrier()
        try:
            result = {"ok": True, "value": fn(rank, world_size, *args)}
        finally:
            # Unconditionally but for a scenario marked to destroy it itself: one
            # that lost the group otherwise (a wrapper destroying it) fails here.
            if dist.is_initialized() or not getattr(fn, "destroys_its_group", False):
                dist.destroy_process_group()
    except BaseException as error:  # reported to the parent
        result = {"ok": False, "type": type(error).__name__, "message": str(error),
                  "traceback": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if START_METHOD != "spawn":
        # A fork ends in os._exit, past the atexit handlers a spawned rank runs (the
        # runtime's threads are stopped and joined there): run them, so that a hang
        # in them still fails the test (by its timeout).
        import atexit
        atexit._run_exitfuncs()


class RankError(Exception):
    def __init__(self, results: dict[int, dict]):
        self.results = results
        lines = [f"rank {r}: {res['type']}: {res['message']}\n{res['traceback']}"
                 for r, res in sorted(results.items()) if not res["ok"]]
        super().__init__("\n".join(lines))

    def messages(self) -> dict[int, str]:
        return {r: f"{res['type']}: {res['message']}" for r, res in self.results.items()
                if not res["ok"]}


def run_distributed(world_size: int, fn: Callable, *args: Any,
                    timeout_s: float = DEFAULT_TIMEOUT_S,
                    pg_timeout_s: float = DEFAULT_PG_TIMEOUT_S,
                    allow_errors: bool = False):
    """fn(rank, world_size, *args) on every rank; returns the list of results.

    With allow_errors, returns {rank: result dict} instead of raising, so a
    test can check that every rank raised.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.get_context(START_METHOD)
        environ = dict(os.environ)
        procs = [ctx.Process(target=_worker, args=(r, world_size, fn, args, out_dir,
                                                   pg_timeout_s, environ))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            raise TimeoutError(f"ranks {hung} did not finish within {timeout_s}s")
        results = {}
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} died without a result "
                                   f"(exit code {procs[r].exitcode})")
            with open(path, "rb") as f:
                results[r] = pickle.load(f)
    if allow_errors:
        return results
    if not all(res["ok"] for res in results.values()):
        raise RankError(results)
    return [results[r]["value"] for r in range(world_size)]


def call_many(rank: int, world_size: int, calls: list[tuple],
              allow_errors: bool = False) -> dict[tuple, Any]:
    """Several rank functions in turn in one set of processes (spawning costs seconds):
    ``call = (function, *arguments)``; returns {call: that rank's result}.

    Pass it to run_distributed. Between calls the previous call's objects are
    freed (a wrapper's threads stop with it) and the ranks meet at a barrier.
    A call that raises fails them all, as one run_distributed would; with
    ``allow_errors`` each result is {"ok", "type", "message"} instead. A call
    that raises on some ranks only leaves the others waiting in a collective:
    the run times out without naming it.
    """
    import gc

    import torch.distributed as dist
    results = {}
    for call in calls:
        if not allow_errors:
            results[call] = call[0](rank, world_size, *call[1:])
        else:
            try:
                call[0](rank, world_size, *call[1:])
                results[call] = {"ok": True}
            except Exception as error:  # noqa: BLE001 - the test checks its type and message
                results[call] = {"ok": False, "type": type(error).__name__,
                                 "message": str(error)}
                del error  # its traceback would keep the call's wrapper (and threads) alive
        gc.collect()
        dist.barrier()
    return results


def run_calls(world_size: int, calls: list[tuple], timeout_s: float = DEFAULT_TIMEOUT_S,
              ) -> dict[tuple, list[Any]]:
    """``call_many`` on ``world_size`` ranks: {call: [rank 0's result, rank 1's, ...]}."""
    per_rank = run_distributed(world_size, call_many, calls, timeout_s=timeout_s)
    return {call: [r[call] for r in per_rank] for call in calls}


def regroup_without_a_backend(rank: int, world_size: int, store_path: str) -> None:
    """In a rank: replace the harness's gloo group with one made as many launch
    scripts make theirs, ``init_process_group()`` with no backend (torch then takes
    gloo for CPU tensors; ``dist.get_backend()`` says "undefined"). With a GPU torch
    makes NCCL only: tests of this skip there (``skip_with_a_gpu``)."""
    import torch.distributed as dist
    dist.destroy_process_group()
    dist.init_process_group(store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size)


def skip_with_a_gpu(test):
    import pytest
    import torch
    return pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, init_process_group() "
                              "without a backend makes NCCL only")(test)
