"""`POST /tokenize` and `POST /detokenize` (vLLM's shapes)."""

from __future__ import annotations

from typing import Any

from pydantic import field_validator, model_validator

from handlers.protocol.base import (
    OpenAIBaseModel,
    ReasoningEffort,
    WireModel,
    reject_negative_ids,
)
from handlers.protocol.chat import ChatToolParam, MessagesField, check_template_flags


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIBaseModel):
    """Renders `messages` with the same chat template path as /v1/chat/completions."""

    model: str | None = None
    messages: MessagesField
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatToolParam] | None = None
    reasoning_effort: ReasoningEffort | None = None
    """As for chat: rendered the same way."""

    @model_validator(mode="after")
    def _check_flags(self) -> TokenizeChatRequest:
        check_template_flags(self.continue_final_message, self.add_generation_prompt)
        return self


class TokenizeResponse(WireModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]

    @field_validator("tokens")
    @classmethod
    def _non_negative(cls, value: list[int]) -> list[int]:
        reject_negative_ids(value)
        return value


class DetokenizeResponse(WireModel):
    prompt: str
