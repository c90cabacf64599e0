# Two commands do all set-up on a fresh machine: `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0
PROTOS := $(wildcard proto/dhisparse/rpc/*.proto)

.PHONY: run test tools lint format proto proto-check install clean images

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: the CPU build lies on this machine's disk; anything looser
	# would download a multi-GB CUDA build.
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/dhisparse up

# Regenerate the gRPC code from proto/ (generated files are committed).
proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

# Fails when the committed generated code is stale.
proto-check: $(STAMP)
	@tmp=$$(mktemp -d); \
	$(BIN)/python -m grpc_tools.protoc -I proto --python_out=$$tmp --pyi_out=$$tmp --grpc_python_out=$$tmp $(PROTOS) && \
	for f in $$(cd $$tmp && find . -name '*.py' -o -name '*.pyi'); do \
	  cmp -s $$tmp/$$f $$f || { echo "stale generated code: $$f (run 'make proto')"; rm -rf $$tmp; exit 1; }; \
	done; rm -rf $$tmp; echo "generated gRPC code is up to date"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The system tools and repo-local binaries the tests drive (redis-server, prometheus, helm,
# hadolint); first, so that a missing one that needs root stops `make test` at once.
tools:
	@PYTHON=$(PYTHON) scripts/test-tools

# Two workers, a test file each at a time (module fixtures stay in one process): the suite's
# servers and subprocesses wait on each other as much as they compute.
PYTEST_ARGS ?= -n 2 --dist loadfile

test: tools $(STAMP) proto-check lint
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Container images (docker/*.Dockerfile), built from the repository root. Needs a Docker engine;
# push with e.g. `make images IMAGE_PREFIX=registry.example.com/dhisparse/ IMAGE_TAG=0.1.0`.
IMAGE_PREFIX ?= dhisparse-
IMAGE_TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGES := gateway worker kv-host-store
DOCKER ?= docker

images:
	@$(DOCKER) info >/dev/null 2>&1 || { echo "make images: no Docker engine reachable ('$(DOCKER) info' failed)"; exit 1; }
	for i in $(IMAGES); do \
	  $(DOCKER) build -f docker/$$i.Dockerfile -t $(IMAGE_PREFIX)$$i:$(IMAGE_TAG) . || exit 1; \
	done

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
