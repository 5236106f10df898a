"""Fixtures shared by every test directory: the default model and real servers."""

from __future__ import annotations

import os

# Nothing in the tests may reach a model hub; set before transformers is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Triton kernels run in interpreter mode on a machine without CUDA. Set before anything
# imports triton (transformers' tokenizer stack does, from the engine tests).
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


@pytest.fixture(scope="session")
def model_smollm2_dir() -> str:
    """The embedded SmolLM2-135M-Instruct as `hearth serve` resolves it: config and tokenizer,
    the weights read from the GGUF file (`engine.gguf_checkpoint`).

    Converted once into the cache `hearth serve` uses in this environment (--cache-dir's
    `$HEARTH_CACHE_DIR`, or ~/.cache/hearth/models), so later runs, and the server tests,
    reuse it.
    """
    from engine.model_resolver import resolve_model_dir

    return resolve_model_dir(None, os.environ.get("HEARTH_CACHE_DIR") or None)


@pytest.fixture(scope="session")
def smollm2_hf_dir() -> str:
    """The embedded SmolLM2 converted with its weights dequantized into safetensors: the
    plain checkpoint transformers, PEFT and sentence-transformers load for the references
    (`model_smollm2_dir`, what `hearth serve` uses, leaves the weights in the GGUF file)."""
    from engine.model_resolver import resolve_model_dir

    return resolve_model_dir(None, os.environ.get("HEARTH_CACHE_DIR") or None, weights=True)
