"""Helpers of the tests that compare two engines token for token: greedy runs with their
logprobs, and the packed weights of two fast-path models."""

from __future__ import annotations

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
