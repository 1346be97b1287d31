#!/usr/bin/env bash
# Nsight Systems timeline of the single-GPU profile (NVTX ranges: forward,
# each bucket's communication, optimizer step). Without nsys, falls back to
# torch.profiler's Chrome trace.
#   bench/nsys.sh [OUT_DIR] [-- extra args for bench/gpu_profile.py]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-out}"; shift || true
[ "${1:-}" = "--" ] && shift
mkdir -p "$OUT"
if command -v nsys >/dev/null; then
  nsys profile -t cuda,nvtx,osrt -o "$OUT/fgpsdp-profile" --force-overwrite true \
    python bench/gpu_profile.py --out "$OUT/profiles.json" "$@"
else
  echo "nsys not found: writing a torch.profiler Chrome trace instead"
  python - "$OUT" "$@" <<'PY'
import sys, runpy, torch
out = sys.argv[1]
sys.argv = ["bench/gpu_profile.py", "--out", f"{out}/profiles.json"] + sys.argv[2:]
acts = [torch.profiler.ProfilerActivity.CPU] + (
    [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
with torch.profiler.profile(activities=acts) as prof:
    runpy.run_path("bench/gpu_profile.py", run_name="__main__")
prof.export_chrome_trace(f"{out}/fgpsdp-trace.json")
print(f"wrote {out}/fgpsdp-trace.json")
PY
fi
