# make demo : tiny SFT run on the built-in data (creates .venv and installs on first use)
# make test : the CPU test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
# Bytecode caching cuts every test subprocess's start-up by ~10 s (megatron-core imports).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test install clean

install: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, from the CPU wheel on the machine: otherwise pip resolves a CUDA build (GBs).
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m nemo_aligner.demo --out-dir results/demo

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf results/demo .pytest_cache
