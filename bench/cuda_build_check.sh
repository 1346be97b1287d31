#!/usr/bin/env bash
# Build the full CUDA extension (kernels, launchers, bindings) against a CUDA
# torch wheel on a machine with nvcc and no GPU, in a copy of the committed
# tree, and check that the CUDA kernels are in it.
#   bench/cuda_build_check.sh [VENV_DIR] [TORCH_VERSION]
# CUDA_HOME: the toolkit root (default /usr/local/cuda, else the folder above
# nvcc's real binary; torch's own guess misses headers when nvcc is a wrapper).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
VENV="${1:-build/cuda-venv}"
TORCH_VERSION="${2:-2.14.1}"
if [ -z "${CUDA_HOME:-}" ]; then
  if [ -d /usr/local/cuda/include ]; then CUDA_HOME=/usr/local/cuda
  else CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"; fi
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
VENV="$(cd "$VENV" && pwd)"
"$VENV/bin/pip" install --quiet "torch==$TORCH_VERSION" numpy setuptools wheel ninja pytest
SITE="$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
git -C "$ROOT" archive HEAD | tar -x -C "$WORK"
cd "$WORK"
echo "CUDA_HOME=$CUDA_HOME torch==$TORCH_VERSION"
start=$(date +%s)
PATH="$VENV/bin:$PATH" CUDA_HOME="$CUDA_HOME" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" \
  MAX_JOBS="${MAX_JOBS:-2}" CPLUS_INCLUDE_PATH="$SITE/nvidia/cu13/include" \
  "$VENV/bin/python" setup.py build_ext --inplace > build.log 2>&1 || { tail -40 build.log; exit 1; }
echo "built in $(( $(date +%s) - start )) s; warnings: $(grep -c 'warning' build.log || true)"
"$VENV/bin/python" -c "
import fgpsdp_runtime._C as C
assert C.has_cuda_kernels(), 'the CUDA kernels were not compiled in'
print('extension loads; CUDA kernels compiled in')"
"$VENV/bin/python" -m pytest -q tests/test_ops.py 2>&1 | tail -1
