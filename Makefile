# One entry point for a fresh machine with only Python: `make test`, `make bench`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The tool scripts (tools/*.sh) call `python`: make it the venv's.
export PATH := $(abspath $(VENV))/bin:$(PATH)
PIP := $(PY) -m pip --disable-pip-version-check -q
# A bare `torch` resolves to a multi-GB CUDA build; 2.13.0 is the CPU wheel on these machines.
TORCH ?= torch==2.13.0
DEPS := numpy triton pytest hypothesis coverage pytest-benchmark matplotlib
BUILD_DEPS := setuptools wheel pybind11 cmake ninja
SOURCES := pyproject.toml setup.py CMakeLists.txt $(shell find csrc -type f 2>/dev/null)

.PHONY: setup build test bench test-gpu-emulated test-gpu clean

setup: $(VENV)/.deps build

$(VENV)/.deps:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install $(TORCH) $(DEPS) $(BUILD_DEPS)
	touch $@

# Editable install: builds the compiled backends into lze_kernels/ (CMake via setup.py).
build: $(VENV)/.built
$(VENV)/.built: $(VENV)/.deps $(SOURCES)
	$(PIP) install --no-build-isolation -e .
	touch $@

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(PY) -m pytest -q benchmarks --benchmark-json=benchmarks/results/benchmarks.json
	$(PY) benchmarks/report.py benchmarks/results/benchmarks.json

# Only the GPU-emulation checks: CUDA kernels on CPU threads, ThreadSanitizer, the ahead-of-time
# Triton compiles and the kernel-line coverage reports.
test-gpu-emulated: setup
	$(PY) -m pytest -q tests -k "cuda_emulated or aot or cuda_sources"
	bash tools/emu_tsan.sh
	bash tools/emu_gcov.sh
	bash tools/triton_coverage.sh

# On a machine with a CUDA GPU: the whole backend suite on the device.
test-gpu: setup
	$(PY) -m pytest -q tests/test_gpu.py

clean:
	rm -rf build $(VENV) lze_kernels/*.so
