"""Embeddings (`POST /v1/embeddings`): request and response models (OpenAI's, plus vLLM's
extras `add_special_tokens`, `priority` and `request_id`); see docs/api.md."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from handlers.protocol.base import (
    OpenAIBaseModel,
    TruncatePromptTokens,
    TruncationSide,
    UsageInfo,
    WireModel,
    limits_from,
    reject_unsupported,
)
from handlers.protocol.completion import Prompt, check_prompts, prompt_list
from handlers.protocol.sampling import INT64_MAX

_UNSUPPORTED_EMBEDDING_FIELDS: Mapping[str, str] = {
    "messages": "chat-style embedding input (messages) is not supported; send input",
}


class EmbeddingRequest(OpenAIBaseModel):
    """OpenAI's embedding request. `input` is one text, a list of texts, one list of
    token ids or a list of them (one kind); each is one engine request."""

    unsupported_fields: ClassVar[Mapping[str, str]] = _UNSUPPORTED_EMBEDDING_FIELDS

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    """'float': a JSON array of numbers; 'base64': the float32 values, little endian,
    base64-encoded (what the openai SDK asks for by default)."""
    dimensions: int | None = Field(default=None, ge=1)
    """Keep the first `dimensions` values (Matryoshka models only), then normalise."""
    user: str | None = None
    add_special_tokens: bool = True
    priority: int = Field(default=0, ge=-INT64_MAX - 1, le=INT64_MAX)
    """Lower runs first under --scheduling-policy priority."""
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    """vLLM: embed each input's last k tokens only (-1: the context length)."""
    truncation_side: TruncationSide | None = None
    """vLLM: "right" keeps an input's first k tokens instead."""
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    """vLLM: prefix-cache blocks are shared only with requests of the same salt."""

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        reject_unsupported(data, cls.unsupported_fields)
        return data

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, value: Any, info: ValidationInfo) -> Any:
        return check_prompts(value, limits_from(info.context).max_sequences_per_request)

    def inputs(self) -> list[Prompt]:
        """The batch as a list: one entry per input (text or token ids)."""
        return prompt_list(self.input)


class EmbeddingData(WireModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    """The vector, or its base64 form (`encoding_format: base64`)."""


class EmbeddingResponse(WireModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo
    """prompt_tokens (= total_tokens): every input's tokens; completion_tokens is 0."""
