#!/usr/bin/env bash
# One command for a machine with one GPU: build the extension against the local
# (CUDA) torch, run the GPU tests (kernels with their CUDA cases, stream safety on
# an NCCL group of one), benchmark the kernels, train the full-size workloads on
# one rank against torch DDP (bench/gpu_single_rank.py) and profile them
# (bench/gpu_profile.py), in that order of importance. Each stage has its own time
# limit (about 8 minutes if all run out; about 5 expected on an H200) and a failed
# stage does not stop the next; the exit status says whether any failed.
#   bench/gpu_check.sh [OUT_DIR]     (default $OUT, else ./out)
# Writes OUT_DIR/{build.log,tests.txt,kernels.json,kernels.txt,single_rank.json,
# single_rank.txt,profiles.json,summary.txt} (the profile's table goes into the
# summary); the summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-out}}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
failed=()
stage() {  # stage NAME LIMIT_S LOG -- command...: run it, tee to LOG, note a failure
  local name="$1" limit="$2" log="$3"; shift 4
  local t0=$SECONDS
  echo "== $name"
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "$name: rc $rc, $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  [ "$rc" = 0 ] || failed+=("$name")
}
rm -f "$OUT"/*.txt "$OUT"/*.log
: > "$OUT/summary.txt"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no GPU visible'; print('GPU:', torch.cuda.get_device_name(0), '| torch', torch.__version__, '| CUDA', torch.version.cuda)" \
  | tee -a "$OUT/summary.txt" || exit 1
nproc | sed 's/^/cores: /' | tee -a "$OUT/summary.txt"
# torch guesses CUDA_HOME as the folder above nvcc, which misses headers where nvcc
# is a wrapper; pip-installed CUDA headers (nvidia/cu13) go on the include path.
if [ -z "${CUDA_HOME:-}" ]; then
  if [ -d /usr/local/cuda/include ]; then export CUDA_HOME=/usr/local/cuda
  elif command -v nvcc > /dev/null; then
    CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"; export CUDA_HOME
  fi
fi
SITE="$("$PY" -c 'import site; print(site.getsitepackages()[0])')"
for inc in "$SITE"/nvidia/cu13/include "$SITE"/nvidia/cuda_runtime/include; do
  [ -d "$inc" ] && export CPLUS_INCLUDE_PATH="$inc${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
done
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$("$PY" -c 'import torch; m,n=torch.cuda.get_device_capability(); print(f"{m}.{n}")')}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
echo "CUDA_HOME=${CUDA_HOME:-?} nvcc: $(nvcc --version 2>/dev/null | tail -1)" | tee -a "$OUT/summary.txt"
# In place, not `pip install -e .`: pip's editable install of a setup.py project
# now fetches setuptools into an isolated build environment, and a GPU machine
# may have no network. The tests and benchmarks import the package from here.
stage build 240 "$OUT/build.log" -- "$PY" setup.py build_ext --inplace
"$PY" -c "import fgpsdp_runtime.ops as o; assert o.cuda_kernels_available(), 'CUDA kernels not built'; print('CUDA kernels built')" \
  2>&1 | tee -a "$OUT/summary.txt" || failed+=("kernels-loaded")
# The toolchain the extension was built with and the one torch was, and whether an
# argument check's C++ exception reaches Python (on 2026-12-04 an H200 machine's
# build, with its /opt/gcc, crashed there: docs/benchmarks/2026-12-04-gpu-h200.md).
{
  echo "python's CXX: $("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("CXX"))')"
  echo "g++: $(g++ --version | head -1); torch built with: $("$PY" -c 'import torch; print(torch.__config__.show().splitlines()[1:3])')"
  echo "CXX=${CXX:-unset} CC=${CC:-unset}; the compiler's shared libstdc++: $("${CXX:-g++}" -print-file-name=libstdc++.so)"
  # No libstdc++ line: the compiler linked it statically (setup.py keeps that copy's
  # symbols local, see HIDE_STATIC_LIBS there).
  ldd fgpsdp_runtime/_C*.so | grep -E "stdc|gcc_s|gomp|c10\.so" || true
  probe="
import torch, fgpsdp_runtime._C as C
try:
    C.multi_tensor_sq_norm([torch.randn(4, 6).t()])
    print('exception probe: no exception raised')
except RuntimeError as e:
    print('exception probe: RuntimeError reached Python:', str(e).splitlines()[0])"
  "$PY" -X faulthandler -c "$probe" > "$OUT/probe.tmp" 2>&1
  status=$?
  echo "exception probe: exit status $status"; tail -4 "$OUT/probe.tmp"; rm -f "$OUT/probe.tmp"
  if [ "$status" != 0 ] && command -v cuda-gdb > /dev/null; then  # the image has no gdb
    echo "native stack of the crash:"
    timeout 150 cuda-gdb -q -batch -ex run -ex bt --args "$PY" -c "$probe" 2>&1 | grep -E "^#|signal" | head -30
  fi
} 2>&1 | tee -a "$OUT/summary.txt"
# One pytest per file: a crash in one must not hide the others. test_import and
# test_bad_input fork ranks from a process that sees a GPU.
# GPU_CHECK_TESTS (one pytest per ';'-separated entry) and GPU_CHECK_QUICK=1 (no
# benchmarks) shorten a rerun that checks a fix within the session's device time.
IFS=';' read -r -a test_runs <<< "${GPU_CHECK_TESTS:-tests/test_ops.py;tests/test_cuda_streams.py;tests/test_import.py tests/test_bad_input.py tests/test_elementwise_probe.py}"
for tests in "${test_runs[@]}"; do
  # shellcheck disable=SC2086
  stage "tests ${tests//tests\//}" 150 "$OUT/tests.txt" -- "$PY" -m pytest -q -rs --durations=5 $tests
done
if [ "${GPU_CHECK_QUICK:-0}" != 1 ]; then
stage single_rank 300 "$OUT/single_rank.txt" -- "$PY" bench/gpu_single_rank.py --out "$OUT/single_rank.json"
stage kernels 90 "$OUT/kernels.txt" -- "$PY" bench/kernels.py --device cuda --json "$OUT/kernels.json"
stage profile 120 "$OUT/profile.txt" -- "$PY" bench/gpu_profile.py --out "$OUT/profiles.json"
cat "$OUT/profile.txt" >> "$OUT/summary.txt" && rm -f "$OUT/profile.txt"  # at most 8 files come back
fi
{
  echo "== summary"
  grep -E "^(=+ )?[0-9]+ (passed|failed|skipped)|Fatal Python error" "$OUT/tests.txt" 2>/dev/null
  grep -E "^[a-z0-9]+ +(ddp|fgpsdp)" "$OUT/single_rank.txt" 2>/dev/null
  [ ${#failed[@]} = 0 ] && echo "all stages passed" || echo "FAILED: ${failed[*]}"
} | tee -a "$OUT/summary.txt"
[ ${#failed[@]} = 0 ]
