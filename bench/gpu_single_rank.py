"""One GPU, an NCCL group of one rank: fgpsdp against torch DDP on the full-size workloads.

    python bench/gpu_single_rank.py --workloads gpt2,vgg16 --out out/single_rank.json

With one rank nothing crosses a link, so this measures what the runtime itself
adds on a real GPU, against torch DDP + torch.optim.AdamW doing the same:

- parity: ``--parity-steps`` steps from the same weights and batches with
  deterministic kernels (``torch.use_deterministic_algorithms``, attention on
  the math backend: the fused ones' backwards are not deterministic), with
  clipping by norm (1.0) and without. Per system: the largest parameter
  difference from torch DDP after the steps, and the largest loss difference
  over the steps. A second torch DDP run is the control: it shows what
  determinism leaves.
- speed and memory: with the default (fast) kernels and clipping, the mean step
  time over ``--timed-steps`` steps after ``--warmup-steps`` (the GPU
  synchronised before and after the timed steps, not between them, so work a
  schedule leaves for the next forward counts where it runs), and the peak
  memory allocated from an empty GPU through construction and every step.
  ``--rounds`` rounds, the systems in turn and the order reversed each round;
  the median time and the largest peak are reported. cuDNN's autotuner runs
  once on a throwaway copy first: its trial workspaces would otherwise count in
  the first system's peak. Recorded with them: the plan an fgpsdp system's
  timed steps ran, and (CUDA) how often one step made the host wait for the
  GPU through a torch op (sync debug mode): each wait drains the GPU's queue, and
  a model of many small kernels (ResNet-50) then waits for the host's launches;
  and (CUDA) the GPU's kernel time against the wall time over two more steps
  (torch's profiler). ``--schedules`` includes ``next_forward`` by default:
  ``two_stage`` without its stage 1, so a cost of ``two_stage``'s shows whether it
  comes from the speculative stage or from the forward's waits.

Meant for a GPU (its kernels and streams are the point); ``--device cpu`` runs
the same on a gloo group of one (no memory figures) to check the script itself.
Prints one row per workload and system and writes everything to ``--out``.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
import warnings
from contextlib import nullcontext
from datetime import timedelta

# cuBLAS reads this once, when CUDA starts: deterministic GEMM needs it set before.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from workloads import CONFIGS, WORKLOADS, build_model, describe, loss_fn, make_batch  # noqa: E402

import fgpsdp_runtime as fgp  # noqa: E402

LR = 1e-4
MAX_NORM = 1.0


DEVICE = torch.device("cpu")  # main() sets it


class Run:
    """One system training one model copy: ``step(x, y)`` returns the loss."""

    def __init__(self, system: str, model: torch.nn.Module, clip: bool, lf):
        self.clip, self.lf = clip, lf
        self.torch_ddp = system.startswith("ddp")  # "ddp", "ddp_again": the control
        if self.torch_ddp:
            self.model = TorchDDP(model, device_ids=[0] if DEVICE.type == "cuda" else None)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        else:
            schedule = system.split(":", 1)[1]
            self.model = fgp.DistributedDataParallel(model, schedule=schedule)
            self.opt = fgp.ShardedOptimizer(self.model, torch.optim.AdamW, lr=LR,
                                            max_grad_norm=MAX_NORM if clip else None)

    def step(self, x, y) -> torch.Tensor:
        loss = self.lf(self.model(x), y)
        loss.backward()
        if self.clip and self.torch_ddp:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_NORM)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def params(self) -> list[torch.Tensor]:
        if not self.torch_ddp:
            self.model.synchronize()
        return [p.detach().clone() for p in self.model.module.parameters()]


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _free() -> None:
    gc.collect()
    _sync()
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()


def _math_attention():
    """Attention on the math backend: deterministic, unlike the fused backwards."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # older torch: its default picks a fused kernel anyway
        return nullcontext()
    return sdpa_kernel([SDPBackend.MATH])


