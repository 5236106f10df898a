"""OpenAI Responses API (`POST /v1/responses`): request, response object and stream events.

The request is validated here with its own field names (`input[2].call_id`, `text.format`),
so a 400 names what the client sent; the serving layer then translates it into a chat
request (`handlers/serving/responses_input.py`) and runs the chat path. Only function
tools exist on this server: hosted tools (web search, file search, MCP, ...) are a 400.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from handlers.protocol.base import FieldError, OpenAIBaseModel, WireModel, reject_unsupported
from handlers.protocol.chat import (
    MAX_MESSAGES,
    MAX_TOOLS,
    ChatCompletionLogProbsContent,
    FunctionDefinition,
)
from handlers.protocol.sampling import INT64_MAX
from handlers.protocol.structured import JsonSchemaFormat

# Parameters that would change the output if honoured and that this server cannot honour
# (SamplingRequest.unsupported_fields explains why they are a 400, not ignored).
_UNSUPPORTED_FIELDS = {
    "conversation": "conversations are not supported; chain responses with previous_response_id",
    "prompt": "prompt templates are not supported; send the input itself",
    "context_management": "context_management is not supported",
}


OUTPUT_LOGPROBS = "message.output_text.logprobs"
"""The `include` value that asks for the output text's logprobs."""


