"""The engine's settings resolved against the host and the model, before anything is built.

`EngineConfig` is what the user asked for (validated on construction); `resolve` turns it
into what will run: the device, the dtype, the model directory (a GGUF converted once),
the context length (the model's limit, `--max-model-len`) and the
step's token budget. `EngineCore` builds its components from the result, so every
"auto" is decided in one place and a bad combination fails before the weights load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import EngineConfig, default_token_budget
from engine.gpu_memory import auto_dtype
from engine.model_config import read_model_config
from engine.model_resolver import resolve_model_dir
from engine.models.registry import get_model_class

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        is_cuda = device.type == "cuda"
        return auto_dtype(device.type, is_cuda and torch.cuda.is_bf16_supported())
    if name not in _DTYPES:
        raise ValueError(f"unknown --dtype {name!r}: use auto, float32, bfloat16 or float16")
    return _DTYPES[name]


@dataclass(frozen=True, slots=True)
class ResolvedEngineConfig:
    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    model_dir: str
    """Plain HF directory the weights and tokenizer load from."""
    model_config: Any
    """config.json's values (`engine.model_config.read_model_config`)."""
    max_model_len: int
    """The context limit before the KV cache is sized (which may lower it further)."""
    max_num_batched_tokens: int
    max_prefill_chunk: int | None
    """Longest first prompt chunk of a step; at least the budget (engine/scheduler.py).
    None: the default, which depends on the device and the kernels
    (`default_prefill_chunk`), so the core decides it once the backends are chosen."""


def resolve(config: EngineConfig, say: Callable[[str], None]) -> ResolvedEngineConfig:
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    model_dir = resolve_model_dir(config.model, config.cache_dir, progress=say)
    model_config = read_model_config(model_dir)
    max_len = int(getattr(model_config, "max_position_embeddings", 0) or 2048)
    if config.max_model_len is not None:
        if config.max_model_len > max_len:
            raise ValueError(
                f"--max-model-len {config.max_model_len} exceeds the model's "
                f"max_position_embeddings ({max_len})"
            )
        max_len = config.max_model_len
    get_model_class(model_config)  # an unsupported architecture fails here, before loading
    budget = max(config.max_num_batched_tokens or default_token_budget(device.type), 1)
    chunk: int | None
    if config.max_prefill_chunk:
        chunk = max(config.max_prefill_chunk, budget)
    elif config.max_num_batched_tokens:
        chunk = budget  # an explicit budget caps every step, as vLLM's does
    else:
        chunk = None  # by device and kernels: EngineCore, once the backends are chosen
    return ResolvedEngineConfig(
        config, device, dtype, model_dir, model_config, max_len, budget, chunk
    )