def parity(cfg, template, systems, clip: bool, steps: int, batches) -> dict:
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    out, reference = {}, None
    for system in systems:
        model = copy.deepcopy(template).to(DEVICE)
        run = Run(system, model, clip, loss_fn(cfg))
        with _math_attention():
            losses = [run.step(x, y) for x, y in batches[:steps]]
            params = run.params()
        losses = torch.stack(losses).double().cpu()
        if reference is None:
            reference = (params, losses)
            out[system] = {"param_max_abs_diff": 0.0, "loss_max_abs_diff": 0.0, "reference": True}
        else:
            diff = max((a.double() - b.double()).abs().max().item()
                       for a, b in zip(params, reference[0]))
            out[system] = {"param_max_abs_diff": diff,
                           "loss_max_abs_diff": (losses - reference[1]).abs().max().item(),
                           "bitwise": all(torch.equal(a, b) for a, b in zip(params, reference[0]))}
        del run, model, params
        _free()
    return out


def autotune(cfg, template, batches) -> None:
    """One forward and backward per batch on a throwaway copy with cuDNN's autotuner on."""
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = True
    model = copy.deepcopy(template).to(DEVICE)
    for x, y in batches:
        loss_fn(cfg)(model(x), y).backward()
    del model
    _free()


def speed_and_memory(cfg, template, system: str, warmup: int, timed: int, batches) -> dict:
    _free()
    cuda = DEVICE.type == "cuda"
    if cuda:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    model = copy.deepcopy(template).to(DEVICE)
    run = Run(system, model, True, loss_fn(cfg))
    for i in range(warmup):
        run.step(*batches[i % len(batches)])
    _sync()
    t0 = time.perf_counter()
    for i in range(timed):
        run.step(*batches[(warmup + i) % len(batches)])
    _sync()
    step_s = (time.perf_counter() - t0) / timed
    peak = torch.cuda.max_memory_allocated() - base if cuda else None
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out = {"step_s": step_s, "peak_bytes": peak, "param_bytes": param_bytes}
    if not run.torch_ddp:  # what the timed steps ran: the profile's plan
        out["plan"] = str(run.model.plan)
    if cuda:
        out["host_syncs_per_step"] = _host_syncs(run, batches[0])
        out["gpu_busy"] = _gpu_busy(run, batches[:2])
    del run, model
    _free()
    return out


