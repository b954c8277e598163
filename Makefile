# One entry point for humans and CI. `make run` and `make test` install what they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TOOLS := .cache/tools
BUF := $(TOOLS)/node_modules/.bin/buf
BUF_VERSION := 1.75.0
# Local protoc plugins for the Go client, pinned (ts-proto is pinned by clients/ts/package-lock.json).
PROTOC_GEN_GO_VERSION := v1.36.12
PROTOC_GEN_GO_GRPC_VERSION := v1.6.2
GO_PLUGINS := $(TOOLS)/go-plugins-$(PROTOC_GEN_GO_VERSION)-$(PROTOC_GEN_GO_GRPC_VERSION)
TS_CLIENT := clients/ts
LISTEN ?= 127.0.0.1:50051
DATA_DIR ?= data
PYTEST_ARGS ?=
export RETRIEVAL_MODELS_DIR ?= $(HOME)/.cache/retrieval-service/models

.PHONY: help venv tools ts-deps proto proto-check typecheck models run serve test test-fast bench clean

help:
	@echo "make run         install, build models, serve the embedded engine with the demo corpus"
	@echo "make test        install, check protos and types, start OpenSearch, run every test"
	@echo "make test-fast   unit + end-to-end tests only (no OpenSearch)"
	@echo "make bench       load runs: ours vs the baseline pipeline (BENCH_ARGS=...; not part of make test)"
	@echo "make proto       regenerate the Python, Go and TypeScript stubs from protos/"
	@echo "make models      build the ONNX models into $(RETRIEVAL_MODELS_DIR)"

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml clients/python/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,models,eval]' -e clients/python
	touch $@

tools: $(BUF) $(GO_PLUGINS)/.installed
$(BUF):
	npm install --silent --no-save --no-audit --no-fund --prefix $(TOOLS) @bufbuild/buf@$(BUF_VERSION)
$(GO_PLUGINS)/.installed:
	GOBIN=$(abspath $(GO_PLUGINS)) go install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)
	GOBIN=$(abspath $(GO_PLUGINS)) go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@$(PROTOC_GEN_GO_GRPC_VERSION)
	touch $@

# The TypeScript client's packages (and the ts-proto generator), exactly as the lock file says.
ts-deps: $(TS_CLIENT)/node_modules/.installed
$(TS_CLIENT)/node_modules/.installed: $(TS_CLIENT)/package-lock.json
	cd $(TS_CLIENT) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

# Generated stubs: the service's and the Python client's (same protos, own package).
GEN := service/_gen:service._gen clients/python/retrieval_client/_gen:retrieval_client._gen
GENERATE = PATH=$(BIN):$$PATH PYTHON=$(BIN)/python protos/generate.sh
# The Go and TypeScript clients' stubs (checked in too, so their users need no generator).
CLIENT_GEN := go:clients/go/gen ts:$(TS_CLIENT)/src/gen
GENERATE_CLIENT = PYTHON=$(BIN)/python GO_PLUGINS=$(abspath $(GO_PLUGINS)) protos/generate_clients.sh

# Regenerate every stub from protos/ (the only way generated code changes).
proto: venv tools ts-deps
	@for g in $(GEN); do $(GENERATE) $${g%%:*} $${g##*:}; done
	@for g in $(CLIENT_GEN); do $(GENERATE_CLIENT) $${g%%:*} $${g##*:}; done

# Lint, format, breaking-change check against main, and drift of the checked-in stubs.
proto-check: venv tools ts-deps
	$(BUF) lint protos
	$(BUF) format --diff --exit-code protos
	@if git rev-parse --verify -q main >/dev/null; then \
	  $(BUF) breaking protos --against '.git#branch=main,subdir=protos'; fi
	@tmp=$$(mktemp -d); drift=""; for g in $(GEN); do \
	  $(GENERATE) $$tmp/_gen $${g##*:} || exit 1; \
	  diff -r -q $$tmp/_gen $${g%%:*} || drift="$$drift $${g%%:*}"; rm -rf $$tmp/_gen; \
	done; for g in $(CLIENT_GEN); do \
	  $(GENERATE_CLIENT) $${g%%:*} $$tmp/$${g%%:*} || exit 1; \
	  diff -r -q $$tmp/$${g%%:*} $${g##*:} || drift="$$drift $${g##*:}"; \
	done; rm -rf $$tmp; if [ -n "$$drift" ]; then \
	  echo "generated stubs drifted from protos/ in:$$drift: run 'make proto' and commit"; exit 1; fi; \
	echo "stubs up to date (Python, Go, TypeScript)"

typecheck: venv
	$(BIN)/mypy
	$(BIN)/mypy --strict clients/python/retrieval_client --exclude '_gen/'
	$(MAKE) -s ts-deps && cd $(TS_CLIENT) && node_modules/.bin/tsc -p tsconfig.json --noEmit
	cd clients/go && go vet ./...

models: venv
	$(BIN)/python -m service models build

run: venv models
	$(BIN)/python -m service serve --listen $(LISTEN) --data-dir $(DATA_DIR) --demo

test-fast: venv models
	$(BIN)/python -m pytest -m "not integration" $(PYTEST_ARGS)

test: venv proto-check typecheck models
	bash tests/run_all.sh $(PYTEST_ARGS)

# Load runs against our server and the baseline pipeline in the same run (tests/load/bench.py;
# results, tables and plots under .cache/bench/). Not part of `make test`.
BENCH_ARGS ?=
bench: venv models
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m tests.load.bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(TOOLS) .pytest_cache .mypy_cache $(TS_CLIENT)/node_modules $(TS_CLIENT)/dist
