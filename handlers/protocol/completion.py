"""Text completions (`POST /v1/completions`): request, response and stream models."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from engine.sampling_params import SamplingParams
from handlers.protocol.base import (
    ChunkModel,
    FieldError,
    PromptLogprob,
    UsageInfo,
    WireModel,
    limits_from,
    reject_negative_ids,
)
from handlers.protocol.sampling import SamplingBounds, SamplingRequest, resolve_max_tokens

MAX_PROMPTS = 256
"""Prompts in one batched completion request; each one is n engine requests."""

_UNSUPPORTED_COMPLETION_FIELDS = {
    "suffix": "suffix (fill-in-the-middle) is not supported",
    "prompt_embeds": "prompt embeddings are not supported",
    "logits_processors": "custom logits processors are not supported",
}

Prompt = str | list[int]
"""One prompt: text, or token ids."""


def check_prompts(value: Any, max_prompts: int) -> Any:
    """One prompt or a batch, as completion and embeddings take it: a string, a list of
    strings, a list of token ids, or a list of token-id lists (one kind, never empty)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise FieldError(
            None, "must be a string, a list of strings, a list of token ids or a list of lists"
        )
    if not value:
        raise FieldError(None, "must not be empty")
    # One prompt of token ids first: its length is bounded by the context, not by
    # the prompt count.
    if all(isinstance(p, int) and not isinstance(p, bool) for p in value):
        reject_negative_ids(value)
        return value
    if len(value) > max_prompts:
        raise FieldError(None, f"at most {max_prompts} prompts per request")
    if all(isinstance(p, str) for p in value):
        return value
    if all(isinstance(p, list) for p in value):
        for i, ids in enumerate(value):
            if not ids:
                raise FieldError(i, "token id lists must not be empty")
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise FieldError(i, "token ids must be integers >= 0")
        return value
    raise FieldError(None, "mixes strings, token ids and lists; use one kind")


def prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    """A validated prompt field as a list: one entry per prompt (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


class CompletionRequest(SamplingRequest):
    """OpenAI's legacy completion request plus vLLM's extras; see docs/api.md."""

    unsupported_fields: ClassVar[Mapping[str, str]] = _UNSUPPORTED_COMPLETION_FIELDS

    prompt: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    max_tokens: int | None = Field(default=16, ge=0)
    """OpenAI's default of 16; null fills the context (vLLM); 0 with echo scores the prompt."""
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0)
    best_of: int | None = Field(default=None, ge=1)
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        return check_prompts(value, MAX_PROMPTS)

    @model_validator(mode="after")
    def _check_completion(self, info: ValidationInfo) -> CompletionRequest:
        limits = limits_from(info.context)
        if self.logprobs is not None and self.logprobs > limits.max_logprobs:
            raise FieldError("logprobs", f"logprobs must be at most {limits.max_logprobs}")
        if self.best_of is not None and self.best_of != self.n:
            raise FieldError("best_of", "best_of other than n is not supported")
        num_sequences = len(self.prompts()) * self.n
        if num_sequences > limits.max_sequences_per_request:
            raise FieldError(
                "n",
                f"prompts x n is {num_sequences}; at most {limits.max_sequences_per_request} "
                "sequences per request",
            )
        if self.max_tokens == 0 and not self.echo:
            raise FieldError(
                "max_tokens",
                "max_tokens must be at least 1 (0 only with echo, to score the prompt)",
            )
        return self

    @property
    def echo_logprobs(self) -> bool:
        """The echoed prompt's tokens come with their logprobs (lm-evaluation-harness)."""
        return self.echo and self.logprobs is not None

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """Prompt alternatives the engine computes: vLLM's `prompt_logprobs`, else `logprobs`
        when the prompt is echoed with logprobs. None when nothing would show them (a
        stream never carries `prompt_logprobs`), so the prefix cache stays usable."""
        if self.prompt_logprobs is not None and (self.echo_logprobs or not self.stream):
            return self.prompt_logprobs
        return self.logprobs if self.echo_logprobs else None

    def prompts(self) -> list[Prompt]:
        """The batch as a list: one entry per prompt (text or token ids)."""
        return prompt_list(self.prompt)

    def to_sampling_params(self, bounds: SamplingBounds) -> SamplingParams:
        max_tokens = resolve_max_tokens(
            self.max_tokens,
            param="max_tokens",
            prompt_len=bounds.prompt_len,
            max_model_len=bounds.max_model_len,
        )
        return self.build_sampling_params(
            max_tokens=max_tokens,
            bounds=bounds,
            logprobs=self.logprobs,
            prompt_logprobs=self.engine_prompt_logprobs,
        )


# -- responses ------------------------------------------------------------------------
class CompletionLogProbs(WireModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(WireModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    """vLLM, with `return_token_ids`: the generated token ids (a stop token included)."""
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    """vLLM: per prompt token (the first is null), `{token_id: {logprob, rank,
    decoded_token}}` for the token itself and the top k; null unless asked for."""
    prompt_token_ids: list[int] | None = None
    """vLLM, with `return_token_ids`: the prompt's token ids (after any truncation)."""


class CompletionResponse(WireModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(WireModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    """vLLM, with `return_token_ids`: in a choice's first chunk only."""
    token_ids: list[int] | None = None
    """vLLM, with `return_token_ids`: this chunk's generated token ids."""


class CompletionStreamResponse(ChunkModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None
