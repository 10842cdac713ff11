# ZeroLayer: `make run` serves the built-in model on the CPU, `make test` runs the suite.
# Both create .venv and install what they need on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= configs/default.toml

.PHONY: install run test test-unit redis bench lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -e '.[cpu,redis,dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/zerolayer serve --config $(CONFIG)

# The suite runs a real redis-server: installed from Debian's package when missing.
redis:
	@sh tests/support/install-redis.sh

test: $(STAMP) redis
	$(BIN)/python -m pytest -q

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

# Benchmarks print only unless given --write; this target updates the tracked results and docs.
bench: $(STAMP)
	$(BIN)/python benchmarks/serving.py --write
	$(BIN)/python benchmarks/serving.py --scenario engine-step --write
	$(BIN)/python benchmarks/engine.py --dtype float32 --write
	$(BIN)/python benchmarks/engine.py --dtype bfloat16 --runs 3 --write
	$(BIN)/python benchmarks/hooks.py --write
	$(BIN)/python benchmarks/prompts.py --size medium --write
	$(BIN)/python benchmarks/prompts.py --size builtin --write
	$(BIN)/python benchmarks/prefix.py --write
	$(BIN)/python benchmarks/connections.py --write
	$(BIN)/python benchmarks/fairness.py --write
	$(BIN)/python benchmarks/tls.py --write

lint: $(STAMP)
	$(BIN)/ruff check gateway kernels tests benchmarks
	$(BIN)/ruff format --check gateway kernels tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