def _host_syncs(run, batch) -> int:
    """How many times one more step makes the host wait for the GPU through a torch
    op (``.item()``, a copy to the CPU; torch's sync debug mode warns at each; a
    stream or event synchronisation is not counted). Each such wait drains the GPU's
    queue and exposes the host's launch time after it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run.step(*batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    _sync()
    return sum("synchronizing" in str(w.message) for w in caught)


def _busy_text(busy: dict) -> str:
    if "error" in busy:
        return f"profiler: {busy['error'][:60]}"
    return f"GPU busy {busy['busy_s'] * 1e3:.1f} of {busy['wall_s'] * 1e3:.1f} ms (profiled)"


def _gpu_busy(run, batches) -> dict:
    """Wall time and the GPU's busy time (kernels and copies, on any stream) over
    ``len(batches)`` more steps, from torch's profiler (whose own cost is in the
    wall time): busy time well under the wall time means the GPU waited, for the
    host's launches or for a wait the host put in its queue. Never raises: a
    profiler that cannot run leaves its error here instead."""
    try:
        from torch.profiler import ProfilerActivity, profile
        _sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for x, y in batches:
                run.step(x, y)
            _sync()
            wall = time.perf_counter() - t0
        # The union of the device's activity intervals (kernels, copies, on any
        # stream): overlapping streams count once.
        device = torch.autograd.DeviceType.CUDA
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == device)
        busy_us, end = 0.0, float("-inf")
        for start, stop in spans:
            if stop > end:
                busy_us += stop - max(start, end)
                end = stop
        return {"wall_s": wall / len(batches), "busy_s": busy_us * 1e-6 / len(batches)}
    except Exception as error:  # noqa: BLE001 - a diagnostic, not the measurement
        return {"error": repr(error)[:300]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--size", default="full", choices=["cpu", "full"])
    # next_forward is two_stage without stage 1 (no speculation): it tells which of
    # the two a cost of two_stage's comes from.
    parser.add_argument("--schedules", default="serial,next_forward,two_stage",
                        help="fgpsdp schedules to run against torch DDP")
    parser.add_argument("--parity-steps", type=int, default=4)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--timed-steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="out/single_rank.json")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29578")
    if DEVICE.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("no GPU visible (--device cpu checks the script on CPU)")
        torch.cuda.set_device(DEVICE)
        dist.init_process_group("nccl", rank=0, world_size=1, timeout=timedelta(seconds=300),
                                device_id=DEVICE)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=300))
    fgp_systems = [f"fgpsdp:{s}" for s in args.schedules.split(",")]
    stamp = {"device": torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "cpu",
             "torch": torch.__version__, "cuda": torch.version.cuda,
             "date": time.strftime("%Y-%m-%d"),
             "kernels_built": fgp.ops.cuda_kernels_available()}
    print(f"# {stamp}", flush=True)
    results = {}
    for w in args.workloads.split(","):
        cfg = CONFIGS[(w, args.size)]
        torch.manual_seed(0)
        template = build_model(cfg)  # stays on the CPU: each run moves a copy
        info = describe(cfg, template)
        # Four batches, cycled: building them is CPU work the timed steps should not hold.
        batches = [tuple(t.to(DEVICE) for t in make_batch(cfg, s, 0)) for s in range(4)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            row = {"workload": info,
                   "parity_clip": parity(cfg, template, ["ddp", "ddp_again"] + fgp_systems,
                                         True, args.parity_steps, batches),
                   "parity_no_clip": parity(cfg, template, ["ddp"] + fgp_systems,
                                            False, args.parity_steps, batches)}
        row["nondeterministic_ops"] = sorted({str(c.message)[:160] for c in caught
                                              if "deterministic" in str(c.message)})
        autotune(cfg, template, batches)
        systems = ["ddp"] + fgp_systems
        rounds = {s: [] for s in systems}
        for r in range(args.rounds):
            for s in systems if r % 2 == 0 else systems[::-1]:
                rounds[s].append(speed_and_memory(cfg, template, s, args.warmup_steps,
                                                  args.timed_steps, batches))
        row["speed_memory"] = {
            s: {"step_s": statistics.median(m["step_s"] for m in runs),
                "step_s_rounds": [m["step_s"] for m in runs],
                "peak_bytes": None if runs[0]["peak_bytes"] is None
                else max(m["peak_bytes"] for m in runs),
                "param_bytes": runs[0]["param_bytes"],
                **{k: [m[k] for m in runs] for k in ("plan", "host_syncs_per_step", "gpu_busy")
                   if k in runs[0]}}
            for s, runs in rounds.items()}
        results[w] = row
        ddp = row["speed_memory"]["ddp"]
        for s in ["ddp"] + fgp_systems:
            sm = row["speed_memory"][s]
            pc, pn = row["parity_clip"].get(s, {}), row["parity_no_clip"].get(s, {})
            peak = (f"{sm['peak_bytes'] / 2**30:6.2f} GiB ({sm['peak_bytes'] / ddp['peak_bytes']:5.2f}x)"
                    if sm["peak_bytes"] is not None else "-")
            print(f"{w:<9} {s:<18} step {sm['step_s'] * 1e3:8.1f} ms ({sm['step_s'] / ddp['step_s']:5.2f}x)"
                  f"  peak {peak}"
                  f"  param diff clip {pc.get('param_max_abs_diff', 0):.1e}"
                  f" no-clip {pn.get('param_max_abs_diff', 0):.1e}"
                  f"  ddp-vs-ddp {row['parity_clip']['ddp_again']['param_max_abs_diff']:.1e}"
                  + (f"  syncs {sm['host_syncs_per_step'][0]}" if "host_syncs_per_step" in sm else "")
                  + (f"  {_busy_text(sm['gpu_busy'][0])}" if "gpu_busy" in sm else "")
                  + (f"  {sm['plan'][0]}" if "plan" in sm else ""),
                  flush=True)
        del batches, template
        _free()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"hardware": stamp, "results": results}, f, indent=1)
    print(f"wrote {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