# -- input items ----------------------------------------------------------------------
class InputTextPart(OpenAIBaseModel):
    """A text part of a message: `input_text` (user turns), `output_text` / `refusal`
    (assistant turns replayed from an earlier response's output)."""

    type: Literal["input_text", "output_text", "refusal", "text"]
    text: str | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _has_text(self) -> InputTextPart:
        if self.type == "refusal":
            if self.refusal is None:
                raise FieldError("refusal", "a refusal part needs refusal")
        elif self.text is None:
            raise FieldError("text", f"a {self.type} part needs text")
        return self

    def as_text(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


_TEXT_PART_TYPES = ("input_text", "output_text", "refusal", "text")


def _text_parts_only(value: Any) -> Any:
    if isinstance(value, list):
        for i, part in enumerate(value):
            if not isinstance(part, dict):
                raise FieldError(i, "content parts must be objects")
            kind = part.get("type")
            if kind not in _TEXT_PART_TYPES:
                raise FieldError(
                    (i, "type"),
                    f"content part type {kind!r} is not supported; only text parts "
                    "(input_text, output_text, refusal) are",
                )
    elif not isinstance(value, str):
        raise FieldError(None, "must be a string or a list of content parts")
    return value


TextContent = Annotated[str | list[InputTextPart], BeforeValidator(_text_parts_only)]


def content_text(content: str | list[InputTextPart]) -> str:
    """Text parts joined by newlines, as chat joins its text parts."""
    if isinstance(content, str):
        return content
    return "\n".join(part.as_text() for part in content)


class MessageItem(OpenAIBaseModel):
    """`{"role", "content"}` with or without `type: "message"` (EasyInputMessage)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: TextContent
    id: str | None = None
    status: str | None = None


class FunctionCallItem(OpenAIBaseModel):
    """A tool call of an earlier turn (usually replayed from a response's output)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(OpenAIBaseModel):
    """The result the client computed for a call."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: TextContent
    id: str | None = None
    status: str | None = None


class ReasoningInputItem(OpenAIBaseModel):
    """Reasoning of an earlier turn: accepted and left out of the prompt (chat templates
    drop earlier turns' reasoning too)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None


def _item_tag(value: Any) -> str | None:
    """The union member of one input item: by `type`, a message when it has none. The
    tags contain a '-' so that they never show up in a 400's `param` (see
    `handlers.protocol.base._clean_loc`)."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return _ITEM_TAGS.get(kind) if isinstance(kind, str) else None


_ITEM_TAGS = {
    "message": "message-item",
    "function_call": "function-call-item",
    "function_call_output": "function-call-output-item",
    "reasoning": "reasoning-item",
}

InputItem = Annotated[
    Annotated[MessageItem, Tag("message-item")]
    | Annotated[FunctionCallItem, Tag("function-call-item")]
    | Annotated[FunctionCallOutputItem, Tag("function-call-output-item")]
    | Annotated[ReasoningInputItem, Tag("reasoning-item")],
    Discriminator(_item_tag),
]


def _check_input(value: Any) -> Any:
    """Shape and item types checked on the raw value, so an unknown item type is a 400
    naming `input[i].type` (not "matches none of four models")."""
    if isinstance(value, str):
        if not value:
            raise FieldError(None, "input must not be empty")
        return value
    if not isinstance(value, list):
        raise FieldError(None, "must be a string or a list of input items")
    if not value:
        raise FieldError(None, "input must not be empty")
    if len(value) > MAX_MESSAGES:
        raise FieldError(None, f"at most {MAX_MESSAGES} input items are allowed, got {len(value)}")
    for i, raw in enumerate(value):
        if not isinstance(raw, dict):
            raise FieldError(i, "input items must be objects")
        if _item_tag(raw) is None:
            raise FieldError(
                (i, "type"),
                f"input item type {raw.get('type')!r} is not supported; use message, "
                "function_call, function_call_output or reasoning",
            )
    return value


# -- tools, tool choice, text format --------------------------------------------------
class FunctionTool(FunctionDefinition):
    """A Responses function tool: chat's function definition (its checks), flattened."""

    type: Literal["function"]

    def definition(self) -> FunctionDefinition:
        return FunctionDefinition.model_validate(self.model_dump(exclude={"type"}))


def _function_tools_only(value: Any) -> Any:
    if isinstance(value, list):
        if len(value) > MAX_TOOLS:
            raise FieldError(None, f"at most {MAX_TOOLS} tools are allowed, got {len(value)}")
        for i, tool in enumerate(value):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise FieldError(
                    (i, "type"),
                    f"tool type {kind!r} is not supported; only function tools are",
                )
    return value


class ToolChoiceFunction(OpenAIBaseModel):
    type: Literal["function"]
    name: str


class JsonSchemaTextFormat(JsonSchemaFormat):
    """Chat's `response_format.json_schema`, flattened beside `type`."""

    type: Literal["json_schema"]


class PlainTextFormat(OpenAIBaseModel):
    type: Literal["text", "json_object"]


TextFormat = Annotated[
    Annotated[JsonSchemaTextFormat, Tag("json-schema-format")]
    | Annotated[PlainTextFormat, Tag("plain-format")],
    Discriminator(
        lambda v: (
            "json-schema-format"
            if (v.get("type") if isinstance(v, dict) else getattr(v, "type", None)) == "json_schema"
            else "plain-format"
        )
    ),
]
"""By `type`, so a bad json_schema format is reported against its own fields (the tags
hold a '-' and never show in a `param`)."""


class TextConfig(OpenAIBaseModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    """Accepted; a local model has no verbosity control."""

    @field_validator("format", mode="before")
    @classmethod
    def _check_format_type(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") not in (
            "text",
            "json_object",
            "json_schema",
        ):
            raise FieldError("type", "format type must be 'text', 'json_object' or 'json_schema'")
        return value


class ReasoningConfig(OpenAIBaseModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    """Passed to the chat template as `reasoning_effort` (templates that know it use it)."""
    summary: Literal["auto", "concise", "detailed"] | None = None
    """Any value: reasoning items carry the model's reasoning as their summary too (the
    server has no summarizer, so the summary is the reasoning itself)."""
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    """The deprecated spelling of `summary`."""

    @property
    def wants_summary(self) -> bool:
        return (self.summary or self.generate_summary) is not None


class ResponsesRequest(OpenAIBaseModel):
    """OpenAI's Responses request; see docs/api.md for every field."""

    unsupported_fields: ClassVar[Mapping[str, str]] = _UNSUPPORTED_FIELDS

    input: Annotated[str | list[InputItem], BeforeValidator(_check_input)]
    model: str | None = None
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=256)
    tools: Annotated[list[FunctionTool] | None, BeforeValidator(_function_tools_only)] = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    background: bool = False
    """Answer at once with the response `queued`; it runs on in the server, and `GET
    /v1/responses/{id}` reads it (needs `store`). With `stream`, the events are sent as
    they come and kept: a dropped stream resumes with `GET /v1/responses/{id}?stream=true
    &starting_after=N`, and a disconnect does not stop the response."""
    metadata: dict[str, str] | None = None
    truncation: Literal["disabled"] | None = None
    """Only 'disabled' (a prompt that does not fit is a 400); 'auto' is refused."""
    include: list[str] | None = None
    """`message.output_text.logprobs` returns the output text's token logprobs (with
    `top_logprobs` alternatives each); other values name parts this server's output does
    not have, and are accepted and ignored."""
    max_tool_calls: int | None = Field(default=None, ge=1)
    """OpenAI's cap on calls to built-in tools (web search, file search, ...); this
    server runs none, so there is nothing to cap: accepted and echoed. Function calls
    are the client's to run, not limited by it (as OpenAI)."""
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    """Alternatives per token in the logprobs `include` asks for (OpenAI's and vLLM's
    rule: without that include, no logprobs are returned)."""
    user: str | None = None
    service_tier: str | None = None
    # vLLM's extras on /v1/responses
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    """vLLM: prefix-cache blocks are shared only with requests of the same salt."""
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    seed: int | None = Field(default=None, ge=0, le=INT64_MAX)
    ignore_eos: bool = False
    """vLLM: generate past the end-of-sequence token, up to `max_output_tokens`."""
    priority: int = Field(default=0, ge=-INT64_MAX - 1, le=INT64_MAX)
    request_id: str | None = Field(default=None, min_length=1, max_length=256)

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        reject_unsupported(data, cls.unsupported_fields)
        if isinstance(data, dict) and data.get("truncation") == "auto":
            raise FieldError(
                "truncation",
                "truncation 'auto' is not supported; a prompt that does not fit "
                "is a 400 (truncation 'disabled')",
            )
        return data

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_tool_choice(cls, value: Any) -> Any:
        if value is None or value in ("none", "auto", "required"):
            return value
        if isinstance(value, dict):
            if value.get("type") != "function":
                raise FieldError(
                    "type", "tool_choice must be 'none', 'auto', 'required' or a function tool"
                )
            return value
        raise FieldError(None, "must be 'none', 'auto', 'required' or a function tool")

    @model_validator(mode="after")
    def _check_request(self) -> ResponsesRequest:
        # NOTE: the tool rules (unique names, a tool_choice among the tools, no forced call
        # with text.format) are chat's, checked when the chat request is built
        # (handlers/serving/responses_input.py), with the fields renamed back.
        if self.metadata is not None and len(self.metadata) > 16:
            raise FieldError("metadata", "metadata holds at most 16 pairs")
        if self.background and not self.store:
            raise FieldError(
                "background",
                "background mode needs store=true: the response is read later by its id",
            )
        return self

    @property
    def wants_summary(self) -> bool:
        return self.reasoning is not None and self.reasoning.wants_summary

    @property
    def wants_logprobs(self) -> bool:
        return OUTPUT_LOGPROBS in (self.include or ())


# -- the response object ----------------------------------------------------------------
class OutputText(WireModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatCompletionLogProbsContent] = Field(default_factory=list)
    """With `include: ["message.output_text.logprobs"]`: one entry per token of the text
    (token, logprob, bytes, top_logprobs), as chat's `logprobs.content`."""


class OutputMessage(WireModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCallOutput(WireModel):
    """A call the model made (`function_call` item of `output`)."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(WireModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class SummaryText(WireModel):
    type: Literal["summary_text"] = "summary_text"
    text: str


class ReasoningOutput(WireModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | FunctionCallOutput | ReasoningOutput


class InputTokensDetails(WireModel):
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    cache_write_tokens: int = 0


class OutputTokensDetails(WireModel):
    reasoning_tokens: int = 0


class ResponseUsage(WireModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(WireModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(WireModel):
    code: str
    message: str


class ResponseObject(WireModel):
    """The `response` object: what `POST /v1/responses` returns, `GET` reads back and
    the lifecycle events of a stream carry."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "failed", "in_progress", "incomplete", "cancelled", "queued"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled"] = "disabled"
    store: bool = True
    background: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    completed_at: int | None = None


class ResponseDeleted(WireModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


# -- stream events ----------------------------------------------------------------------
class StreamEvent(WireModel):
    """Base of the typed stream events; every one carries its `sequence_number`."""

    type: str
    sequence_number: int


class ResponseLifecycleEvent(StreamEvent):
    """response.created / in_progress / completed / incomplete / failed."""

    response: ResponseObject


class OutputItemEvent(StreamEvent):
    """response.output_item.added / done."""

    output_index: int
    item: OutputItem


class ContentPartEvent(StreamEvent):
    """response.content_part.added / done: a message's output text, or (as vLLM and the
    SDK's `PartReasoningText`) a reasoning item's text."""

    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class TextDeltaEvent(StreamEvent):
    """response.output_text.delta."""

    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[ChatCompletionLogProbsContent] = Field(default_factory=list)


class TextDoneEvent(StreamEvent):
    """response.output_text.done."""

    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[ChatCompletionLogProbsContent] = Field(default_factory=list)


class ReasoningDeltaEvent(StreamEvent):
    """response.reasoning_text.delta."""

    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningDoneEvent(StreamEvent):
    """response.reasoning_text.done."""

    item_id: str
    output_index: int
    content_index: int
    text: str


class SummaryDeltaEvent(StreamEvent):
    """response.reasoning_summary_text.delta."""

    item_id: str
    output_index: int
    summary_index: int
    delta: str


class SummaryDoneEvent(StreamEvent):
    """response.reasoning_summary_text.done."""

    item_id: str
    output_index: int
    summary_index: int
    text: str


class SummaryPartEvent(StreamEvent):
    """response.reasoning_summary_part.added / done."""

    item_id: str
    output_index: int
    summary_index: int
    part: SummaryText


class ArgumentsDeltaEvent(StreamEvent):
    """response.function_call_arguments.delta."""

    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(StreamEvent):
    """response.function_call_arguments.done."""

    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(StreamEvent):
    """`error`: a failure after the stream began (then `response.failed`: `ResponseEvents.failure`)."""

    type: Literal["error"] = "error"
    code: str | None
    message: str
    param: str | None = None
