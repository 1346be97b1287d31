"""Line up the traces of the ranks of one host: who waits for whom, step by step.

    python bench/rank_skew.py TRACE_rank0.json TRACE_rank1.json ...

The traces are what ``train_rank.py --trace-steps N`` writes (one per rank,
``trace-<system>-rank<r>.json``); on one host their clocks agree, so each
trace's ``perf_counter_origin_s`` puts them on one time axis. For every traced
step this prints, per rank, when its forward, backward and optimizer step
started (seconds after the earliest rank's forward of that step), and how
long its main thread waited in that step for all-gathers, for
reduce-scatters and in the norm all-reduce. A rank that starts its backward
late and waits little is the one the others wait for.
"""
from __future__ import annotations

import argparse

from timeline_report import load_trace  # bench/ is on the path

PHASES = ("forward", "backward", "optimizer step")
WAITS = {"wait AG": "AG wait", "wait reduce-scatters": "RS wait", "norm all-reduce": "norm"}


def load(path: str) -> tuple[int, list[tuple[str, str, float, float]]]:
    """(rank, compute-lane spans in perf_counter seconds) of one rank's trace."""
    meta, spans = load_trace(path)
    origin = meta.get("perf_counter_origin_s")
    if origin is None:
        raise SystemExit(f"{path}: no perf_counter_origin_s (written before traces kept it)")
    rank = int(meta["name"].split()[-1])  # "rank <r>"
    return rank, [(lane, name, origin + s, origin + e) for lane, name, s, e in spans
                  if lane == "compute"]


def steps_of(spans) -> list[dict]:
    """Each step: from one forward's start to the next forward's start."""
    forwards = sorted(s for _, name, s, _ in spans if name == "forward")
    bounds = forwards + [float("inf")]
    steps = []
    for lo, hi in zip(bounds, bounds[1:]):
        inside = [(name, s, e) for _, name, s, e in spans if lo <= s < hi]
        step = {"start": {p: next((s for n, s, _ in inside if n.startswith(p)), None)
                          for p in PHASES}}
        for prefix, label in WAITS.items():
            step[label] = sum(e - s for n, s, e in inside if n.startswith(prefix))
        steps.append(step)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+")
    args = parser.parse_args()
    ranks = dict(sorted(load(path) for path in args.traces))
    per_rank = {r: steps_of(spans) for r, spans in ranks.items()}
    n_steps = min(len(s) for s in per_rank.values())
    for i in range(n_steps):
        t0 = min(per_rank[r][i]["start"]["forward"] for r in per_rank)
        print(f"step {i}: seconds after the first forward start; main-thread waits in s")
        print(f"  {'rank':>4s} " + " ".join(f"{p:>15s}" for p in PHASES)
              + " " + " ".join(f"{w:>8s}" for w in WAITS.values()))
        for r, steps in per_rank.items():
            step = steps[i]
            starts = " ".join(
                f"{step['start'][p] - t0 if step['start'][p] is not None else float('nan'):15.3f}"
                for p in PHASES)
            waits = " ".join(f"{step[w]:8.3f}" for w in WAITS.values())
            print(f"  {r:>4d} {starts} {waits}")


if __name__ == "__main__":
    main()
