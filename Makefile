# The two commands of the README, and the benchmark entry points.
# Both create or reuse .venv in the repository root with the CPU build of torch.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.fgpsdp-installed

.PHONY: demo test setup clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) setup.py $(wildcard csrc/*.cpp csrc/*/*.cpp csrc/*/*.cu csrc/include/*/*.h)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION) numpy pytest hypothesis ninja setuptools wheel
	FGPSDP_SKIP_CUDA=1 $(PY) -m pip install --quiet --no-build-isolation -e .
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -W ignore::FutureWarning examples/demo.py --world-size 4 --steps 30

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf build *.egg-info fgpsdp_runtime/_C*.so
