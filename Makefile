# One entry point for humans and CI. `make run` and `make test` install what they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TOOLS := .cache/tools
BUF := $(TOOLS)/node_modules/.bin/buf
BUF_VERSION := 1.75.0
LISTEN ?= 127.0.0.1:50051
DATA_DIR ?= data
PYTEST_ARGS ?=
export RETRIEVAL_MODELS_DIR ?= $(HOME)/.cache/retrieval-service/models

.PHONY: help venv tools proto proto-check typecheck models run serve test test-fast clean

help:
	@echo "make run         install, build models, serve the embedded engine with the demo corpus"
	@echo "make test        install, check protos and types, start OpenSearch, run every test"
	@echo "make test-fast   unit + end-to-end tests only (no OpenSearch)"
	@echo "make proto       regenerate the Python stubs from protos/"
	@echo "make models      build the ONNX models into $(RETRIEVAL_MODELS_DIR)"

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml clients/python/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,models,eval]' -e clients/python
	touch $@

tools: $(BUF)
$(BUF):
	npm install --silent --no-save --no-audit --no-fund --prefix $(TOOLS) @bufbuild/buf@$(BUF_VERSION)

# Generated stubs: the service's and the Python client's (same protos, own package).
GEN := service/_gen:service._gen clients/python/retrieval_client/_gen:retrieval_client._gen
GENERATE = PATH=$(BIN):$$PATH PYTHON=$(BIN)/python protos/generate.sh

# Regenerate every stub from protos/ (the only way generated code changes).
proto: venv
	@for g in $(GEN); do $(GENERATE) $${g%%:*} $${g##*:}; done

# Lint, format, breaking-change check against main, and drift of the checked-in stubs.
proto-check: venv tools
	$(BUF) lint protos
	$(BUF) format --diff --exit-code protos
	@if git rev-parse --verify -q main >/dev/null; then \
	  $(BUF) breaking protos --against '.git#branch=main,subdir=protos'; fi
	@tmp=$$(mktemp -d); for g in $(GEN); do \
	  $(GENERATE) $$tmp/_gen $${g##*:} && if ! diff -r -q $$tmp/_gen $${g%%:*}; then \
	    echo "generated stubs in $${g%%:*} drifted from protos/: run 'make proto' and commit"; rm -rf $$tmp; exit 1; fi; \
	done; rm -rf $$tmp; echo "stubs up to date"

typecheck: venv
	$(BIN)/mypy
	$(BIN)/mypy --strict clients/python/retrieval_client --exclude '_gen/'

models: venv
	$(BIN)/python -m service models build

run: venv models
	$(BIN)/python -m service serve --listen $(LISTEN) --data-dir $(DATA_DIR) --demo

test-fast: venv models
	$(BIN)/python -m pytest -m "not integration" $(PYTEST_ARGS)

test: venv proto-check typecheck models
	bash tests/run_all.sh $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(TOOLS) .pytest_cache .mypy_cache
