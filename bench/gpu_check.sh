#!/usr/bin/env bash
# One command for a machine with one GPU: build the extension against the local
# (CUDA) torch, run the kernel tests (CUDA cases included) and the stream-safety
# tests (one GPU, NCCL world of 1), benchmark the kernels.
#   bench/gpu_check.sh [OUT_DIR]       (results: OUT_DIR/kernels.json, default ./out)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-out}}"
mkdir -p "$OUT"
python -c "import torch; assert torch.cuda.is_available(), 'no GPU visible'; print('GPU:', torch.cuda.get_device_name(0), 'torch', torch.__version__)"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$(python -c 'import torch; m,n=torch.cuda.get_device_capability(); print(f"{m}.{n}")')}"
pip install --no-build-isolation -e . 2>&1 | tail -2
python -c "import fgpsdp_runtime.ops as o; assert o.cuda_kernels_available(), 'CUDA kernels not built'"
python -m pytest -q tests/test_ops.py tests/test_cuda_streams.py 2>&1 | tee "$OUT/test_ops.txt" | tail -3
python bench/kernels.py --device cuda --json "$OUT/kernels.json" | tee "$OUT/kernels.txt"
