"""Benchmark every system on the emulated two-node cluster and write the report.

    sudo .venv/bin/python bench/emulated.py --workloads gpt2,vgg16 --rate 1gbit

For each workload, rounds of runs go through every system in turn (the order
rotates each round), each run a fresh torchrun on both namespaces. Figures
are medians over rounds. The report goes to docs/benchmarks/<date>-emulated-2x2.md
with a PNG chart beside it, and raw results to JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CLUSTER = os.path.join(HERE, "cluster.sh")
sys.path.insert(0, HERE)
from systems import SYSTEMS, is_system, split_reduce_dtype_suffix, system_base  # noqa: E402
from timeline_report import WAITS, breakdown, load_spans, overlap_chart  # noqa: E402
from workloads import CONFIGS, WORKLOADS  # noqa: E402

PEERS = ("ddp", "ddp_zero1", "fsdp_grad_op", "fsdp_hybrid_zero2", "deepspeed_zero2")


def rate_bits_per_s(rate: str) -> float:
    m = re.fullmatch(r"([\d.]+)\s*([kmg]?)bit", rate.lower())
    if not m:
        raise ValueError(f"rate {rate!r}: use a tc rate such as 1gbit or 500mbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def run_once(workload, size, system, steps, warmup, out_dir, save_params, port, log,
             trace_steps=0, trace_dest=None, max_norm=1.0, pin_cpu=False, flush_denormal=False,
             ranks_per_node=2):
    python = sys.executable
    cmd = (f"OMP_NUM_THREADS=1 {shlex.quote(python)} -m torch.distributed.run --nnodes=2 "
           f"--nproc_per_node={ranks_per_node} --node_rank=$NODE_RANK --master_addr=$MASTER_ADDR "
           f"--master_port={port} {shlex.quote(os.path.join(HERE, 'train_rank.py'))} "
           f"--workload {workload} --size {size} --system {system} --steps {steps} "
           f"--warmup {warmup} --out {shlex.quote(out_dir)} --trace-steps {trace_steps} "
           f"--max-norm {max_norm}" + (" --pin-cpu" if pin_cpu else "")
           + (" --flush-denormal" if flush_denormal else "")
           + (" --save-params" if save_params else ""))
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=os.environ.get(
        "TORCH_EXTENSIONS_DIR", os.path.join(tempfile.gettempdir(), "fgpsdp-torch-ext")),
        PYTHONWARNINGS="ignore")
    started = time.time()
    proc = subprocess.run(["bash", CLUSTER, "exec", "--", cmd], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with open(log, "a") as f:
        f.write(f"\n==== {workload} {system} rc={proc.returncode} ({time.time() - started:.0f}s)\n")
        # Records are committed: no paths of the machine that ran them.
        f.write(proc.stdout[-20000:].replace(ROOT, "<repo>").replace(sys.prefix, "<venv>"))
    results = []
    for rank in range(2 * ranks_per_node):
        path = os.path.join(out_dir, f"{system}-rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
            os.remove(path)
        trace = os.path.join(out_dir, f"trace-{system}-rank{rank}.json")
        if os.path.exists(trace):
            if rank == 0 and trace_dest:
                os.makedirs(os.path.dirname(trace_dest), exist_ok=True)
                os.replace(trace, trace_dest)
            else:
                os.remove(trace)
    return proc.returncode, results


def host_gflops(size: int = 512, reps: int = 20, tries: int = 3) -> float:
    """Single-thread fp32 matmul rate of this machine right now (best of ``tries``
    of about 50 ms each).

    Taken before every run, while nothing else runs: a shared cloud host's
    speed changes within minutes (in one run here a system's second round took
    3x its first), and a run on a slow stretch is then visible in the report.
    """
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        best = float("inf")
        for _ in range(tries):
            t0 = time.perf_counter()
            for _ in range(reps):
                torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 2 * size ** 3 * reps / best / 1e9


def param_diff(out_dir, system):
    import torch
    ref_path = os.path.join(out_dir, "params-ddp.pt")
    path = os.path.join(out_dir, f"params-{system}.pt")
    if not (os.path.exists(ref_path) and os.path.exists(path)):
        return None
    try:
        ref, ours = torch.load(ref_path), torch.load(path)
    except Exception:  # noqa: BLE001 - a run that died while saving: no comparison
        return None
    if len(ref) != len(ours):
        return float("inf")
    return max(float((a.double() - b.double()).abs().max()) for a, b in zip(ref, ours))


def machine() -> str:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{model}, {os.cpu_count()} cores, {mem:.0f} GiB, {platform.platform()}"


def versions() -> str:
    import torch
    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    try:
        import deepspeed
        parts.append(f"deepspeed {deepspeed.__version__}")
    except Exception:  # noqa: BLE001 - report what is there
        parts.append("deepspeed not installed")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True).stdout.strip()
    parts.append(f"fgpsdp_runtime {commit or '?'}")
    return ", ".join(parts)


CPU_ROLES = ("training thread", "fgpsdp threads", "other threads")


def cpu_roles(ranks) -> dict[str, float]:
    """CPU seconds per step of all ranks, split into the training thread, the
    fgpsdp runtime's threads (scheduler, link workers) and the rest (gloo's
    transport and run loop, torch's pools, a peer's own threads)."""
    out = dict.fromkeys(CPU_ROLES, 0.0)
    for rank in ranks:
        for name, seconds in rank.get("cpu_s_per_step_by_thread", {}).items():
            role = ("training thread" if name == "MainThread" else
                    "fgpsdp threads" if name.startswith("fgpsdp-") else "other threads")
            out[role] += seconds
    return out


def round_steal_share(ranks) -> Optional[float]:
    """The largest steal share any rank of one round measured, or None if none did."""
    shares = [x["steal_share"] for x in ranks if x.get("steal_share") is not None]
    return max(shares) if shares else None


def rounds_cell(values, fmt: str) -> str:
    """Per-round figures as ``"a / b"``; ``-`` where one was not measured."""
    if not values or all(x is None for x in values):
        return "-"
    return " / ".join("-" if x is None else fmt.format(x) for x in values)


def steal_cell(shares) -> str:
    """Per-round steal shares as ``"0.1 / 23.4"`` percent."""
    return rounds_cell([None if x is None else 100 * x for x in shares or []], "{:.1f}")


def summarise(workload, runs, rate_bps, out_dir, systems, world=4):
    """runs: {system: [per-round list of rank results]} -> table rows."""
    rows = {}
    for system in systems:
        rounds = [r for r in runs.get(system, []) if len(r) == world]
        if not rounds:
            rows[system] = None
            continue
        step = statistics.median(max(x["step_time_s"] for x in r) for r in rounds)
        tx = [x["node_tx_bytes_per_step"] for r in rounds for x in r
              if x["local_rank"] == 0 and x["node_tx_bytes_per_step"] is not None]
        rows[system] = {
            "step_time_s": step,
            "rounds": [max(x["step_time_s"] for x in r) for r in rounds],
            "peak_rss_bytes": max(x["peak_rss_bytes"] for r in rounds for x in r),
            # CPU seconds of all ranks per step (every thread): with all
            # ranks on this machine's cores, cpu / cores bounds the step from below.
            "cpu_s_per_step": statistics.median(sum(x.get("cpu_s_per_step", 0.0) for x in r)
                                                for r in rounds),
            # All ranks: fresh pages mapped per step (each is zeroed by the kernel).
            "minor_faults_per_step": statistics.median(
                sum(x.get("minor_faults_per_step", 0.0) for x in r) for r in rounds),
            "cpu_by_role": {role: statistics.median(cpu_roles(r)[role] for r in rounds)
                            for role in CPU_ROLES},
            # Per round: the share of the machine's CPU the hypervisor took while
            # the steps were timed (every rank reads the same machine-wide figure).
            "steal_share_rounds": [round_steal_share(r) for r in rounds],
            "host_gflops_rounds": [r[0].get("host_gflops") for r in rounds],
            "opt_state_bytes": max(x["opt_state_bytes"] for x in rounds[0]),
            "node_tx_bytes_per_step": statistics.median(tx) if tx else None,
            "final_loss": rounds[0][0]["final_loss"],
            "param_diff_to_ddp": param_diff(out_dir, system),
            "workload": rounds[0][0]["workload"],
            "schedule_info": {k: rounds[0][0][k] for k in
                              ("plan", "speculative_commits", "speculative_rollbacks",
                               "node_transport")
                              if k in rounds[0][0]},
        }
    info = next((r["workload"] for r in rows.values() if r), None)
    param_bytes = 4 * info["parameters"] if info else 0
    nodes = 2
    # Each node must send (nodes-1)/nodes of the gradient (reduce-scatter) and of
    # the parameters (all-gather) over its inter-node link.
    floor_comm = 2 * (nodes - 1) / nodes * param_bytes * 8 / rate_bps
    compute = rows.get("compute")
    floor = max(compute["step_time_s"] if compute else 0.0, floor_comm)
    return rows, {"floor_s": floor, "comm_floor_s": floor_comm,
                  "compute_s": compute["step_time_s"] if compute else None, "workload": info}


def all_rows_systems(all_rows) -> set:
    return {s for rows, _ in all_rows.values() for s in rows}


def markdown(all_rows, meta, command, rate):
    per_node = meta.get("ranks_per_node", 2)
    world = 2 * per_node
    lines = [f"# Emulated 2x{per_node} cluster benchmark ({meta['date']})", "",
             f"Command: `{command}`", "",
             f"Machine: {meta['machine']}. Versions: {meta['versions']}.", "",
             f"Emulated cluster: 2 network namespaces x {per_node} CPU process(es) (gloo), inter-node "
             f"veth shaped with tbf at {rate}; intra-node traffic unshaped, over loopback "
             f"(fgpsdp: through shared memory; `fgpsdp_gloo_intra`: over loopback). "
             f"All {world} ranks share this machine's {os.cpu_count()} cores, so compute is slower "
             f"than on real nodes"
             + (" (each rank pinned to core local rank mod cores, so the two ranks on a core "
                "share it evenly). " if meta.get("pin_cpu") else ". ") +
             ("Every rank flushes subnormal floats to zero (`torch.set_flush_denormal`). "
              if meta.get("flush_denormal") else "") +
             f"Step time = wall time of back-to-back steps / steps, the slowest rank, median "
             f"over {meta['rounds']} rounds ({meta['warmup']} warm-up + {meta['steps']} timed "
             f"steps each). Floor = max(compute-only step, 2 x (nodes-1)/nodes x parameter bytes "
             f"/ link rate)"
             + ("; `compute_synced` is the compute-only step plus one one-element all-reduce "
                "per step (the synchronisation exact global-norm clipping needs), so its gap "
                "to `compute` is what the ranks' drift on shared cores costs a step that "
                "waits for the slowest rank. " if "compute_synced" in all_rows_systems(all_rows)
                else ". ")
             + f"Inter-node MiB = bytes node 0 sent over the veth per step. "
             f"Buckets: the peers at 25 MB (torch DDP's default; FSDP's wrap unit and "
             f"DeepSpeed's buckets to match), fgpsdp at its own default (1/16 of the model, "
             f"1-25 MB); a `_bucket<MB>` suffix sets another size. "
             f"CPU core-s/step = CPU time of all {world} ranks' processes (every thread) per step; "
             f"divided by the machine's {os.cpu_count()} cores it is a lower bound on the step. "
             f"|Δ| = largest parameter difference to torch DDP after the run (AdamW, clip "
             f"{meta.get('max_norm', 1.0):g}).", ""]
    for workload, (rows, floor) in all_rows.items():
        info = floor["workload"] or {}
        # Sharded peers at any bucket size (a _bucket<MB> variant counts as its
        # system); a row is compared with the peers that reduce in its dtype.
        def best_peer_for(system):
            dtype = split_reduce_dtype_suffix(system)[1]
            peers = [row["step_time_s"] for s, row in rows.items()
                     if row and system_base(s) in PEERS and system_base(s) != "ddp"
                     and split_reduce_dtype_suffix(s)[1] == dtype]
            return min(peers) if peers else None
        lines += [f"## {workload}", "",
                  f"Configuration: `{json.dumps({k: v for k, v in info.items() if k not in ('name',)})}`; "
                  f"floor {floor['floor_s']:.3f} s (compute {floor['compute_s'] or 0:.3f} s, "
                  f"network {floor['comm_floor_s']:.3f} s).", "",
                  "| system | step s | x best sharded peer | x floor | CPU core-s/step | "
                  "peak RSS/rank MiB | opt state/rank MiB | inter-node MiB/step | "
                  "max abs Δ vs DDP |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for system, row in rows.items():
            if row is None:
                lines.append(f"| {system} | failed (see log) | | | | | | | |")
                continue
            best_peer = best_peer_for(system)
            ratio = f"{row['step_time_s'] / best_peer:.2f}" if best_peer else "-"
            tx = row["node_tx_bytes_per_step"]
            diff = row["param_diff_to_ddp"]
            cpu = f"{row['cpu_s_per_step']:.2f}" if row.get("cpu_s_per_step") else "-"
            lines.append(
                f"| {system} | {row['step_time_s']:.3f} | {ratio} | "
                f"{row['step_time_s'] / floor['floor_s']:.2f} | {cpu} | "
                f"{row['peak_rss_bytes'] / 2**20:.0f} | "
                f"{row['opt_state_bytes'] / 2**20:.1f} | {'-' if tx is None else f'{tx / 2**20:.1f}'} | "
                f"{'-' if diff is None else f'{diff:.2g}'} |")
        lines.append("")
        if any((row or {}).get("cpu_by_role") for row in rows.values()):
            lines += [f"CPU core-seconds per step, all {world} ranks, by thread; minor page faults per "
                      f"step, all {world} ranks (fresh pages the kernel maps and zeroes); hypervisor "
                      "steal, per round: the share of this virtual machine's CPU time the host "
                      "gave to others while the steps were timed; host GFLOP/s, per round: a "
                      "single-thread matmul just before the run (a round on a slow stretch of "
                      "the host measured the host):", "",
                      "| system | " + " | ".join(CPU_ROLES)
                      + " | page faults/step | steal % | host GFLOP/s |",
                      "|---|" + "---:|" * (len(CPU_ROLES) + 3)]
            for system, row in rows.items():
                if row and row.get("cpu_by_role"):
                    faults = row.get("minor_faults_per_step")
                    lines.append(f"| {system} | " + " | ".join(
                        f"{row['cpu_by_role'][role]:.2f}" for role in CPU_ROLES)
                        + f" | {'-' if faults is None else f'{faults:,.0f}'} | "
                        f"{steal_cell(row.get('steal_share_rounds'))} | "
                        f"{rounds_cell(row.get('host_gflops_rounds'), '{:.1f}')} |")
            lines.append("")
        for system, row in rows.items():
            info = (row or {}).get("schedule_info") or {}
            transport = f"intra-node bytes via {info['node_transport']}" \
                if info.get("node_transport") else ""
            if info.get("plan"):
                plan = json.loads(info["plan"])
                lines.append(
                    f"{system}: {transport + '; ' if transport else ''}plan from "
                    f"{plan['source']}, stage 1 = {plan['stage1']}, stage 2 = "
                    f"{plan['stage2']}, lookahead {plan['lookahead']}; speculative bucket steps "
                    f"committed {info['speculative_commits']}, rolled back "
                    f"{info['speculative_rollbacks']} (rank 0, round 1, all steps).")
                lines.append("")
            elif transport:
                lines.append(f"{system}: {transport}.")
                lines.append("")
    return "\n".join(lines)


def chart(all_rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    workloads = list(all_rows)
    systems = [s for s in next(iter(all_rows.values()))[0]]
    fig, axes = plt.subplots(1, len(workloads), figsize=(4 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        rows, floor = all_rows[workload]
        names = [s for s in systems if rows.get(s)]
        values = [rows[s]["step_time_s"] for s in names]
        colors = ["tab:red" if s.startswith("fgpsdp") else "tab:gray" if s.startswith("compute")
                  else "tab:blue" for s in names]
        ax.bar(range(len(names)), values, color=colors)
        ax.axhline(floor["floor_s"], color="black", linestyle="--", linewidth=1, label="floor")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=60, ha="right", fontsize=8)
        ax.set_title(workload)
        ax.set_ylabel("step time (s)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def trace_report(stem, workload, systems, steps):
    """Breakdown per traced fgpsdp system, and the workload's overlap chart."""
    traces = {}
    for system in systems:
        path = os.path.join(f"{stem}-traces", f"{workload}-{system}.json")
        if os.path.exists(path):
            traces[system] = load_spans(path)
    if not traces:
        return {}
    png = f"{stem}-timeline-{workload}.png"
    overlap_chart(traces, png, f"{workload}: rank 0, last {steps} timed steps (round 1)")
    return {"steps": steps, "png": os.path.basename(png),
            "breakdown": {system: breakdown(spans, steps) for system, spans in traces.items()}}


