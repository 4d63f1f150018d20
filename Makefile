# From a fresh clone (needs only python3 and make):
#   make run     set up .venv (once) and run the quickstart: a tiny model learns FrozenLake
#   make test    set up .venv (once) and run the tests: python -m pytest -q
# Set-up is redone only when pyproject.toml changes (a stamp file in the venv), so the
# second call starts at once. Extra arguments: make run ARGS="--steps 20 --nats memory",
# make test ARGS=tests/cli.
#
# torch: an already satisfiable pin (a local wheel folder pip knows of, or a venv that has
# it) is used as is; otherwise the CPU build is installed from the PyTorch CPU index, so pip
# never pulls a multi-GB CUDA build by accident. For a GPU build, on a fresh venv:
#   make run TORCH_INDEX=https://download.pytorch.org/whl/cu128

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
CPU_INDEX := https://download.pytorch.org/whl/cpu
EXTRAS ?= dev,envs
CONFIG ?= quickstart
ARGS ?=

PIP := $(VENV)/bin/python -m pip
STAMP := $(VENV)/.rollart-setup

.PHONY: run test setup

run: $(STAMP)
	$(VENV)/bin/rollart run $(CONFIG) $(ARGS)

test: $(STAMP)
	. $(VENV)/bin/activate && python -m pytest -q $(ARGS)

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/python || { echo "creating $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@if [ -n "$(TORCH_INDEX)" ]; then \
	  echo "installing $(TORCH) from $(TORCH_INDEX)"; \
	  $(PIP) install -q "$(TORCH)" --index-url "$(TORCH_INDEX)"; \
	elif $(PIP) install -q --dry-run --no-deps --no-index "$(TORCH)" >/dev/null 2>&1; then \
	  echo "installing $(TORCH) (a wheel is already here: no download)"; \
	  $(PIP) install -q "$(TORCH)"; \
	else \
	  echo "installing $(TORCH), the CPU build, from $(CPU_INDEX)"; \
	  $(PIP) install -q "$(TORCH)" --index-url $(CPU_INDEX); \
	fi
	@echo "installing rollart[$(EXTRAS)] (editable)"
	@$(PIP) install -q -e '.[$(EXTRAS)]'
	@touch $@
