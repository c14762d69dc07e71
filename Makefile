# make demo        : the whole pipeline on the built-in tiny model and data (creates .venv on first use)
# make test        : the CPU test suite, on the exact versions in constraints.txt (learning tests apart)
# make test-learning: the learning tests (each algorithm trains and must improve, several seeds)
# make test-latest : the tests marked `stack` on Python 3.12 with the newest torch and megatron-core
# make test-oldest : the same subset on Python 3.10 with the oldest torch and megatron-core supported
# make test-slurm  : the PPO heterogeneous job on a two-node Slurm cluster started here (root; not in make test)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONSTRAINTS := constraints.txt
TORCH_VERSION := $(shell sed -n 's/^torch==//p' $(CONSTRAINTS))
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

$(STAMP): setup.py $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, the CPU wheel: otherwise pip resolves a CUDA build (GBs).
	$(call install_torch,$(PY))
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m nemo_aligner.demo --out-dir results/demo

# Two pytest-xdist workers, a test file each at a time: most tests run one single-threaded
# process, so one worker alone leaves a core of a 2-core CI machine idle. TEST_WORKERS=0: serial.
# Files in collection order, the longest first (tests/conftest.py: LONG_FILES_FIRST).
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not learning" tests

# Tests marked `learning`: an algorithm trains on the built-in task and its score, loss or reward
# must improve (several seeds); CI runs them after make test.
.PHONY: test-learning
test-learning: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m learning tests

clean:
	rm -rf results/demo .pytest_cache

# The newest stack: Python 3.12 (megatron-core 0.17+ needs it), the newest torch and megatron-core
# from the package index (PyPI's torch is a CUDA build, which runs on the CPU), numpy as
# nvidia-pytriton allows. PIP_CONFIG_FILE=/dev/null: the machine's pip configuration (a local
# wheel directory, version caps) does not apply here.
LATEST_VENV := .venv-latest
LATEST_PY := $(LATEST_VENV)/bin/python
find_python = $(shell for p in "$$(pyenv root 2>/dev/null)"/versions/$(1)*/bin/python$(1) $$(command -v python$(1)); do \
	"$$p" -c 'import sys; assert sys.version_info[:2] == tuple(map(int, "$(1)".split(".")))' 2>/dev/null && echo "$$p" && break; done)
PYTHON312 ?= $(call find_python,3.12)
# Tests marked `stack` (pytest.ini): those that reach into the APIs of torch and megatron-core that
# change between releases (parallel training, checkpoints, launch, patches, generation, servers).
LATEST_TESTS ?= -m stack tests

.PHONY: test-slurm
test-slurm: $(STAMP)
	PY=$(abspath $(PY)) tests/slurm/run.sh

.PHONY: test-latest
test-latest: $(LATEST_VENV)/.installed
	$(LATEST_PY) -c "import sys, torch, megatron.core, numpy; print('newest stack: Python', sys.version.split()[0], \
		'torch', torch.__version__, 'megatron-core', megatron.core.__version__, 'numpy', numpy.__version__)"
	$(LATEST_PY) -m pytest -q $(XDIST) $(LATEST_TESTS)

$(LATEST_VENV)/.installed: setup.py
	test -n "$(PYTHON312)" || (echo "make test-latest needs Python 3.12 (set PYTHON312=/path/to/python3.12)" >&2; exit 1)
	test -x $(LATEST_PY) || $(PYTHON312) -m venv $(LATEST_VENV)
	PIP_CONFIG_FILE=/dev/null $(LATEST_PY) -m pip install -q --upgrade pip
	PIP_CONFIG_FILE=/dev/null $(LATEST_PY) -m pip install -q --upgrade torch megatron-core -e ".[test]"
	touch $@

# The oldest supported stack (setup.py's lower bounds): Python 3.10, torch 2.6, megatron-core 0.16.0.
OLDEST_VENV := .venv-oldest
OLDEST_PY := $(OLDEST_VENV)/bin/python
PYTHON310 ?= $(call find_python,3.10)
OLDEST_PINS ?= torch==2.6.0 megatron-core==0.16.0

.PHONY: test-oldest
test-oldest: $(OLDEST_VENV)/.installed
	$(OLDEST_PY) -c "import sys, torch, megatron.core, numpy; print('oldest stack: Python', sys.version.split()[0], \
		'torch', torch.__version__, 'megatron-core', megatron.core.__version__, 'numpy', numpy.__version__)"
	$(OLDEST_PY) -m pytest -q $(XDIST) $(LATEST_TESTS)

$(OLDEST_VENV)/.installed: setup.py
	test -n "$(PYTHON310)" || (echo "make test-oldest needs Python 3.10 (set PYTHON310=/path/to/python3.10)" >&2; exit 1)
	test -x $(OLDEST_PY) || $(PYTHON310) -m venv $(OLDEST_VENV)
	PIP_CONFIG_FILE=/dev/null $(OLDEST_PY) -m pip install -q --upgrade pip
	PIP_CONFIG_FILE=/dev/null $(OLDEST_PY) -m pip install -q $(OLDEST_PINS) -e ".[test]"
	touch $@

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
