"""The whole engine (scheduler, paged cache, continuous batching, chunked prefill,
preemption, sliding-window block freeing) on tiny checkpoints of each architecture,
greedy output token-identical to transformers' `generate` on the same weights.

The model-level checks (every logit row, mixed steps) are tests/engine/test_llama_parity.py;
these drive `EngineCore` itself, with prompts longer than every sliding window.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.models.llama import layer_windows
from tests.engine.test_greedy_parity import _generate as greedy_outputs
from tests.engine.tiny_models import SERVED_VOCAB, save_servable_tiny
from tests.handlers.handlers_testing import EOS_ID

ARCHS = [
    "qwen3",
    "qwen3-sliding",
    "gemma3",
    "phi3-partial-sliding",
    "smollm3-nope-sliding",
    "mistral-sliding",
    "qwen2-sliding",
]
NEW_TOKENS = 12
PROMPT_LENS = [3, 9, 17, 26, 41, 58]
"""Mixed lengths, most of them past every window of the tiny configs (5 to 8 tokens)."""


class Tiny:
    """One saved tiny checkpoint, its transformers oracle and the oracle's outputs."""

    def __init__(self, name: str, directory: Path) -> None:
        self.name = name
        self.dir = directory
        self.hf = save_servable_tiny(name, directory)
        gen = torch.Generator().manual_seed(13)
        self.prompts = [
            torch.randint(3, SERVED_VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS
        ]
        self.reference = [self._hf_greedy(p) for p in self.prompts]

    @torch.no_grad()
    def _hf_greedy(self, prompt: list[int]) -> list[int]:
        out = self.hf.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=EOS_ID, pad_token_id=EOS_ID,
        )  # fmt: skip
        return out[0, len(prompt) :].tolist()

    def core(self, **overrides: object) -> EngineCore:
        config = EngineConfig(
            model=str(self.dir), dtype="float32", max_model_len=128, block_size=4,
            **overrides,  # type: ignore[arg-type]
        )  # fmt: skip
        return EngineCore(config)


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    return Tiny(request.param, tmp_path_factory.mktemp(request.param))


def _generate(core: EngineCore, prompts: list[list[int]], at_once: bool) -> list[list[int]]:
    """Greedy outputs through `EngineCore.step` (nothing leaked, window-freed or not)."""
    return greedy_outputs(core, prompts, "r", at_once, max_tokens=NEW_TOKENS)


def test_alone_and_in_one_mixed_batch(tiny: Tiny) -> None:
    core = tiny.core()
    assert core.model_info.architecture == type(core.model).__name__
    assert _generate(core, tiny.prompts, at_once=False) == tiny.reference
    assert _generate(core, tiny.prompts, at_once=True) == tiny.reference


def test_chunked_prefill_and_preemption(tiny: Tiny) -> None:
    """A 7-token budget cuts every prompt into chunks between other sequences' decodes;
    a pool of 24 blocks cannot hold the batch, so sequences are preempted and recomputed.
    Models windowed on every layer free the blocks behind the window, which by itself
    lets that pool hold this batch: they get 18 blocks (72 slots; the longest sequence's
    70 tokens still fit) and a 32-token budget (chunks of 32 need 8 blocks at once), and
    are preempted too."""
    windowed = all(layer_windows(tiny.hf.config))
    core = tiny.core(
        max_num_batched_tokens=32 if windowed else 7, num_kv_blocks=18 if windowed else 24,
        enable_prefix_caching=False,
    )  # fmt: skip
    assert (core.model.sliding_window is not None) == windowed
    assert _generate(core, tiny.prompts, at_once=True) == tiny.reference
    assert core.scheduler.num_preemptions > 0
    if windowed:
        assert core.block_manager.num_window_freed_blocks > 0
    else:
        assert core.block_manager.num_window_freed_blocks == 0
