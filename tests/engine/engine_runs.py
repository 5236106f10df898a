"""Helpers of the tests that compare two engines token for token: greedy runs with their
logprobs, the packed weights of two fast-path models, and the blocks core whose sums are
the exact model's up to float32 order on every host."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.core import EngineCore
from engine.layers.linear import Linear
from engine.messages import AddRequest
from engine.sampling_params import SamplingParams


def greedy_runs(
    core: EngineCore, prompts: list[list[int]], new_tokens: int
) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs of each prompt, all prompts in one batch; no KV
    block is left held."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=1)
    for i, ids in enumerate(prompts):
        core.add_request(AddRequest(request_id=f"r{i}", prompt_token_ids=ids, params=params))
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    while core.has_work():
        for _, out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            logprobs.setdefault(out.request_id, []).extend(
                lp.logprob for lp in out.new_logprobs or []
            )
    assert core.block_manager.num_used_blocks == 0
    return [(tokens[f"r{i}"], logprobs[f"r{i}"]) for i in range(len(prompts))]


def assert_same_packing(a: EngineCore, b: EngineCore) -> None:
    """Both models' linears hold the same packed bytes, layer for layer."""
    pairs = zip(
        [m for m in a.model.modules() if isinstance(m, Linear)],
        [m for m in b.model.modules() if isinstance(m, Linear)],
        strict=True,
    )
    for mine, theirs in pairs:
        assert torch.equal(mine.packed.data, theirs.packed.data)


def blocks_core(make: Callable[..., EngineCore], **overrides) -> EngineCore:
    """The model on its packed blocks with float32 activations (`--quantization gguf`,
    the mode that is the exact model up to float32 sum order), after checking that the
    default (`auto`) puts it on the kernels in this host's mode: `gguf` itself, or
    `gguf-bf16` where bfloat16 kernels run (AMX, AVX512-BF16), whose bfloat16 activations a
    float32-order tolerance does not cover. `make(**overrides)` builds a core."""
    from engine.backends import auto_gguf_mode

    default = make(**overrides)
    assert default.backends.quantization == auto_gguf_mode()
    if auto_gguf_mode() == "gguf":
        return default
    return make(quantization="gguf", **overrides)