def timeline_markdown(timelines, stem):
    if not any(timelines.values()):
        return ""
    lines = ["", "## Where the time goes (timelines)", "",
             "From the Chrome traces of rank 0 (round 1, the last timed steps; traces in "
             f"`{os.path.basename(stem)}-traces/`, open in chrome://tracing or Perfetto). "
             "Seconds per step. Compute phases run on the main thread; the waits are main-thread "
             "time inside them spent waiting for communication; 'busy' is the time a link "
             "worker had a collective running (rank 0's rail is `inter`).", ""]
    columns = ["window_s", "forward_s", "backward_s", "optimizer step_s", *WAITS.values()]
    for workload, report in timelines.items():
        if not report:
            continue
        rows = report["breakdown"]
        lanes = sorted({k for r in rows.values() for k in r if k.endswith(" busy")})
        header = ["system"] + [c.replace("_s", "") for c in columns] + lanes
        lines += [f"### {workload}", "", "| " + " | ".join(header) + " |",
                  "|---|" + "---:|" * (len(header) - 1)]
        for system, r in rows.items():
            lines.append("| " + " | ".join([system] + [f"{r.get(c, 0.0):.3f}"
                                                      for c in columns + lanes]) + " |")
        lines += ["", f"![timeline of {workload}]({report['png']})", ""]
    return "\n".join(lines)


