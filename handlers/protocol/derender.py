"""vLLM's derender routes (`POST /v1/chat/completions/derender`, `/v1/completions/derender`):
the token ids a `/inference/v1/generate` call returned, turned back into the response the
chat or completion route would have given for them.

Why: the third part of the token-in-token-out split. A router renders a chat
(`/v1/chat/completions/render`), runs the token ids anywhere (`/inference/v1/generate`),
and has them made into an OpenAI response here: decoded, the reasoning split off and tool
calls parsed by the same code the chat route runs, when the original request comes along
(`chat_request` / `completion_request`).

Bounds: the body is the caller's, not an engine's, so everything that sizes the work is
bounded before a token is decoded (vLLM's routes decoded whatever they were sent until
PYSEC-2026-3936): choices per response (`max_n`), responses x choices
(`max_sequences_per_request`), top logprobs per token (`max_logprobs`), one logprob entry
per token; the serving side adds the model's context length per choice and its vocabulary
for every id.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from handlers.protocol.base import FieldError, OpenAIBaseModel, limits_from, reject_negative_ids
from handlers.protocol.chat import ChatCompletionRequest
from handlers.protocol.completion import CompletionRequest

_PLACEHOLDER = "token_id:"
"""vLLM's generate route names a logprob's token `token_id:<id>` (it never decodes)."""


class DerenderTopLogprob(OpenAIBaseModel):
    """A token's logprob as a generate response gives it: hearth's `token_id`, or vLLM's
    `token` of the form `token_id:<id>`."""

    token_id: int | None = Field(default=None, ge=0)
    token: str | None = Field(default=None, max_length=64)
    logprob: float
    rank: int | None = None

    @model_validator(mode="after")
    def _named_by_id(self) -> DerenderTopLogprob:
        if self.token_id is None:
            self.token_id = _placeholder_id(self.token)
        return self


def _placeholder_id(token: str | None) -> int:
    if token is not None and token.startswith(_PLACEHOLDER):
        digits = token[len(_PLACEHOLDER) :]
        if digits.isascii() and digits.isdigit():
            return int(digits)
    raise FieldError(
        "token",
        "a logprob must name its token by id: token_id, or token 'token_id:<id>' (the "
        "tokens-mode output of /inference/v1/generate)",
    )


class DerenderLogprob(DerenderTopLogprob):
    top_logprobs: list[DerenderTopLogprob] = Field(default_factory=list)

    @field_validator("top_logprobs")
    @classmethod
    def _bounded(cls, value: list[DerenderTopLogprob], info: ValidationInfo) -> list:
        limit = limits_from(info.context).max_logprobs
        if len(value) > limit:
            raise FieldError(None, f"at most {limit} top logprobs per token, got {len(value)}")
        return value


class DerenderLogprobs(OpenAIBaseModel):
    content: list[DerenderLogprob] | None = None


class DerenderChoice(OpenAIBaseModel):
    """One choice of a generate response: its token ids are what is decoded (a text
    mode's `text` is accepted and not read)."""

    index: int = Field(ge=0)
    token_ids: list[int] = Field(min_length=1)
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    logprobs: DerenderLogprobs | None = None
    text: str | None = None

    @field_validator("token_ids")
    @classmethod
    def _non_negative(cls, value: list[int]) -> list[int]:
        reject_negative_ids(value, message="token_ids must not contain negative values")
        return value

    @model_validator(mode="after")
    def _one_logprob_per_token(self) -> DerenderChoice:
        content = self.logprobs.content if self.logprobs is not None else None
        if content is not None and len(content) != len(self.token_ids):
            raise FieldError(
                "logprobs.content",
                f"one logprob entry per token: {len(self.token_ids)} token ids, "
                f"{len(content)} entries",
            )
        return self


class GeneratedTokens(OpenAIBaseModel):
    """A `/inference/v1/generate` response (non-streaming) as the derender routes take it
    back; its other fields (usage, created, kv_transfer_params, ...) are accepted and not
    read."""

    request_id: str = Field(min_length=1, max_length=256)
    choices: list[DerenderChoice] = Field(min_length=1)
    prompt_token_ids: list[int] | None = None
    usage: dict[str, Any] | None = None

    def prompt_tokens(self) -> int:
        """The prompt's length as this response says it (its `prompt_token_ids`, else its
        usage's `prompt_tokens`), or 0."""
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        count = (self.usage or {}).get("prompt_tokens")
        return count if isinstance(count, int) and count >= 0 else 0

    @field_validator("choices")
    @classmethod
    def _bounded(cls, value: list[DerenderChoice], info: ValidationInfo) -> list:
        limit = limits_from(info.context).max_n
        if len(value) > limit:
            raise FieldError(None, f"at most {limit} choices per response (n), got {len(value)}")
        if len({choice.index for choice in value}) != len(value):
            raise FieldError(None, "each choice needs its own index")
        return value


class _NotStreaming(OpenAIBaseModel):
    stream: bool = False

    @field_validator("stream")
    @classmethod
    def _not_streaming(cls, value: bool) -> bool:
        if value:
            raise FieldError(
                None,
                "streaming derender is not supported: send the complete generate response "
                "with stream false",
            )
        return value


class DerenderChatRequest(_NotStreaming):
    model: str | None = None
    generate_response: GeneratedTokens
    prompt_tokens: int | None = Field(default=None, ge=0)
    """The prompt's length, for usage (else `prompt_token_ids`', else what the generate
    response says of it, else 0; vLLM's is 0 unless given)."""
    prompt_token_ids: list[int] | None = None
    chat_request: ChatCompletionRequest | None = None
    """The chat the tokens answer (what `/v1/chat/completions/render` was given): its
    tools, reasoning switch, stop strings and logprob settings shape the response; without
    it the tokens are only decoded (vLLM's behaviour)."""

    def usage_prompt_tokens(self) -> int:
        if self.prompt_tokens is not None:
            return self.prompt_tokens
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        return self.generate_response.prompt_tokens()


class DerenderCompletionRequest(_NotStreaming):
    model: str | None = None
    generate_responses: list[GeneratedTokens] = Field(min_length=1)
    """One per prompt, in the order `/v1/completions/render` gave their requests."""
    prompt_tokens: list[int] | None = None
    completion_request: CompletionRequest | None = None

    @field_validator("generate_responses")
    @classmethod
    def _bounded(cls, value: list[GeneratedTokens], info: ValidationInfo) -> list:
        limit = limits_from(info.context).max_sequences_per_request
        total = sum(len(response.choices) for response in value)
        if total > limit:
            raise FieldError(None, f"at most {limit} choices in all, got {total}")
        return value

    @model_validator(mode="after")
    def _one_count_per_response(self) -> DerenderCompletionRequest:
        counts = self.prompt_tokens
        if counts is not None and len(counts) != len(self.generate_responses):
            raise FieldError(
                "prompt_tokens",
                f"one count per generate response: {len(self.generate_responses)} "
                f"responses, {len(counts)} counts",
            )
        if counts is not None and any(c < 0 for c in counts):
            raise FieldError("prompt_tokens", "counts must not be negative")
        return self

    def usage_prompt_tokens(self) -> list[int]:
        if self.prompt_tokens is not None:
            return list(self.prompt_tokens)
        return [r.prompt_tokens() for r in self.generate_responses]
