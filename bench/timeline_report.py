"""Where the time goes: read fgpsdp Chrome traces, break a step down, draw the overlap chart.

    python bench/timeline_report.py trace-fgpsdp-rank0.json [more traces ...] --png out.png

A trace is what ``model.timeline.save_chrome_trace`` writes (bench/train_rank.py
``--trace-steps N`` records the last N timed steps). The breakdown reports,
per traced step, the compute phases on the main thread, the time the main
thread spent waiting for communication (forward waiting for all-gathers, the
step waiting for reduce-scatters and for the scheduler thread), and how busy
each link lane was.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from fgpsdp_runtime.tracing import LANE_ORDER, busy_seconds  # noqa: E402

# Compute-lane spans that are waits for communication, by what they wait for.
WAITS = {"wait AG": "forward waits for all-gathers", "wait reduce-scatters":
         "step waits for reduce-scatters", "join scheduler": "step waits for the scheduler",
         "norm all-reduce": "norm all-reduce",
         # MuonWithAdamW's step: its two exchanges, and the orthogonalisation between.
         "Muon's": "Muon's exchanges", "Newton-Schulz": "Newton-Schulz (compute)"}
MUON_PARTS = {"Muon's", "Newton-Schulz"}


def load_trace(path: str) -> tuple[dict, list[tuple[str, str, float, float]]]:
    """A Chrome trace written by fgpsdp_runtime: its process metadata (``name``,
    ``perf_counter_origin_s``) and its spans (lane, name, start s, end s), in
    seconds after its first span."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    meta = next((e["args"] for e in events
                 if e["ph"] == "M" and e["name"] == "process_name"), {})
    lanes = {e["tid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    return meta, [(lanes[e["tid"]], e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
                  for e in events if e["ph"] == "X"]


def load_spans(path: str) -> list[tuple[str, str, float, float]]:
    """(lane, name, start s, end s) from a Chrome trace written by fgpsdp_runtime."""
    return load_trace(path)[1]


# The main thread's phases of a step (the backward span's name carries a suffix).
PHASES = {"forward", "backward (from first gradient)", "optimizer step"}


def from_first_forward(spans):
    """The traced steps proper: drop what ended before the first forward began."""
    starts = [s for l, n, s, _ in spans if l == "compute" and n == "forward"]
    return [sp for sp in spans if sp[3] > min(starts)] if starts else spans


def traced_steps(spans) -> int:
    """The optimizer steps a trace holds (at least 1), for a trace saved without
    saying how many steps it covers."""
    return max(1, sum(1 for l, n, _, _ in from_first_forward(spans)
                      if l == "compute" and n == "optimizer step"))


def breakdown(spans, steps: int) -> dict[str, float]:
    """Seconds per traced step: compute phases, waits, and each lane's busy time."""
    spans = from_first_forward(spans)
    if not spans:
        return {}
    start = min(s for _, _, s, _ in spans)
    end = max(e for _, _, _, e in spans)
    out = {"window_s": (end - start) / steps}
    compute = [(n, e - s) for l, n, s, e in spans if l == "compute"]
    for phase in ("forward", "optimizer step"):
        out[phase + "_s"] = sum(d for n, d in compute if n == phase) / steps
    out["backward_s"] = sum(d for n, d in compute if n.startswith("backward")) / steps
    # A wait counts where a step's phase holds it: the harness's synchronize()
    # after the last step waits for that step's all-gathers outside any forward.
    phases = [(s, e) for l, n, s, e in spans if l == "compute" and n in PHASES]
    waits = [(n, e - s) for l, n, s, e in spans if l == "compute" and n not in PHASES
             and any(ps <= s and e <= pe for ps, pe in phases)]
    for prefix, label in WAITS.items():
        seconds = sum(d for n, d in waits if n.startswith(prefix)) / steps
        if seconds or prefix not in MUON_PARTS:  # (Muon's only in a Muon run's report)
            out[label] = seconds
    lanes = sorted({l for l, *_ in spans} - {"compute"},
                   key=lambda l: LANE_ORDER.index(l) if l in LANE_ORDER else len(LANE_ORDER))
    for lane in lanes:
        out[f"{lane} busy"] = busy_seconds(spans, lane, start, end) / steps
    return out


def link_idle_gaps(spans, lanes: set[str]) -> tuple[float, float, list[tuple[float, float]]]:
    """Over the trace's window (first to last span of ``lanes``): seconds some lane of
    ``lanes`` was busy, the window's length, and the gaps (start, end) when none was
    (a link's two phases: when it carried nothing at all)."""
    merged: list[list[float]] = []
    for _, _, s, e in sorted((sp for sp in spans if sp[0] in lanes), key=lambda sp: sp[2]):
        if merged and s <= merged[-1][1] + 1e-3:  # a hand-over under 1 ms is not a gap
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    if not merged:
        return 0.0, 0.0, []
    gaps = [(a[1], b[0]) for a, b in zip(merged, merged[1:])]
    return sum(e - s for s, e in merged), merged[-1][1] - merged[0][0], gaps


def span_lines(spans, lanes: Optional[set[str]]) -> list[str]:
    """One line per span of ``lanes`` (all lanes: None), in start order, times in
    seconds after the trace's first span: start, end, duration, lane, name."""
    if not spans:
        return []
    t0 = min(s for _, _, s, _ in spans)
    return [f"{s - t0:8.3f} {e - t0:8.3f} {e - s:7.3f}  {lane:<10} {name}"
            for lane, name, s, e in sorted(spans, key=lambda sp: sp[2])
            if lanes is None or lane in lanes]


def overlap_chart(traces: dict[str, list], path: str, title: str) -> bool:
    """One panel per system: a row per lane, a bar per span (RS blue, AG green)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    traces = {k: from_first_forward(v) for k, v in traces.items() if v}
    if not traces:
        return False
    fig, axes = plt.subplots(len(traces), 1, figsize=(12, 1.0 + 1.6 * len(traces)), squeeze=False)
    colors = {"forward": "tab:orange", "backward": "tab:red", "optimizer step": "tab:purple",
              "RS": "tab:blue", "AG": "tab:green", "spec": "tab:brown", "wait": "lightgray",
              "join": "lightgray", "norm": "black"}
    span_end = max(max(e for *_, e in spans) - min(s for _, _, s, _ in spans)
                   for spans in traces.values())
    for ax, (system, spans) in zip(axes[:, 0], traces.items()):
        spans = from_first_forward(spans)
        t0 = min(s for _, _, s, _ in spans)
        lanes = sorted({l for l, *_ in spans},
                       key=lambda l: LANE_ORDER.index(l) if l in LANE_ORDER else len(LANE_ORDER))
        for row, lane in enumerate(lanes):
            for l, name, s, e in spans:
                if l != lane:
                    continue
                key = next((k for k in colors if name.startswith(k)), None)
                # Waits sit inside forward / step: draw them thinner, on top.
                thin = key in ("wait", "join", "norm")
                ax.broken_barh([(s - t0, max(e - s, 1e-4))],
                               (row - (0.15 if thin else 0.35), 0.3 if thin else 0.7),
                               facecolors=colors.get(key, "tab:gray"), edgecolor="none",
                               zorder=3 if thin else 2)
        ax.set_yticks(range(len(lanes)))
        ax.set_yticklabels(lanes, fontsize=8)
        ax.set_ylim(-0.6, len(lanes) - 0.4)
        ax.set_xlim(0, span_end)
        ax.invert_yaxis()
        ax.set_title(system, fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), loc="upper right", fontsize=7, ncol=len(colors))
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps in each trace (default: its optimizer steps, counted)")
    parser.add_argument("--png")
    parser.add_argument("--link-gaps", metavar="LANES",
                        help="comma-separated lanes of one link (flat-rs,flat-ag): print "
                             "when none of them was busy")
    parser.add_argument("--spans", metavar="LANES",
                        help="comma-separated lanes (or 'all'): list their spans, times in "
                             "seconds after the trace's first span")
    args = parser.parse_args(argv)
    traces = {os.path.basename(p): load_spans(p) for p in args.traces}
    for name, spans in traces.items():
        print(name)
        steps = args.steps if args.steps is not None else traced_steps(spans)
        if args.steps is None:
            print(f"  (per step, over the {steps} optimizer steps it holds)")
        for key, value in breakdown(spans, steps).items():
            print(f"  {key:<34} {value:8.3f} s")
        if args.link_gaps:
            busy, window, gaps = link_idle_gaps(spans, set(args.link_gaps.split(",")))
            print(f"  {args.link_gaps} busy {busy:.3f} s of {window:.3f} s "
                  f"({100 * busy / window if window else 0:.0f}%); idle:")
            for start, end in gaps:
                print(f"    {start:8.3f} -> {end:8.3f}  {end - start:.3f} s")
        if args.spans:
            lanes = None if args.spans == "all" else set(args.spans.split(","))
            print("\n".join(span_lines(spans, lanes)))
    if args.png and overlap_chart(traces, args.png, "fgpsdp timeline"):
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
