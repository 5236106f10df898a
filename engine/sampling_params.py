"""Sampling parameters as they cross from an API worker to the engine core.

A msgspec Struct so that it travels over ZeroMQ as msgpack without a copy into
another type. The serving layer owns every request rule (ranges, vocabulary, prompt
length: docs/architecture.md, "Where each rule lives") and builds one of these; the
engine trusts it, and re-checks only what would crash the core on a malformed message
(`engine/core.py` `_validate`).
"""

from __future__ import annotations

import msgspec


class StructuredOutputSpec(msgspec.Struct, omit_defaults=True, kw_only=True, frozen=True):
    """One decoding constraint, as the serving layer resolved it from the request.

    The engine compiles it (once per distinct spec and tokenizer) and masks the logits
    of this sequence so that the output always matches it.
    """

    kind: str
    """'json' (a JSON schema), 'json_object' (any JSON object), 'regex', 'choice'
    (one of several strings), 'grammar' (EBNF/GBNF) or 'structural_tag' (xgrammar's
    structural tag: free text whose tagged spans match their schemas)."""
    value: str = ""
    """The schema as JSON text, the regex, the grammar, the choices as a JSON list, or
    the structural tag as JSON text (xgrammar's format)."""
    any_whitespace: bool = False
    """JSON only: allow free whitespace between tokens (off: compact JSON, which small
    models cannot fill with runs of blank lines)."""
    separators: tuple[str, str] | None = None
    """JSON only, without any_whitespace: the item and key separators; None is
    xgrammar's one-line default (", " and ": "); (",", ":") means no whitespace at all."""
    param: str = ""
    """The request field the constraint came from, named in the 400 if it fails to compile."""


class ThinkingBudget(msgspec.Struct, kw_only=True, frozen=True):
    """vLLM's `thinking_token_budget`: at most `budget` tokens inside a reasoning block;
    when a block reaches it, `end_ids` (the block's closing tag) are forced, one token a
    step (engine/thinking_budget.py)."""

    budget: int
    start_ids: list[int]
    """The opening tag's token ids (`<think>`; harmony: `<|channel|>analysis<|message|>`)."""
    end_ids: list[int]
    """The closing tag's token ids (`</think>`; harmony: `<|end|>`)."""
    forced_ids: list[int] = msgspec.field(default_factory=list)
    """What is forced at the budget when it is more than the closing tag (harmony: the
    `<|end|>` and the header of the final answer, `<|start|>assistant<|channel|>final
    <|message|>`, so the model answers instead of opening another analysis message);
    empty: `end_ids`."""


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
    allowed_token_ids: list[int] | None = None
    """vLLM's: only these ids can be sampled (every other logit is -inf after the
    penalties and the bias); None: any."""
    bad_words_token_ids: list[list[int]] | None = None
    """vLLM's `bad_words`, tokenized: a sequence's last id is banned wherever the
    generated tokens end with the ids before it (a one-id sequence: always)."""
    logprobs: int | None = None
    """None: no logprobs. k >= 0: the sampled token's logprob plus the top k."""
    logprob_token_ids: list[int] | None = None
    """vLLM's: with `logprobs`, these ids' logprobs (in this order) instead of the top k."""
    structured: StructuredOutputSpec | None = None
    """A grammar the output must match (structured outputs, forced tool calls)."""
    thinking: ThinkingBudget | None = None
    """A cap on reasoning tokens (None: none)."""
    prompt_logprobs: int | None = None
    """None: none. k >= 0: each prompt token's logprob plus the top k (no prefix-cache hit,
    since cached blocks have nothing to score). max_tokens 0 means prefill only (score)."""
