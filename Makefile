# Quick start: `make up` then `make test`. See README.md.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
# The node's state directory; AENV_HOME in the environment overrides the default.
STATE_DIR ?= $(or $(AENV_HOME),/var/lib/aenv)

.PHONY: up down test lint system venv bench clean proto cluster-up cluster-down

system:
	@bash scripts/install-system.sh

# The editable install also compiles the native serving core (pyproject.toml, docs/native.md).
$(STAMP): pyproject.toml src/agentenv/storage/_native.cpp src/agentenv/runtime/_ramopen.c
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@$(PY) -m pip install -q -e .
	@touch $@

$(TEST_STAMP): $(STAMP) pyproject.toml
	@$(PY) -m pip install -q -e '.[test]'
	@touch $@

venv: $(STAMP)

# Installs everything, builds the guest assets, starts blockd and the node (VM backend, built-in
# `base` template) in the background and prints the E2B variables (scripts/up.sh).
up: system venv
	@AENV_HOME=$(STATE_DIR) bash scripts/up.sh

# Stops the node (pausing every running sandbox) and blockd (scripts/down.sh).
down:
	@AENV_HOME=$(STATE_DIR) bash scripts/down.sh

# A cluster on this host: redis, scheduler, gateway and NODES nodes (each in its own network
# namespace); prints the gateway URL and a team key (scripts/cluster-up.sh).
NODES ?= 3
cluster-up: system venv
	@NODES=$(NODES) bash scripts/cluster-up.sh

cluster-down:
	@bash scripts/cluster-down.sh

# lint-imports: the layering rule of docs/architecture.md §3 ([tool.importlinter] in pyproject.toml).
test: system $(TEST_STAMP)
	@$(VENV)/bin/ruff check src tests bench
	@$(VENV)/bin/lint-imports
	@$(VENV)/bin/pytest $(PYTEST_ARGS)

lint: $(TEST_STAMP)
	@$(VENV)/bin/ruff check src tests bench
	@$(VENV)/bin/lint-imports

# Regenerates the gRPC code in src/agentenv/scheduling/proto/ from its .proto files (committed;
# tests/control/test_proto.py checks that they match).
proto: $(TEST_STAMP)
	@$(PY) -m grpc_tools.protoc -Isrc --python_out=src --grpc_python_out=src --pyi_out=src \
		src/agentenv/scheduling/proto/*.proto

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build src/agentenv/storage/_native*.so
