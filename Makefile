# make demo : tiny SFT run on the built-in data (creates .venv and installs on first use)
# make test : the CPU test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# torch's CPU wheel: a local copy if pip's find-links has one (CI machines, offline), else from
# PyTorch's CPU index; then its dependencies from the usual index. Plain PyPI would give Linux the
# CUDA build (GBs).
install_torch = ($(1) -m pip install -q --no-index --no-deps torch==$(TORCH_VERSION) 2>/dev/null || \
	$(1) -m pip install -q --no-deps torch==$(TORCH_VERSION) --index-url $(TORCH_INDEX)) && \
	$(1) -m pip install -q torch==$(TORCH_VERSION)
# Bytecode caching cuts every test subprocess's start-up by ~10 s (megatron-core imports).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test install clean

install: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, the CPU wheel: otherwise pip resolves a CUDA build (GBs).
	$(call install_torch,$(PY))
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m nemo_aligner.demo --out-dir results/demo

# Two pytest-xdist workers, a test file each at a time: most tests run one single-threaded
# process, so one worker alone leaves a core of a 2-core CI machine idle. TEST_WORKERS=0: serial.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

clean:
	rm -rf results/demo .pytest_cache

# make bench-venv : .venv-bench, a separate venv for benchmarks/bench_grpo.py. TRL (via datasets,
# pyarrow, pandas) needs numpy>=2 and nvidia-pytriton pins numpy<2, so it cannot go into .venv.
# torch CPU first, then the pinned deps + TRL, then this package without its deps (pip check
# then reports nvidia-pytriton missing and numpy 2 vs setup.py's numpy<2: expected, the benchmark
# uses neither pin).
BENCH_VENV := .venv-bench
BENCH_PY := $(BENCH_VENV)/bin/python

.PHONY: bench-venv
bench-venv: $(BENCH_VENV)/.installed

$(BENCH_VENV)/.installed: benchmarks/requirements-trl.txt setup.py
	test -x $(BENCH_PY) || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_PY) -m pip install -q --upgrade pip
	$(call install_torch,$(BENCH_PY))
	$(BENCH_PY) -m pip install -q -r benchmarks/requirements-trl.txt
	$(BENCH_PY) -m pip install -q --no-deps -e .
	cd benchmarks && $(abspath $(BENCH_PY)) -c "import numpy, torch, nemo_aligner, megatron.core, trl, datasets; \
		assert int(numpy.__version__.split('.')[0]) >= 2; \
		print('bench venv: numpy', numpy.__version__, 'torch', torch.__version__, 'trl', trl.__version__)"
	touch $@
