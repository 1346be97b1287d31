"""Single-rank profile of the full-size workloads (GPU; also runs on CPU, small).

    python bench/gpu_profile.py --workloads gpt2,vgg16 --size full --out out/profiles.json

Per workload: step time, peak memory, and per bucket its bytes and the forward
and backward compute time attributed to it (forward: from the previous
bucket's last module to this bucket's last module, in forward order;
backward: from the previous bucket becoming ready to this one). The profiles
are the input of the overlap planner. NVTX ranges mark forward, each
bucket's communication and the optimizer step (see bench/nsys.sh).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from workloads import CONFIGS, WORKLOADS, build_model, describe, loss_fn, make_batch  # noqa: E402

import fgpsdp_runtime as fgp  # noqa: E402
from fgpsdp_runtime.profiling import Marks, nvtx_range  # noqa: E402


def profile(workload: str, size: str, steps: int, device: torch.device) -> dict:
    cfg = CONFIGS[(workload, size)]
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(build_model(cfg).to(device), bucket_cap_mb=25.0,
                                        schedule="overlap_backward")
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-4, max_grad_norm=1.0)
    lf = loss_fn(cfg)
    marks = Marks(device)
    # Forward: the last module of each bucket to run marks that bucket's forward end.
    bucket_of_module = {}
    for b, layout in enumerate(model.bucket_layouts):
        params = {id(model.named_trainable_parameters()[s.param_index][1]) for s in layout.spans}
        for m in model.module.modules():
            if any(id(p) in params for p in m.parameters(recurse=False)):
                bucket_of_module[id(m)] = b
    for m in model.module.modules():
        if id(m) in bucket_of_module:
            m.register_forward_hook(lambda mod, i, o: marks.mark(f"fwd{bucket_of_module[id(mod)]}"))
    model.reducer.bucket_ready_listeners.append(lambda b: marks.mark(f"bwd{b}"))

    step_times, per_bucket = [], None
    for step in range(steps + 2):
        x, y = make_batch(cfg, step, 0, device)
        marks.clear()
        marks.mark("start")
        with nvtx_range(f"step{step}"):
            loss = lf(model(x), y)
            marks.mark("forward_end")
            loss.backward()
            marks.mark("backward_end")
            opt.step()
            opt.zero_grad()
            marks.mark("step_end")
        resolved = marks.resolve()
        if step < 2:
            continue  # warm-up
        t = dict((n, v) for n, v in resolved)  # last mark of each name
        step_times.append(t["step_end"])
        rows = []
        prev_fwd = 0.0
        fwd_order = sorted((v, int(n[3:])) for n, v in t.items() if n.startswith("fwd"))
        fwd_time = {}
        for v, b in fwd_order:
            fwd_time[b] = v - prev_fwd
            prev_fwd = v
        prev_bwd = t["forward_end"]
        bwd_time = {}
        for v, b in sorted((v, int(n[3:])) for n, v in t.items() if n.startswith("bwd")):
            bwd_time[b] = v - prev_bwd
            prev_bwd = v
        for b, layout in enumerate(model.bucket_layouts):
            rows.append({"bucket": b, "bytes": layout.padded_numel * layout.element_size,
                         "params": len(layout.spans),
                         "forward_s": fwd_time.get(b, 0.0), "backward_s": bwd_time.get(b, 0.0)})
        if per_bucket is None:
            per_bucket = [dict(r, forward_s=[r["forward_s"]], backward_s=[r["backward_s"]]) for r in rows]
        else:
            for acc, r in zip(per_bucket, rows):
                acc["forward_s"].append(r["forward_s"])
                acc["backward_s"].append(r["backward_s"])
    for acc in per_bucket or []:
        acc["forward_s"] = sorted(acc["forward_s"])[len(acc["forward_s"]) // 2]
        acc["backward_s"] = sorted(acc["backward_s"])[len(acc["backward_s"]) // 2]
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"workload": describe(cfg, model.module), "step_s": sorted(step_times)[len(step_times) // 2],
            "peak_memory_bytes": peak, "buckets": per_bucket}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--size", default="full", choices=["cpu", "full"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="out/profiles.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:  # "cuda": set_device needs an index (torch 2.11)
            device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            timeout=timedelta(seconds=300))
    stamp = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
             else platform.processor() or "cpu", "torch": torch.__version__,
             "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d")}
    results = {}
    for w in args.workloads.split(","):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        results[w] = profile(w, args.size, args.steps, device)
        r = results[w]
        print(f"{w:<9} {r['workload']['parameters'] / 1e6:7.1f} M params  step {r['step_s'] * 1e3:8.1f} ms  "
              f"peak {(r['peak_memory_bytes'] or 0) / 2**30:6.2f} GiB  buckets {len(r['buckets'])}",
              flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"hardware": stamp, "profiles": results}, f, indent=1)
    print(f"wrote {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
