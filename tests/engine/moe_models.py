"""Tiny random-weight MoE checkpoints, built with transformers' own config classes and
saved with `save_pretrained` (no download), for the MoE parity tests, the real-server
test and `tools/bench_moe_step.py`.

Every parameter gets distinct random values (`randomize` of tests/engine/tiny_models.py):
with transformers' init (norms 1, router 0 for Qwen3-MoE) a loader that swapped two
experts or dropped a router bias could still pass. A word-level tokenizer with a chat
template (`tests/gpu/gpu_models.py` `write_tokenizer`) makes the directory servable.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    GptOssConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen3MoeConfig,
)

from tests.engine.tiny_models import COMMON, randomize
from tests.gpu.gpu_models import write_tokenizer

VOCAB = 128

_COMMON: dict[str, Any] = {**COMMON, "head_dim": 16}
"""tests/engine/tiny_models.py's shape (2 layers, hidden 64, 4 heads of 16, vocabulary
128); each MoE config sets its own expert widths."""


def _mixtral() -> PretrainedConfig:
    return MixtralConfig(
        **_COMMON, num_local_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False,
    )  # fmt: skip


def _qwen3_moe() -> PretrainedConfig:
    # 4 layers, layer 2 dense by mlp_only_layers (decoder_sparse_step: test_moe_parity.py
    # compares the sparse/dense choice with transformers'); top-3 of 6 experts without
    # renormalising; tied embeddings.
    return Qwen3MoeConfig(
        **{**_COMMON, "num_hidden_layers": 4, "intermediate_size": 80}, moe_intermediate_size=32,
        num_experts=6, num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[2],
        tie_word_embeddings=True,
    )  # fmt: skip


def _gpt_oss() -> PretrainedConfig:
    # Layers 0 and 2 windowed (8 tokens: the parity prompts run up to 40 and past it),
    # 1 and 3 global (transformers' default alternation); YaRN over 64 original
    # positions (factor 4, so the blend and its attention factor both bite at the
    # tests' lengths); top-2 of 4 experts; biases everywhere; untied head.
    rope = {
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64,
    }  # fmt: skip
    return GptOssConfig(
        **{**_COMMON, "num_hidden_layers": 4, "intermediate_size": 32}, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, rope_parameters=rope,
        tie_word_embeddings=False,
    )  # fmt: skip


CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "gpt-oss": _gpt_oss,
    "mixtral": _mixtral,
    "qwen3-moe": _qwen3_moe,
}
"""Architecture family → its tiny config (each one's experts are all routed to by the
parity prompts: tests/engine/test_moe_parity.py checks it)."""


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the transformers oracle on one torch thread: its eager experts call `index_add_`
    per expert, whose parallel kernel spent ~20 ms per call in its OpenMP barrier on the
    busy 2-core test host (generate: 40 s on 2 threads, 1.8 s on 1; same tokens)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def hf_reference(name: str, seed: int = 1, vocab_size: int | None = None) -> torch.nn.Module:
    """transformers' model of `name` with distinct random weights, float32, eager
    attention and eager experts (the per-expert loop: the plainest oracle). `vocab_size`
    overrides the config's (a served model needs room for its tokenizer's ids)."""
    config = CONFIGS[name]()
    if vocab_size is not None:
        config.vocab_size = vocab_size
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config,
        dtype=torch.float32,
        attn_implementation="eager",
        experts_implementation="eager",
    )
    randomize(model, seed=seed)
    if name == "gpt-oss":
        strong_sinks(model, seed)
    return model.eval()


def strong_sinks(model: torch.nn.Module, seed: int) -> None:
    """Attention sinks around the size of the attention scores (``randomize`` leaves them
    near 0.15): each takes a sizeable share of its head's softmax, so attention that
    ignored them (or got them wrong) moves every logit far beyond the parity bound."""
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for layer in model.model.layers:
            sinks = layer.self_attn.sinks
            sinks.copy_(1.0 + 1.5 * torch.randn(sinks.shape, generator=gen))


def save_tiny_moe(name: str, directory: Path, seed: int = 1) -> torch.nn.Module:
    """Save `name`'s tiny checkpoint and tokenizer into `directory`; returns the HF model."""
    model = hf_reference(name, seed)
    model.save_pretrained(directory)
    write_tokenizer(directory, VOCAB)
    return model


def save_servable_tiny_moe(name: str, directory: Path) -> torch.nn.Module:
    """`name`'s checkpoint with the handler tests' byte-level BPE tokenizer and ChatML
    template (as `tests/engine/tiny_models.py` `save_servable_tiny` for the dense models),
    for the real-server architecture test; returns the HF model."""
    from tests.engine.tiny_models import SERVED_VOCAB
    from tests.handlers.handlers_testing import build_tiny_model

    build_tiny_model(directory)  # tokenizer files (and a config.json, replaced below)
    model = hf_reference(name, vocab_size=SERVED_VOCAB)
    model.save_pretrained(directory)
    return model
