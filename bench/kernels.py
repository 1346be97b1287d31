"""Kernel benchmark: fused pack / unpack / float64 norm against the torch path.

    python bench/kernels.py --device cpu       # 2-core CI-class machine
    python bench/kernels.py --device cuda      # one GPU (bench/gpu_check.sh runs it)

Prints a table last and writes JSON (``--json``). Bandwidths count bytes read
plus bytes written; the reference bandwidth is a plain device copy of the same
size (``dst.copy_(src)``), or a plain read (``src.sum()``) for the norm. On CPU
a second table times the reduce-scatter's sum of n ranks' chunks over one
shared-memory round (16 MiB of rows): rank_order_sum's chain of additions, and
``torch.sum(rows, dim=0)``, which the transports used before and whose order is
not fixed (rank_order_sum.py says why).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fgpsdp_runtime import ops  # noqa: E402
from fgpsdp_runtime.rank_order_sum import sum_in_rank_order  # noqa: E402


def timer(device: torch.device, fn, reps: int) -> float:
    """Median seconds per call."""
    fn()
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def make_tensors(sizes, dtype, device):
    return [torch.randn(n, dtype=dtype, device=device) for n in sizes]


def bench_case(name, sizes, device, reps, scale=0.125):
    dtype = torch.float32
    tensors = make_tensors(sizes, dtype, device)
    total = sum(sizes)
    nbytes = total * 4
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    flat = torch.empty(total, dtype=dtype, device=device)
    src_flat = torch.randn(total, dtype=dtype, device=device)
    copy_s = timer(device, lambda: flat.copy_(src_flat), reps)
    read_s = timer(device, lambda: src_flat.sum(), reps)

    pack_s = timer(device, lambda: ops.multi_tensor_pack(tensors, flat, offsets, scale), reps)
    torch_pack_s = timer(device, lambda: torch.mul(torch.cat([t.view(-1) for t in tensors]),
                                                    scale, out=flat), reps)
    views = list(flat.split(sizes))
    unpack_s = timer(device, lambda: ops.multi_tensor_unpack(flat, tensors, offsets, scale), reps)

    def torch_unpack():
        torch._foreach_copy_(tensors, [v.view_as(t) for v, t in zip(views, tensors)])
        torch._foreach_mul_(tensors, scale)
    torch_unpack_s = timer(device, torch_unpack, reps)
    norm_s = timer(device, lambda: ops.multi_tensor_sq_norm(tensors), reps)
    torch_norm_s = timer(device, lambda: torch.linalg.vector_norm(
        torch.stack(torch._foreach_norm(tensors))), reps)

    exact = sum(float(t.double().square().sum()) for t in tensors) ** 0.5
    ours = float(ops.multi_tensor_sq_norm(tensors)[0]) ** 0.5
    torch_fp32 = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors))))
    gbps = lambda b, s: b / s / 1e9  # noqa: E731
    return {
        "case": name, "tensors": len(sizes), "elements": total, "bytes": nbytes,
        "copy_GBps": gbps(2 * nbytes, copy_s), "read_GBps": gbps(nbytes, read_s),
        "pack_GBps": gbps(2 * nbytes, pack_s), "torch_pack_GBps": gbps(2 * nbytes, torch_pack_s),
        "pack_speedup": torch_pack_s / pack_s,
        "unpack_GBps": gbps(2 * nbytes, unpack_s),
        "torch_unpack_GBps": gbps(2 * nbytes, torch_unpack_s),
        "unpack_speedup": torch_unpack_s / unpack_s,
        "norm_GBps": gbps(nbytes, norm_s), "torch_norm_GBps": gbps(nbytes, torch_norm_s),
        "norm_speedup": torch_norm_s / norm_s,
        "norm_rel_err": abs(ours - exact) / exact, "torch_fp32_norm_rel_err": abs(torch_fp32 - exact) / exact,
    }


def bench_rank_order_sum(reps: int) -> list[dict]:
    rows_out = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in (3, 5, 8):
            m = (16 << 20) // (n * torch.tensor([], dtype=dtype).element_size())
            rows = torch.randn(n, m).to(dtype)
            out = torch.empty(m, dtype=dtype)
            times = {
                "rank_order": timer(torch.device("cpu"),
                                    lambda: sum_in_rank_order(rows, out), reps),
                "torch.sum": timer(torch.device("cpu"),
                                   lambda: torch.sum(rows, dim=0, out=out), reps)}
            rows_out.append({"dtype": str(dtype).replace("torch.", ""), "ranks": n,
                             "elements": m, **{f"{k}_ms": v * 1e3 for k, v in times.items()}})
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=0, help="0: 20 on GPU, 5 on CPU")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    reps = args.reps or (20 if device.type == "cuda" else 5)
    torch.manual_seed(0)
    if device.type == "cuda":
        cases = [("1 x 256 MiB", [64 << 20]), ("4 x 256 MiB (1 GiB)", [64 << 20] * 4),
                 ("128 small (4K-96K elems)", [4096 * (1 + i % 24) for i in range(128)])]
    else:
        cases = [("1 x 64 MiB", [16 << 20]), ("4 x 16 MiB", [4 << 20] * 4),
                 ("128 small (4K-96K elems)", [4096 * (1 + i % 24) for i in range(128)])]
    rows = [bench_case(name, sizes, device, reps) for name, sizes in cases]
    sums = bench_rank_order_sum(reps) if device.type == "cpu" else []
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"{platform.processor() or 'cpu'}, {torch.get_num_threads()} threads",
            "torch": torch.__version__, "compiled_kernels": ops.cuda_kernels_available()
            if device.type == "cuda" else ops.extension_available()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows, "rank_order_sum": sums}, f, indent=1)
    print(f"device: {meta['device']}; torch {meta['torch']}; compiled kernels: {meta['compiled_kernels']}")
    print("| case | copy GB/s | pack GB/s (% copy, x torch) | unpack GB/s (% copy, x torch) | "
          "norm GB/s (% read, x torch) | norm rel err (torch fp32) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['copy_GBps']:.1f} | {r['pack_GBps']:.1f} "
              f"({100 * r['pack_GBps'] / r['copy_GBps']:.0f}%, {r['pack_speedup']:.2f}x) | "
              f"{r['unpack_GBps']:.1f} ({100 * r['unpack_GBps'] / r['copy_GBps']:.0f}%, "
              f"{r['unpack_speedup']:.2f}x) | {r['norm_GBps']:.1f} "
              f"({100 * r['norm_GBps'] / r['read_GBps']:.0f}%, {r['norm_speedup']:.2f}x) | "
              f"{r['norm_rel_err']:.1e} ({r['torch_fp32_norm_rel_err']:.1e}) |")
    if sums:
        print()
        print("| reduce-scatter sum: dtype, ranks x elements | rank order ms | "
              "torch.sum ms (order not fixed) |")
        print("|---|---:|---:|")
        for r in sums:
            print(f"| {r['dtype']}, {r['ranks']} x {r['elements']} | {r['rank_order_ms']:.2f} | "
                  f"{r['torch.sum_ms']:.2f} |")


if __name__ == "__main__":
    main()
