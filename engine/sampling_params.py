"""Sampling parameters as they cross from an API worker to the engine core.

A msgspec Struct so that it travels over ZeroMQ as msgpack without a copy into
another type. The serving layer validates ranges and builds one of these; the
engine trusts it.
"""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """What the engine needs to sample and stop one sequence (n is fanned out above)."""

    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 or 0 disables top-k."""
    min_p: float = 0.0
    seed: int | None = None
    """Per-request generator seed; sampling is reproducible for the same seed."""
    max_tokens: int = 16
    min_tokens: int = 0
    """EOS and stop_token_ids are masked until this many tokens were generated."""
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    """None: no logprobs. k >= 0: the sampled token's logprob plus the top k."""
    prompt_logprobs: int | None = None
    """None: none. k >= 0: each prompt token's logprob plus the top k (no prefix-cache hit,
    since cached blocks have nothing to score). max_tokens 0 means prefill only (score)."""
