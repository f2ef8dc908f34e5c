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

.PHONY: run test venv test-deps system-deps clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

venv: $(BIN)/python
	$(PIP) install '$(TORCH_SPEC)'
	$(PIP) install -e '.[ops]'

run: venv
	$(BIN)/monodecode-ops verify

system-deps:
	scripts/install-system-deps.sh

test-deps: system-deps venv
	$(PIP) install -e '.[ops,dev,flydsl,triton]' '$(TORCH_SPEC)'
	scripts/setup-toolchains.sh $(VENV)

test: test-deps
	scripts/with-services.sh $(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .venv-* build dist *.egg-info .pytest_cache
