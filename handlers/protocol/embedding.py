"""Embeddings (`POST /v1/embeddings`) and vLLM's `POST /pooling`: request and response
models (OpenAI's, plus vLLM's extras: chat-style `messages`, `embed_dtype`,
`endianness`, `use_activation`, ...); see docs/api.md."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from handlers.protocol.base import (
    ACTIVATION_ALIASES,
    FieldError,
    OpenAIBaseModel,
    PooledListResponse,
    TruncatePromptTokens,
    TruncationSide,
    WireModel,
    limits_from,
)
from handlers.protocol.chat import MessagesField, check_template_flags
from handlers.protocol.completion import Prompt, check_prompts, prompt_list
from handlers.protocol.sampling import INT64_MAX

EmbedDType = Literal["float32", "float16", "bfloat16"]
"""vLLM's `embed_dtype` values hearth encodes (its fp8 ones are refused): the element type
of a base64 vector."""
Endianness = Literal["native", "little", "big"]
"""vLLM's `endianness` of a base64 vector's elements ("native": this host's)."""


class PooledInputRequest(OpenAIBaseModel):
    """What vLLM's pooling requests (embeddings, /pooling, /classify) share: either
    `input` (one text, a list of texts, one list of token ids or a list of them, one
    kind; each is one engine request) or `messages` (one conversation rendered by the
    chat template, one engine request), and how to tokenize and schedule them."""

    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: MessagesField | None = None
    """vLLM's chat-style input: rendered like /tokenize renders it (no generation prompt
    by default), then pooled as one text."""
    model: str | None = None
    use_activation: bool | None = Field(default=None, validation_alias=ACTIVATION_ALIASES)
    """vLLM's: embeddings: false returns the pooled vector unnormalised, true normalises
    it (None: the model's own choice); classification: false returns the raw logits.
    vLLM's earlier spellings (`normalize`, `activation`, `softmax`) mean the same."""
    user: str | None = None
    add_special_tokens: bool | None = None
    """Default: true for `input`, false for `messages` (the template adds them)."""
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int = Field(default=0, ge=-INT64_MAX - 1, le=INT64_MAX)
    """Lower runs first under --scheduling-policy priority."""
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    """vLLM: pool each input's last k tokens only (-1: the context length)."""
    truncation_side: TruncationSide | None = None
    """vLLM: "right" keeps an input's first k tokens instead."""
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    """vLLM: prefix-cache blocks are shared only with requests of the same salt."""

    # What the chat-template renderer (`handlers.serving.render`) reads besides the above.
    tools: ClassVar[None] = None
    reasoning_effort: ClassVar[None] = None

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return value
        return check_prompts(value, limits_from(info.context).max_sequences_per_request)

    @model_validator(mode="after")
    def _one_input_kind(self) -> PooledInputRequest:
        if (self.input is None) == (self.messages is None):
            raise FieldError(
                "input" if self.input is None else "messages",
                "send either input (texts or token ids) or messages (one conversation)",
            )
        if self.input is not None:
            for name in ("add_generation_prompt", "continue_final_message"):
                if getattr(self, name):
                    raise FieldError(name, f"{name} applies to messages, not to input")
            for name in ("chat_template", "chat_template_kwargs"):
                if getattr(self, name) is not None:
                    raise FieldError(name, f"{name} applies to messages, not to input")
        check_template_flags(self.continue_final_message, self.add_generation_prompt)
        return self

    def inputs(self) -> list[Prompt]:
        """The batch as a list: one entry per input (text or token ids); [] for messages."""
        return prompt_list(self.input) if self.input is not None else []

    @property
    def special_tokens(self) -> bool:
        """Whether the tokenizer adds its special tokens (see `add_special_tokens`)."""
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.messages is None


class EmbeddingRequest(PooledInputRequest):
    """OpenAI's embedding request plus vLLM's extras (`messages`, `embed_dtype`,
    `endianness`, `use_activation`, ...)."""

    encoding_format: Literal["float", "base64"] = "float"
    """'float': a JSON array of numbers; 'base64': the values as bytes (`embed_dtype`,
    `endianness`), base64-encoded (what the openai SDK asks for by default)."""
    embed_dtype: EmbedDType = "float32"
    """vLLM's: the element type of a base64 vector (a float one is always float32)."""
    endianness: Endianness = "native"
    """vLLM's: the byte order of a base64 vector's elements."""
    dimensions: int | None = Field(default=None, ge=1)
    """Keep the first `dimensions` values (Matryoshka models only), then normalise."""

    @field_validator("embed_dtype", mode="before")
    @classmethod
    def _check_embed_dtype(cls, value: Any) -> Any:
        if isinstance(value, str) and value.startswith("fp8"):
            raise FieldError(None, f"{value} is not supported; use float32, float16 or bfloat16")
        return value


POOLING_TASKS = ("embed", "token_embed", "classify", "token_classify", "score", "plugin")
"""vLLM's pooling tasks; hearth's pooled vector is the "embed" one."""


class PoolingRequest(EmbeddingRequest):
    """vLLM's `/pooling` request: an embedding request whose answer is vLLM's pooling
    shape; `task` may only be "embed" (hearth has no token-level heads, and serves a
    classifier's answers on /classify)."""

    task: Literal["embed"] | None = None

    @field_validator("task", mode="before")
    @classmethod
    def _check_task(cls, value: Any) -> Any:
        if isinstance(value, str) and value != "embed" and value in POOLING_TASKS:
            raise FieldError(
                None,
                f"task {value!r} is not supported: this route pools one vector per input "
                "(task 'embed'); a sequence classifier answers on /classify",
            )
        return value


class EmbeddingData(WireModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    """The vector, or its base64 form (`encoding_format: base64`)."""


class EmbeddingResponse(PooledListResponse):
    data: list[EmbeddingData]


class PoolingData(WireModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str
    """The vector, or its base64 form (`encoding_format: base64`)."""


class PoolingResponse(PooledListResponse):
    data: list[PoolingData]


class ClassificationRequest(PooledInputRequest):
    """vLLM's `/classify` request: each input's class probabilities from a sequence
    classifier."""


class ClassificationData(WireModel):
    index: int
    label: str | None
    """The most probable class's name (`id2label`), None where the model names none."""
    probs: list[float]
    """Each class's probability (softmax; sigmoid for one label or a multi-label
    model; the raw logits with `use_activation: false` or a regression model)."""
    num_classes: int


class ClassificationResponse(PooledListResponse):
    data: list[ClassificationData]
