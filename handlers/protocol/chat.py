"""Chat completions (`POST /v1/chat/completions`): request, response and chunk models."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, ValidationInfo, field_validator, model_validator

from engine.sampling_params import SamplingParams, StructuredOutputSpec
from handlers.errors import BadRequestError
from handlers.protocol.base import (
    ChunkModel,
    FieldError,
    OpenAIBaseModel,
    PromptLogprob,
    ReasoningEffort,
    RequestLimits,
    UsageInfo,
    WireModel,
    limits_from,
    parse_request,
    reject_negative_ids,
)
from handlers.protocol.json_schema import check_json_schema, schema_text
from handlers.protocol.sampling import (
    MAX_LOGPROB_TOKEN_IDS,
    SamplingBounds,
    SamplingRequest,
    resolve_max_tokens,
)

Role = Literal["system", "developer", "user", "assistant", "tool"]

# The chat request's SamplingRequest.unsupported_fields (why they are a 400: see there).
_UNSUPPORTED_CHAT_FIELDS = {
    "functions": "the deprecated functions parameter is not supported; use tools",
    "function_call": "the deprecated function_call parameter is not supported; use tool_choice",
    "audio": "audio output is not supported",
    "logits_processors": "custom logits processors are not supported",
}


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(OpenAIBaseModel):
    name: str
    arguments: str


class ToolCallParam(OpenAIBaseModel):
    """A tool call of an earlier assistant turn (rendered by the template, never parsed)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessageParam(OpenAIBaseModel):
    role: Role
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for i, part in enumerate(value):
                if not isinstance(part, dict):
                    raise FieldError(i, "content parts must be objects")
                kind = part.get("type")
                if kind != "text":
                    raise FieldError(
                        (i, "type"),
                        f"content part type {kind!r} is not supported; only 'text' parts are",
                    )
        elif value is not None and not isinstance(value, str):
            raise FieldError(None, "must be a string or a list of text parts")
        return value

    @model_validator(mode="after")
    def _check_role_fields(self) -> ChatMessageParam:
        if self.role == "tool" and not self.tool_call_id:
            raise FieldError("tool_call_id", "tool messages need a tool_call_id")
        if self.content is None and self.role != "assistant":
            raise FieldError("content", f"{self.role} messages need content")
        return self

    def text(self) -> str | None:
        """The content as one string: text parts joined by newlines (vLLM's string format)."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: content always a string. An assistant
        turn that only calls tools (`content: null`, as the OpenAI SDK sends it) gets "",
        as in vLLM: templates concatenate content, and None would fail to render."""
        message: dict[str, Any] = {"role": self.role, "content": self.text() or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


MAX_MESSAGES = 4096
"""Messages in one request. Unbounded, a 6 MB body of 200,000 messages cost ~1.1 s of
validation and ~0.8 s of template rendering on the event loop before any size cap."""
MAX_CONTENT_PARTS = 4096
"""Content parts and tool calls over all messages of one request."""


def cap_messages(value: Any) -> Any:
    """Counted on the raw list, before a single message is validated."""
    if not isinstance(value, list):
        return value
    if len(value) > MAX_MESSAGES:
        raise FieldError(None, f"at most {MAX_MESSAGES} messages are allowed, got {len(value)}")
    parts = 0
    for message in value:
        if isinstance(message, dict):
            for key in ("content", "tool_calls"):
                items = message.get(key)
                if isinstance(items, list):
                    parts += len(items)
    if parts > MAX_CONTENT_PARTS:
        raise FieldError(
            None,
            f"at most {MAX_CONTENT_PARTS} content parts and tool calls are allowed over all "
            f"messages, got {parts}",
        )
    return value


MessagesField = Annotated[
    list[ChatMessageParam], BeforeValidator(cap_messages), Field(min_length=1)
]
"""`messages` of chat and of /tokenize, capped in count."""

MAX_TOOLS = 128
"""Tools in one request; their definitions are rendered into every prompt."""


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _check_parameters(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            check_json_schema(value)
            schema_text(value)
        return value


class ChatToolParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


def check_template_flags(continue_final_message: bool, add_generation_prompt: bool) -> None:
    """The one rule on the chat template flags, for every request that renders messages
    (chat and /tokenize): continuing the last message and opening a new turn exclude
    each other."""
    if continue_final_message and add_generation_prompt:
        raise FieldError(
            "continue_final_message",
            "continue_final_message and add_generation_prompt cannot both be true",
        )


class ChatCompletionRequest(SamplingRequest):
    """OpenAI's chat request plus vLLM's extras; see docs/api.md for every field."""

    unsupported_fields: ClassVar[Mapping[str, str]] = _UNSUPPORTED_CHAT_FIELDS

    messages: MessagesField
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    return_prompt_text: bool = False
    """vLLM's: answer with `prompt_text`, the prompt the chat template rendered (a
    stream sends it in its first chunk)."""
    logprob_token_ids: list[int] | None = Field(default=None, max_length=MAX_LOGPROB_TOKEN_IDS)
    """vLLM's: with `logprobs`, each generated position's top_logprobs are these ids'
    (in this order) instead of the most likely ones."""
    tools: list[ChatToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """None: 'auto' when tools are given, else 'none' (OpenAI's default)."""
    parallel_tool_calls: bool | None = None
    echo: bool = False
    """vLLM: prepend the last message's content when it has the response role."""
    reasoning_effort: ReasoningEffort | None = None
    """vLLM: given to the chat template as `reasoning_effort` (templates that know it, such
    as gpt-oss's, use it; a `chat_template_kwargs` entry of that name wins)."""
    include_reasoning: bool = True
    """vLLM: false leaves the reasoning out of the answer (`reasoning_content` null,
    and no reasoning deltas streamed); the model still reasons."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_tool_choice(cls, value: Any) -> Any:
        if value is None or value in ("none", "auto", "required") or isinstance(value, dict):
            return value
        raise FieldError(None, "must be 'none', 'auto', 'required' or a named tool")

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, value: list[ChatToolParam] | None) -> list[ChatToolParam] | None:
        if value is None:
            return None
        if len(value) > MAX_TOOLS:
            raise FieldError(None, f"at most {MAX_TOOLS} tools are allowed, got {len(value)}")
        names = [t.function.name for t in value]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise FieldError((i, "function", "name"), f"tool name {name!r} is used twice")
        schema_text([t.function.parameters for t in value])
        return value

    @property
    def effective_tool_choice(self) -> str:
        """'none', 'auto', 'required' or 'named' (see `named_tool`)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    @property
    def named_tool(self) -> ChatToolParam | None:
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        name = self.tool_choice.function.name
        return next(t for t in self.tools or () if t.function.name == name)

    @model_validator(mode="after")
    def _check_chat(self, info: ValidationInfo) -> ChatCompletionRequest:
        limits = limits_from(info.context)
        if self.top_logprobs is not None:
            if self.top_logprobs > limits.max_logprobs:
                raise FieldError(
                    "top_logprobs", f"top_logprobs must be at most {limits.max_logprobs}"
                )
            if not self.logprobs:
                raise FieldError(
                    "top_logprobs", "when using top_logprobs, logprobs must be set to true"
                )
        if self.logprob_token_ids:
            if not self.logprobs:
                raise FieldError(
                    "logprob_token_ids",
                    "when using logprob_token_ids, logprobs must be set to true",
                )
            reject_negative_ids(self.logprob_token_ids, "logprob_token_ids")
        check_template_flags(self.continue_final_message, self.add_generation_prompt)
        self._check_tool_choice_fits()
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise FieldError(
                "continue_final_message", "continue_final_message needs a final assistant message"
            )
        return self

    def _check_tool_choice_fits(self) -> None:
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise FieldError("tool_choice", "tool_choice is only allowed when tools are given")
        is_forced = choice == "required" or isinstance(choice, NamedToolChoice)
        if is_forced and self._constraint_fields():
            raise FieldError(
                "tool_choice",
                "a forced tool call cannot be combined with another output constraint",
            )
        if isinstance(choice, NamedToolChoice):
            name = choice.function.name
            if all(t.function.name != name for t in self.tools or ()):
                raise FieldError(
                    ("tool_choice", "function", "name"), f"tool {name!r} is not among the tools"
                )

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(value, parameter name): max_completion_tokens wins over the deprecated max_tokens."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def to_sampling_params(
        self, bounds: SamplingBounds, structured: StructuredOutputSpec | None = None
    ) -> SamplingParams:
        """`structured`: a forced tool call's constraint (it replaces response_format)."""
        requested, param = self.requested_max_tokens
        max_tokens = resolve_max_tokens(
            requested,
            param=param,
            prompt_len=bounds.prompt_len,
            max_model_len=bounds.max_model_len,
            default=bounds.defaults.get("max_tokens"),
        )
        return self.build_sampling_params(
            max_tokens=max_tokens,
            bounds=bounds,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            logprob_token_ids=self.logprob_token_ids or None,
            structured=structured,
            # A stream never carries prompt_logprobs (0 is all a stream may ask for).
            prompt_logprobs=None if self.stream else self.prompt_logprobs,
        )


# -- responses ------------------------------------------------------------------------
class ChatCompletionLogProb(WireModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(WireModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class FunctionCall(WireModel):
    name: str
    arguments: str
    """The arguments as JSON text, as OpenAI sends them."""


class ToolCall(WireModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(WireModel):
    role: str
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(WireModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    """vLLM: the stop string or stop token id that ended the choice (None for EOS/length)."""
    token_ids: list[int] | None = None
    """vLLM, with `return_token_ids`: the generated token ids (a stop token included)."""


class ChatCompletionResponse(WireModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    """vLLM: the rendered prompt's tokens with their logprobs (see CompletionResponseChoice)."""
    prompt_token_ids: list[int] | None = None
    """vLLM, with `return_token_ids`: the rendered prompt's token ids."""
    prompt_text: str | None = None
    """vLLM, with `return_prompt_text`: the prompt the chat template rendered."""


class DeltaFunctionCall(WireModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(WireModel):
    """One fragment of a streamed tool call: the first carries id, type and name; later
    ones only argument text, joined by `index` (OpenAI's stream format)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(WireModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionChunkChoice(WireModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    """vLLM, with `return_token_ids`: this chunk's generated token ids."""


class ChatCompletionChunk(ChunkModel):
    """One SSE event of a chat stream (serialized with exclude_unset, like vLLM)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    """vLLM, with `return_token_ids`: in the stream's first chunk only."""
    prompt_text: str | None = None
    """vLLM, with `return_prompt_text`: in the stream's first chunk only."""


def parse_batch_chat(data: Any, limits: RequestLimits) -> list[ChatCompletionRequest]:
    """vLLM's `/v1/chat/completions/batch` body: a chat request whose `messages` is a
    list of conversations, each answered as its own choice. Every conversation is
    validated as a chat request with the shared fields (so every chat rule applies),
    and an error inside one is reported under `messages[i]`. Like vLLM's: no streaming,
    no tools, n = 1."""
    if not isinstance(data, dict):
        return [parse_request(ChatCompletionRequest, data, limits)]  # the body-type 400
    conversations = data.get("messages")
    if not isinstance(conversations, list) or not conversations:
        raise BadRequestError(
            "messages: must be a non-empty list of conversations (each a list of messages)",
            param="messages",
        )
    if len(conversations) > limits.max_sequences_per_request:
        raise BadRequestError(
            f"messages: at most {limits.max_sequences_per_request} conversations per request",
            param="messages",
        )
    for name, allowed in (("stream", (None, False)), ("n", (None, 1))):
        if data.get(name) not in allowed:
            raise BadRequestError(
                f"{name}: the batch endpoint answers each conversation once, unstreamed; "
                "use /v1/chat/completions",
                param=name,
            )
    for name in ("tools", "tool_choice", "functions"):
        if data.get(name) not in (None, [], "none"):
            raise BadRequestError(
                f"{name}: tool calling is not supported on the batch endpoint; use "
                "/v1/chat/completions",
                param=name,
            )
    requests = []
    for i, conversation in enumerate(conversations):
        if not isinstance(conversation, list):
            raise BadRequestError(
                f"messages[{i}]: must be a list of messages (a conversation)",
                param=f"messages[{i}]",
            )
        try:
            requests.append(
                parse_request(ChatCompletionRequest, {**data, "messages": conversation}, limits)
            )
        except BadRequestError as exc:
            if exc.param is not None and exc.param.startswith("messages"):
                param = f"messages[{i}]" + exc.param[len("messages") :]
                message = exc.message.replace(exc.param, param, 1)
                raise BadRequestError(message, param=param) from None
            raise
    return requests
