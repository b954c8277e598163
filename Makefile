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
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,models]'
	touch $@

tools: $(BUF)
$(BUF):
	npm install --silent --no-save --no-audit --no-fund --prefix $(TOOLS) @bufbuild/buf@$(BUF_VERSION)

# Regenerate every stub from protos/ (the only way generated code changes).
proto: venv
	PATH=$(BIN):$$PATH PYTHON=$(BIN)/python protos/generate.sh service/_gen service._gen

# Lint, format, breaking-change check against main, and drift of the checked-in stubs.
proto-check: venv tools
	$(BUF) lint protos
	$(BUF) format --diff --exit-code protos
	@if git rev-parse --verify -q main >/dev/null; then \
	  $(BUF) breaking protos --against '.git#branch=main,subdir=protos'; fi
	@tmp=$$(mktemp -d) && PATH=$(BIN):$$PATH PYTHON=$(BIN)/python protos/generate.sh $$tmp/_gen service._gen && \
	  if ! diff -r -q $$tmp/_gen service/_gen; then \
	    echo "generated stubs drifted from protos/: run 'make proto' and commit"; rm -rf $$tmp; exit 1; fi; \
	  rm -rf $$tmp; echo "stubs up to date"

typecheck: venv
	$(BIN)/mypy

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