def rerender(stem: str) -> None:
    """Report from a finished run's JSON and traces (after a change to the report code)."""
    with open(stem + ".json") as f:
        data = json.load(f)
    results, meta = data["results"], data["meta"]
    all_rows = {w: (r["rows"], r["floor"]) for w, r in results.items()}
    systems = list(next(iter(all_rows.values()))[0])
    rate = re.search(r"--rate (\S+)", data["command"])
    timelines = {w: trace_report(stem, w, systems, meta.get("trace_steps", 2)) for w in results}
    text = (markdown(all_rows, meta, data["command"], rate.group(1) if rate else "1gbit")
            + timeline_markdown(timelines, stem))
    if chart(all_rows, stem + ".png"):
        text += f"\n![step time per system]({os.path.basename(stem)}.png)\n"
    with open(stem + ".md", "w") as f:
        f.write(text)
    data["timelines"] = timelines
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=1)
    print(f"rewrote {stem}.md")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--size", default="cpu", choices=["cpu", "full"])
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks"))
    parser.add_argument("--tag", default="emulated-2x2")
    parser.add_argument("--rerender", metavar="STEM",
                        help="rewrite the report STEM.md (and its charts) from STEM.json and "
                             "the saved traces, without running anything")
    parser.add_argument("--max-norm", type=float, default=1.0,
                        help="every system clips the gradient at this total norm")
    parser.add_argument("--pin-cpu", action="store_true",
                        help="every rank of every system runs on one core (local rank mod "
                             "cores): ranks with one core each time-share it evenly, instead "
                             "of the kernel moving them between cores")
    parser.add_argument("--flush-denormal", action="store_true",
                        help="every rank flushes subnormal floats to zero (see train_rank.py)")
    parser.add_argument("--ranks-per-node", type=int, default=2,
                        help="CPU processes per emulated node (1: one rank per core on a 2-core "
                             "machine, no intra-node phase)")
    parser.add_argument("--trace-steps", type=int, default=2,
                        help="fgpsdp systems record a timeline of their last N timed steps "
                             "in round 1 (0: none)")
    args = parser.parse_args()
    if args.rerender:
        rerender(args.rerender)
        return
    workloads = [w for w in args.workloads.split(",") if w]
    systems = [s for s in args.systems.split(",") if s]
    for w in workloads:
        if (w, args.size) not in CONFIGS:
            parser.error(f"unknown workload {w}")
    for s in systems:
        if not is_system(s):
            parser.error(f"unknown system {s}; choose from {', '.join(SYSTEMS)}")
    if "ddp" not in systems:
        systems.insert(0, "ddp")  # every system is compared with DDP
    rate_bps = rate_bits_per_s(args.rate)
    os.makedirs(args.out, exist_ok=True)
    date = datetime.date.today().isoformat()
    stem = os.path.join(args.out, f"{date}-{args.tag}")
    log = stem + ".log"
    open(log, "w").close()
    # The workloads' switches (FGPSDP_BENCH_*, see workloads.py) reach the ranks through
    # the environment: the report's command carries them, or it would not reproduce.
    bench_env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("FGPSDP_BENCH_")}
    command = ("".join(f"{k}={shlex.quote(v)} " for k, v in bench_env.items())
               + "python bench/emulated.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]))

    subprocess.run(["bash", CLUSTER, "up", args.rate], check=True)
    all_rows, raw, timelines = {}, {}, {}
    port = 29600
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            for workload in workloads:
                runs: dict[str, list] = {}
                for rnd in range(args.rounds):
                    order = systems[rnd % len(systems):] + systems[:rnd % len(systems)]
                    for system in order:
                        port += 1
                        t0 = time.time()
                        traced = rnd == 0 and system.startswith("fgpsdp") and args.trace_steps
                        speed = host_gflops()
                        rc, res = run_once(
                            workload, args.size, system, args.steps, args.warmup, out_dir,
                            rnd == 0, port, log, trace_steps=args.trace_steps if traced else 0,
                            trace_dest=os.path.join(f"{stem}-traces", f"{workload}-{system}.json"),
                            max_norm=args.max_norm, pin_cpu=args.pin_cpu,
                            flush_denormal=args.flush_denormal,
                            ranks_per_node=args.ranks_per_node)
                        if rc == 0 and len(res) == 2 * args.ranks_per_node:
                            for x in res:
                                x["host_gflops"] = speed
                            runs.setdefault(system, []).append(res)
                            step = max(x["step_time_s"] for x in res)
                            status = f"{step:.3f} s/step (host {speed:.1f} GFLOP/s)"
                        else:
                            status = f"FAILED (rc {rc}; see {os.path.relpath(log, ROOT)})"
                        print(f"[{workload} round {rnd + 1}/{args.rounds}] {system:<18} {status} "
                              f"({time.time() - t0:.0f}s)", flush=True)
                rows, floor = summarise(workload, runs, rate_bps, out_dir, systems,
                                        world=2 * args.ranks_per_node)
                all_rows[workload] = (rows, floor)
                raw[workload] = {"rows": rows, "floor": floor, "runs": runs}
                timelines[workload] = trace_report(stem, workload, systems, args.trace_steps)
    finally:
        subprocess.run(["bash", CLUSTER, "down"])
    meta = {"date": date, "machine": machine(), "versions": versions(), "rounds": args.rounds,
            "steps": args.steps, "warmup": args.warmup, "trace_steps": args.trace_steps,
            "max_norm": args.max_norm, "pin_cpu": args.pin_cpu,
            "flush_denormal": args.flush_denormal, "ranks_per_node": args.ranks_per_node}
    text = markdown(all_rows, meta, command, args.rate) + timeline_markdown(timelines, stem)
    if chart(all_rows, stem + ".png"):
        text += f"\n![step time per system]({os.path.basename(stem)}.png)\n"
    with open(stem + ".md", "w") as f:
        f.write(text)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "command": command, "results": raw,
                   "timelines": timelines}, f, indent=1)
    print(text)
    print(f"\nwrote {stem}.md")


if __name__ == "__main__":
    main()
