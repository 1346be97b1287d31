"""Does ``destroy_process_group()`` right after an object collective hang? (gloo, CPU)

On torch before its pull request 154976 (2.4.1 hung so), gloo's worker thread may
free the last reference to a finished collective's tensor while the destroy holds
the GIL and joins that thread (see [Note: tensors a finished gloo collective still
holds] in fgpsdp_runtime/group_collectives.py). Each round runs 2 fresh ranks per
mode, in turn, each ending with ``destroy_process_group()`` right after:

- ``torch``: torch's ``all_gather_object``;
- ``runtime``: the runtime's ``object_collectives.all_gather_objects``;
- ``refused``: a wrapping the set-up checks refuse (the ranks' models differ), caught.

A rank still alive after ``--cut-s`` counts as a hang (with ``gdb`` on the PATH its
stack is checked for ``~ProcessGroupGloo``), and is killed.

    python bench/gloo_teardown_check.py --rounds 50
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time

MODES = ("torch", "runtime", "refused")


def _rank(rank: int, port: int, mode: str) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    if mode == "torch":
        gathered = [None, None]
        dist.all_gather_object(gathered, {"rank": rank})
    elif mode == "runtime":
        from fgpsdp_runtime.object_collectives import all_gather_objects
        gathered = all_gather_objects({"rank": rank}, None, "teardown check")
    else:
        import fgpsdp_runtime as fgp
        try:
            fgp.DistributedDataParallel(torch.nn.Linear(4, 4 if rank == 0 else 5))
            raise SystemExit("the set-up checks did not refuse the wrapping")
        except ValueError:
            gathered = [{"rank": 0}, {"rank": 1}]
    assert gathered == [{"rank": 0}, {"rank": 1}], gathered
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_run(mode: str, cut_s: float) -> str:
    """'ok', 'hung' (with ' in ~ProcessGroupGloo' where gdb saw it) or 'failed'."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), str(port), mode])
             for r in (0, 1)]
    deadline = time.time() + cut_s
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
    alive = [proc for proc in procs if proc.poll() is None]
    if not alive:
        return "ok" if all(proc.returncode == 0 for proc in procs) else "failed"
    where = ""
    if shutil.which("gdb"):
        stack = subprocess.run(["gdb", "-p", str(alive[0].pid), "-batch", "-ex",
                                "thread apply all bt"], capture_output=True, text=True,
                               timeout=120).stdout
        where = " in ~ProcessGroupGloo" if "~ProcessGroupGloo" in stack else ""
    for proc in alive:
        proc.kill()
        proc.wait()
    return "hung" + where


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--cut-s", type=float, default=40.0)
    args = parser.parse_args()
    modes = args.modes.split(",")
    counts = {mode: {} for mode in modes}
    import torch
    print(f"torch {torch.__version__}, {args.rounds} rounds of {modes}", flush=True)
    for i in range(args.rounds):
        for mode in modes:
            outcome = _one_run(mode, args.cut_s)
            counts[mode][outcome] = counts[mode].get(outcome, 0) + 1
            if outcome != "ok":
                print(f"round {i}: {mode} {outcome}", flush=True)
    for mode in modes:
        print(f"{mode:8s} {args.rounds} runs: {counts[mode]}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        _rank(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        main()
