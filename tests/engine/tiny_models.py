"""Tiny random-weight checkpoints of every architecture hearth serves, built with
transformers' own config classes (no download) and saved with `save_pretrained`.

Shared by the model parity tests (tests/engine/test_llama_parity.py), the engine-level
greedy tests (tests/engine/test_dense_engine_parity.py) and the real-server test
(tests/e2e/test_architectures_real.py). Small enough that a forward costs milliseconds:
2 layers, hidden 64, 4 heads of 16, vocabulary 128. Windowed configs use windows of a
few tokens, so the tests' prompts (up to 40 tokens) run well past them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    SmolLM3Config,
)

COMMON: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "bos_token_id": None,
    "eos_token_id": None,  # greedy runs the full number of steps
    "pad_token_id": 0,
}


def llama_tied() -> PretrainedConfig:
    return LlamaConfig(**COMMON, head_dim=16, tie_word_embeddings=True)


def llama_untied_bias() -> PretrainedConfig:
    # head_dim (16) != hidden/heads (12): the explicit head_dim must win everywhere.
    cfg = {**COMMON, "hidden_size": 48}
    return LlamaConfig(
        **cfg, head_dim=16, tie_word_embeddings=False, attention_bias=True, mlp_bias=True
    )


def llama3_rope() -> PretrainedConfig:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    return LlamaConfig(**COMMON, head_dim=16, tie_word_embeddings=True, rope_parameters=rope)


def qwen2() -> PretrainedConfig:
    return Qwen2Config(**COMMON, tie_word_embeddings=False)


def qwen2_sliding() -> PretrainedConfig:
    """Every layer windowed (max_window_layers 0): the block manager may free blocks."""
    return Qwen2Config(
        **COMMON, tie_word_embeddings=False, use_sliding_window=True, sliding_window=6,
        max_window_layers=0,
    )  # fmt: skip


def mistral() -> PretrainedConfig:
    return MistralConfig(**COMMON, head_dim=16, sliding_window=4096)


def mistral_sliding() -> PretrainedConfig:
    return MistralConfig(**COMMON, head_dim=16, sliding_window=8)


def qwen3() -> PretrainedConfig:
    return Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=True)


def qwen3_sliding() -> PretrainedConfig:
    """Layer 0 global, layer 1 windowed (max_window_layers 1), untied, with biases."""
    return Qwen3Config(
        **COMMON, head_dim=16, tie_word_embeddings=False, attention_bias=True,
        use_sliding_window=True, sliding_window=7, max_window_layers=1,
    )  # fmt: skip


def gemma3() -> PretrainedConfig:
    """Sliding layer 0 (window 6, local rope base), global layer 1 (its own base, with
    linear scaling), q/k norms, a query_pre_attn_scalar that is not head_dim, soft-capped
    logits."""
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
    }
    return Gemma3TextConfig(
        **COMMON, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"], rope_parameters=rope,
        final_logit_softcapping=30.0,
    )  # fmt: skip


def phi3_partial_sliding() -> PretrainedConfig:
    """Fused qkv/gate_up checkpoint tensors, half the head rotated, window 8 everywhere."""
    return Phi3Config(**COMMON, partial_rotary_factor=0.5, sliding_window=8)


def phi3_longrope() -> PretrainedConfig:
    """LongRoPE with distinct short and long factors; the tests' sequences stay below
    original_max_position_embeddings (64) except the one that decodes across it."""
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [2.0 + 0.3 * i for i in range(8)],
    }
    return Phi3Config(**COMMON, original_max_position_embeddings=64, rope_parameters=rope)


def smollm3() -> PretrainedConfig:
    """Layer 1 without rotary (NoPE) and windowed (window 5); layer 0 rotary, global."""
    return SmolLM3Config(**COMMON, no_rope_layers=[1, 0], use_sliding_window=True, sliding_window=5)


CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama-gqa-tied": llama_tied,
    "llama-untied-bias-headdim": llama_untied_bias,
    "llama3-rope-scaling": llama3_rope,
    "qwen2-qkv-bias": qwen2,
    "qwen2-sliding": qwen2_sliding,
    "mistral": mistral,
    "mistral-sliding": mistral_sliding,
    "qwen3": qwen3,
    "qwen3-sliding": qwen3_sliding,
    "gemma3": gemma3,
    "phi3-partial-sliding": phi3_partial_sliding,
    "phi3-longrope": phi3_longrope,
    "smollm3-nope-sliding": smollm3,
}
"""Name → config factory; the parity tests parametrize over every entry."""


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter distinct random values.

    transformers initialises norms to 1 (Gemma's to 0) and biases to 0; with those a
    loader that swapped two norms or dropped a bias would still pass, so nothing is left
    at its init.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(0.15 * noise)


def save_tiny(name: str, directory: Path, vocab_size: int | None = None) -> torch.nn.Module:
    """Build config `name` with random weights, save it to `directory`; returns the
    transformers model (eager attention, float32, eval mode): the oracle. `vocab_size`
    overrides the config's (a served model needs room for its tokenizer's ids)."""
    config = CONFIGS[name]()
    if vocab_size is not None:
        config.vocab_size = vocab_size
    return save_random_config(config, directory)


def save_random_config(config: Any, directory: Path) -> torch.nn.Module:
    """`config` (a transformers config object) with random weights (`randomize`), saved
    to `directory`; returns the transformers model (eager attention, float32, eval mode)."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    randomize(hf, seed=1)
    hf.eval()
    hf.save_pretrained(directory)
    return hf


SERVED_VOCAB = 512
"""Vocabulary of a served tiny model: the handler tests' BPE tokenizer has 400 ids."""


def save_servable_tiny(name: str, directory: Path) -> torch.nn.Module:
    """`save_tiny` plus a real tokenizer and ChatML template (the handler tests' tiny
    byte-level BPE, EOS ``<|im_end|>``), so `EngineCore` and `hearth serve` can load the
    directory; returns the transformers oracle."""
    from tests.handlers.handlers_testing import build_tiny_model

    build_tiny_model(directory)  # tokenizer files (and a config.json, replaced below)
    return save_tiny(name, directory, vocab_size=SERVED_VOCAB)


def save_servable_classifier(
    name: str, directory: Path, num_labels: int, **config_fields: Any
) -> torch.nn.Module:
    """A `*ForSequenceClassification` checkpoint on config `name`'s decoder: random
    weights (score head included), `num_labels` labels named ``LABEL_i`` unless
    `config_fields` says otherwise (`id2label`, `problem_type`, ...), and the servable
    tokenizer of `save_servable_tiny`; returns the transformers oracle (float32, eval)."""
    from transformers import AutoModelForSequenceClassification

    from tests.handlers.handlers_testing import build_tiny_model

    build_tiny_model(directory)
    config = CONFIGS[name]()
    config.vocab_size = SERVED_VOCAB
    config.num_labels = num_labels
    for key, value in config_fields.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    hf = AutoModelForSequenceClassification.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    randomize(hf, seed=2)
    hf.eval()
    hf.save_pretrained(directory)
    return hf
