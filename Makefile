# One command to set up and run the main job; one to set up and run the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# libtpu for --dry_run_topology's compile-only TPU topologies, kept off the import path so that JAX on
# this host still starts on its CPU (or GPU) without probing for a TPU (see mimo_jax/topology.py).
TPU_COMPILE := $(VENV)/libtpu-compile
TPU_STAMP := $(TPU_COMPILE)/.installed

.PHONY: setup run test tpu-compile browser compiler lint format clean

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

$(TPU_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps --target $(TPU_COMPILE) "$$($(PY) -c 'from mimo_jax.topology import LIBTPU_REQUIREMENT as r; print(r)')"
	touch $(TPU_STAMP)

setup: $(STAMP)

tpu-compile: $(TPU_STAMP)

run: $(STAMP)
	$(PY) -m mimo_jax.main --flagfile=experiments/grpo_tiny.flags

# Debian's Chromium and its driver, for the test that opens the run report in a real browser (installed
# where missing; as root, or with sudo).
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium chromium-driver; \
	fi

# A C++ compiler for mimo_jax.kernels.cpu_rows, which is compiled on first use (the tests build it;
# installed where missing, as root or with sudo).
compiler:
	@if ! command -v "$${CXX:-g++}" >/dev/null 2>&1 && ! command -v c++ >/dev/null 2>&1; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq g++; \
	fi

# --capture=sys: Python output is captured per test as usual, but what C++ writes to the process's
# stderr (XLA's fatal errors and its stuck-collective warnings) reaches the log even if the process aborts.
test: $(STAMP) $(TPU_STAMP) browser compiler
	$(PY) -m pytest -q --durations=25 --capture=sys

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) build *.egg-info
