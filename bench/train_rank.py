"""One rank of one benchmark run (launched by torchrun on each emulated node).

Trains ``--system`` on ``--workload`` for warm-up plus timed steps, back to back
(so that work a system defers into the next forward counts where it lands),
and writes this rank's figures as JSON. Rank 0 also saves the final
parameters so the orchestrator can compare every system with torch DDP.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import resource
import sys
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
# This checkout's fgpsdp_runtime, not the one the environment installed: a run from a
# second checkout (an A/B against an older commit) measured the installed one before,
# while the report named the checkout's commit.
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from systems import build_system, set_max_norm  # noqa: E402
from workloads import CONFIGS, build_model, describe, loss_fn, make_batch  # noqa: E402


def link_tx_bytes() -> int:
    """Bytes this node has sent over the inter-node link (the veth), or -1."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    try:
        with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
            return int(f.read())
    except (OSError, ValueError, TypeError):
        return -1


def machine_cpu_ticks(stat_path: str = "/proc/stat") -> tuple[int, int]:
    """(steal, total) clock ticks of the whole machine since boot, or (0, 0).

    Steal is time a virtual machine's cores were runnable but the hypervisor
    ran someone else: on a shared cloud host it comes and goes, and a timed
    window that lost a fifth of its CPU to it measures the host, not the system.
    """
    try:
        with open(stat_path) as f:
            fields = f.readline().split()
    except OSError:
        return 0, 0
    if not fields or fields[0] != "cpu":
        return 0, 0
    # user nice system idle iowait irq softirq steal [guest guest_nice]: guest
    # time is already inside user and nice, so it is not added again.
    ticks = [int(x) for x in fields[1:9]]
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks)


def steal_share(start: tuple[int, int], end: tuple[int, int]) -> Optional[float]:
    """The share of the machine's CPU time the hypervisor took between two readings."""
    total = end[1] - start[1]
    return (end[0] - start[0]) / total if total > 0 else None


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds per thread of this process, keyed by role.

    Python threads are named by their ``threading`` name (the runtime's
    scheduler and link workers are ``fgpsdp-*``); threads Python does not
    know (gloo's transport, torch's pools) are summed under their kernel name.
    """
    import threading
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue  # the thread ended meanwhile
        fields = stat[stat.rindex(")") + 2:].split()
        seconds = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        name = names.get(int(tid), f"native:{comm}")
        out[name] = out.get(name, 0.0) + seconds
    return out


class TimedWindow:
    """The counters at the start of the timed steps, read together."""

    def __init__(self) -> None:
        self.tx_start = link_tx_bytes()
        self.start = time.perf_counter()
        self.cpu_start = time.process_time()
        self.threads_start = thread_cpu_seconds()
        self.faults_start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        self.ticks_start = machine_cpu_ticks()


def main() -> None:
    # A rank that aborts (SIGABRT from C++, a segfault) prints every thread's
    # Python stack into the run's log.
    faulthandler.enable(all_threads=True)
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", required=True)
    parser.add_argument("--size", default="cpu")
    parser.add_argument("--system", required=True)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", required=True)
    parser.add_argument("--save-params", action="store_true")
    parser.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping norm")
    parser.add_argument("--trace-steps", type=int, default=0,
                        help="record the timeline of the last N timed steps (fgpsdp systems)")
    parser.add_argument("--flush-denormal", action="store_true",
                        help="flush subnormal floats to zero (torch.set_flush_denormal): "
                             "the BERT workload's gradients hold subnormals, which some "
                             "CPUs compute on about 9x slower")
    parser.add_argument("--pin-cpu", action="store_true",
                        help="run this rank (every thread it starts) on core LOCAL_RANK "
                             "mod the machine's cores")
    args = parser.parse_args()

    if args.pin_cpu:
        # Before torch and gloo start threads: they inherit the mask.
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(os.environ["LOCAL_RANK"]) % len(cores)]})
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.flush_denormal:
        torch.set_flush_denormal(True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = CONFIGS[(args.workload, args.size)]
    set_max_norm(args.max_norm)
    torch.manual_seed(0)
    model = build_model(cfg)
    info = describe(cfg, model)
    system = build_system(args.system, model, loss_fn(cfg), cfg.batch)

    step_times = []
    total_steps = args.warmup + args.steps
    timeline = system.timeline() if args.trace_steps > 0 else None
    dist.barrier()
    window = TimedWindow()
    for step in range(total_steps):
        if step == args.warmup:
            # Land what the warm-up deferred (fgpsdp's all-gathers), so that the
            # timed window holds the traffic of exactly the timed steps.
            system.finish_step()
            dist.barrier()
            window = TimedWindow()
        if timeline is not None and step == total_steps - args.trace_steps:
            timeline.enable()
        t0 = time.perf_counter()
        x, y = make_batch(cfg, step, rank)
        loss = system.train_step(x, y)
        step_times.append(time.perf_counter() - t0)
    system.finish_step()
    dist.barrier()
    elapsed = time.perf_counter() - window.start
    ticks_end = machine_cpu_ticks()
    # All threads of this process (compute, scheduler, link workers, gloo's
    # transport): on a shared machine, the sum over ranks against the cores
    # says whether the step is bound by CPU rather than by the network.
    cpu_seconds = time.process_time() - window.cpu_start
    threads_end = thread_cpu_seconds()
    cpu_by_thread = {name: (end - window.threads_start.get(name, 0.0)) / args.steps
                     for name, end in threads_end.items()}
    # Each minor fault maps (and zeroes) a fresh page: memory that is
    # allocated and freed every step costs CPU here.
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - window.faults_start
    tx_end = link_tx_bytes()
    final_loss = float(loss.detach())

    result = {
        "rank": rank, "world_size": world, "system": system.name, "workload": info,
        "step_time_s": elapsed / args.steps, "cpu_s_per_step": cpu_seconds / args.steps,
        "cpu_s_per_step_by_thread": cpu_by_thread, "minor_faults_per_step": faults / args.steps,
        "step_times_s": step_times[args.warmup:],
        "steal_share": steal_share(window.ticks_start, ticks_end),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "opt_state_bytes": system.opt_state_bytes(), "final_loss": final_loss,
        "local_rank": int(os.environ.get("LOCAL_RANK", rank)),
        "node_tx_bytes_per_step": ((tx_end - window.tx_start) / args.steps
                                   if window.tx_start >= 0 else None),
        "torch": torch.__version__,
        **system.schedule_info(),
    }
    params = system.final_params()
    if rank == 0 and args.save_params:
        torch.save([p.cpu() for p in params], os.path.join(args.out, f"params-{args.system}.pt"))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.system}-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if timeline is not None:
        timeline.save_chrome_trace(os.path.join(args.out, f"trace-{args.system}-rank{rank}.json"))
    # Every rank is done with every group before any rank tears them down.
    dist.barrier()
    del system
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
