# The two commands of the README, and the benchmark entry points.
# Both create or reuse .venv in the repository root with torch (its CPU build where
# pip's index serves that, as in CI; see TORCH_PIP_ARGS).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# e.g. --index-url https://download.pytorch.org/whl/cpu where plain PyPI would give the CUDA build
TORCH_PIP_ARGS ?=
STAMP := $(VENV)/.fgpsdp-installed
# pytest processes running test files side by side (pytest-xdist): every test starts
# its own ranks, which leave a core idle about 40% of the time on CI's two cores.
# TEST_JOBS=0 runs them one after another in pytest's own process.
TEST_JOBS ?= 2

BENCH_STAMP := $(VENV)/.fgpsdp-bench-installed
# make bench BENCH_ARGS="--workloads gpt2,vgg16 --systems ddp,fgpsdp --rate 1gbit"
BENCH_ARGS ?=

NVCC ?= nvcc
CUDA_ARCH ?= sm_90

# The test and build tools, pinned to the versions the suite last passed with in CI, so
# that a release of one of them cannot turn a fresh clone's CI red overnight (a new
# .venv gets them; `make clean setup` renews an older one).
PIP := pip==26.3
PYTEST_XDIST := pytest-xdist==3.8.0
TOOLS := numpy==2.4.6 pytest==9.2.0 $(PYTEST_XDIST) hypothesis==6.170.27 ninja==1.13.2 \
	setuptools==84.2.1 wheel==0.48.0

LIGHTNING_VERSION ?= 2.6.6
ACCELERATE_VERSION ?= 1.16.0

.PHONY: demo test setup bench bench-setup cuda-check cuda-build-check lightning-check accelerate-check framework-checks clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) setup.py $(wildcard csrc/*.cpp csrc/*/*.cpp csrc/*/*.cu csrc/include/*/*.h)
	$(PY) -m pip install --quiet $(PIP)
	$(PY) -m pip install --quiet $(TORCH_PIP_ARGS) torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet $(TOOLS)
	FGPSDP_SKIP_CUDA=1 $(PY) -m pip install --quiet --no-build-isolation -e .
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -W ignore::FutureWarning examples/demo.py --world-size 4 --steps 30

test: $(STAMP)
	@$(PY) -c "import xdist" 2>/dev/null || $(PY) -m pip install --quiet $(PYTEST_XDIST)
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --durations=15 tests

# PyTorch Lightning's Trainer, and a Fabric loop, running fgpsdp against Lightning's
# torch DDP (examples/lightning_compare.py, fabric_compare.py): fails if they differ
# by more than rounding.
lightning-check: $(STAMP)
	$(PY) -m pip install --quiet lightning==$(LIGHTNING_VERSION)
	OMP_NUM_THREADS=1 $(PY) examples/lightning_compare.py --check
	OMP_NUM_THREADS=1 $(PY) examples/fabric_compare.py --check

# A plain Hugging Face Accelerate loop with fgpsdp against accelerate's torch DDP
# (examples/accelerate_compare.py): fails if they differ by more than rounding.
accelerate-check: $(STAMP)
	$(PY) -m pip install --quiet accelerate==$(ACCELERATE_VERSION)
	OMP_NUM_THREADS=1 $(PY) examples/accelerate_compare.py --check

# Both checks above at once, CI's way: their three comparisons run side by side
# (.ci/side_by_side.py), each one's output printed whole when it ends.
framework-checks: $(STAMP)
	$(PY) -m pip install --quiet lightning==$(LIGHTNING_VERSION) accelerate==$(ACCELERATE_VERSION)
	OMP_NUM_THREADS=1 $(PY) .ci/side_by_side.py "$(PY) examples/lightning_compare.py --check" \
		"$(PY) examples/fabric_compare.py --check" "$(PY) examples/accelerate_compare.py --check"

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet deepspeed matplotlib
	touch $(BENCH_STAMP)

bench-setup: $(BENCH_STAMP)

# Needs root (network namespaces, tc): see bench/cluster.sh.
bench: $(BENCH_STAMP)
	$(PY) bench/emulated.py $(BENCH_ARGS)

# Compile-check every kernel .cu with plain nvcc (no torch, no GPU needed).
cuda-check:
	@command -v $(NVCC) >/dev/null || { echo "cuda-check: $(NVCC) not found"; exit 1; }
	@mkdir -p build/cuda-check
	@for f in csrc/cuda/*.cu; do \
	  echo "nvcc -arch=$(CUDA_ARCH) $$f"; \
	  $(NVCC) -std=c++17 -arch=$(CUDA_ARCH) -lineinfo -Icsrc/include -c $$f \
	    -o build/cuda-check/$$(basename $$f).o || exit 1; \
	done

# The whole CUDAExtension (launchers, bindings, kernels) against the CUDA-13 torch
# wheel, on a machine with nvcc and no GPU: ~6 GB venv, ~9 min on 2 cores.
CUDA_TORCH_VERSION ?= 2.14.1
CUDA_VENV ?= build/cuda-venv
cuda-build-check:
	bash bench/cuda_build_check.sh $(CUDA_VENV) $(CUDA_TORCH_VERSION)

# The install stamp too: kept, it let demo and test run without the extension.
clean:
	rm -rf build *.egg-info fgpsdp_runtime/_C*.so $(STAMP)
