# Two commands do all the set-up: `make run` (the main job) and `make test` (the test suite).
# Each creates .venv on first use with the pinned packages (pip takes torch from local disk here).
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fedcond-installed

.PHONY: run test test-fast lint clean-venv stop-superlink

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

# Extra settings go in ARGS: make run ARGS="method=fedavg num-clusters=5 num-server-rounds=20"
run: $(STAMP)
	$(BIN)/fedcond run $(ARGS)

# Three test processes on two cores: the deployment tests wait on Flower (heartbeats, polling) and the
# others use the cores meanwhile (docs/performance.md, "The test suite").
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 3

# The unit tests alone, without Flower, Ray or deployments (about half a minute): for while you edit.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

# flwr's local SuperLink outlives `flwr run` and keeps the environment it started with: this ends the
# one of this FLWR_HOME only (its PID is in each run's local-superlink.json), never another user's.
stop-superlink: $(STAMP)
	$(BIN)/fedcond stop-superlink

clean-venv:
	rm -rf $(VENV)
