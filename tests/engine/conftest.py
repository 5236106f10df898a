"""Fixtures the engine tests share: the greedy reference is transformers' `generate` on
SmolLM2 (~18 s on a 2-vCPU host), computed once per session for the exact, fast and tiled
paths' tests alike."""

from __future__ import annotations

import pytest

from engine.tokenizer import Tokenizer
from tests.engine.greedy_cases import CHATS, NEW_TOKENS
from tests.lora_adapters import greedy_continuations


@pytest.fixture(scope="session")
def prompts(model_smollm2_dir: str) -> list[list[int]]:
    tok = Tokenizer(model_smollm2_dir)
    return [tok.encode(tok.apply_chat_template(c), add_special_tokens=False) for c in CHATS]


@pytest.fixture(scope="session")
def reference(smollm2_hf_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32)
    return greedy_continuations(model.eval(), prompts, NEW_TOKENS, pad_token_id=2)
