"""Anthropic Messages (`POST /v1/messages`, `POST /v1/messages/count_tokens`): request,
response and stream-event models, with Anthropic's field names.

A request is validated here completely (roles, block types per role, tools and
tool_choice, thinking, sampling ranges), so that its translation into a chat request
(`handlers/serving/anthropic_convert.py`) is always valid and every 400 names the
Anthropic field, not a chat one. What the wire carries that hearth cannot honour
(images, documents, server tools, MCP servers) is a 400 naming it, never ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from handlers.protocol.base import (
    FieldError,
    OpenAIBaseModel,
    WireModel,
    limits_from,
    reject_unsupported,
)
from handlers.protocol.chat import MAX_TOOLS, cap_messages
from handlers.protocol.json_schema import check_json_schema, schema_text

_UNSUPPORTED_MESSAGES_FIELDS = {
    "mcp_servers": "MCP servers are not supported",
    "container": "code-execution containers are not supported",
    "context_management": "context management is not supported",
}

# Block type -> the union tag (tags are not field-name shaped, so error locations show
# `messages[0].content[1].input`, not the tag: `format_param` drops them).
_BLOCK_TAGS = {
    "text": "text-block",
    "tool_use": "tool-use-block",
    "tool_result": "tool-result-block",
    "thinking": "thinking-block",
    "redacted_thinking": "redacted-thinking-block",
}
_BLOCKS_OF_ROLE = {
    "user": ("text", "tool_result"),
    "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
}


def _block_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _BLOCK_TAGS.get(kind) if isinstance(kind, str) else None


def _known_blocks(allowed: tuple[str, ...]) -> Any:
    """A before-validator: a string, or a list of objects whose `type` is in `allowed`
    (a 400 naming the block's `type` otherwise: images, documents, server tool blocks)."""

    def check(value: Any) -> Any:
        if isinstance(value, str) or not isinstance(value, list):
            return value
        for i, block in enumerate(value):
            if not isinstance(block, dict):
                raise FieldError(i, "content blocks must be objects")
            kind = block.get("type")
            if kind not in allowed:
                raise FieldError(
                    (i, "type"),
                    f"content block type {kind!r} is not supported here; "
                    f"supported: {', '.join(allowed)}",
                )
        return value

    return BeforeValidator(check)


class TextBlockParam(OpenAIBaseModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    """Accepted and ignored: prefix caching is automatic."""
    citations: list[dict[str, Any]] | None = None
    """Accepted and ignored."""


class ToolUseBlockParam(OpenAIBaseModel):
    """A tool call of an earlier assistant turn."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlockParam(OpenAIBaseModel):
    """The result of a tool call, in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: Annotated[str | list[TextBlockParam], _known_blocks(("text",))] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else _joined(self.content)
        return f"Error: {body}" if self.is_error else body


class ThinkingBlockParam(OpenAIBaseModel):
    """Reasoning of an earlier assistant turn: accepted, not rendered (as the reasoning
    templates drop earlier reasoning from the prompt)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlockParam(OpenAIBaseModel):
    type: Literal["redacted_thinking"]
    data: str


ContentBlockParam = Annotated[
    Annotated[TextBlockParam, Tag("text-block")]
    | Annotated[ToolUseBlockParam, Tag("tool-use-block")]
    | Annotated[ToolResultBlockParam, Tag("tool-result-block")]
    | Annotated[ThinkingBlockParam, Tag("thinking-block")]
    | Annotated[RedactedThinkingBlockParam, Tag("redacted-thinking-block")],
    Discriminator(_block_tag),
]


def _joined(blocks: list[TextBlockParam]) -> str:
    return "\n".join(block.text for block in blocks)


class MessageParam(OpenAIBaseModel):
    role: Literal["user", "assistant"]
    content: Annotated[str | list[ContentBlockParam], _known_blocks(tuple(_BLOCK_TAGS))]

    @model_validator(mode="after")
    def _blocks_fit_role(self) -> MessageParam:
        if isinstance(self.content, str):
            return self
        allowed = _BLOCKS_OF_ROLE[self.role]
        for i, block in enumerate(self.content):
            if block.type not in allowed:
                raise FieldError(
                    ("content", i, "type"),
                    f"{block.type} blocks are not allowed in {self.role} messages",
                )
        return self

    def blocks(self) -> list[Any]:
        """The content as blocks (a string is one text block)."""
        if isinstance(self.content, str):
            return [TextBlockParam(type="text", text=self.content)]
        return list(self.content)


class ToolParam(OpenAIBaseModel):
    """A client tool (Anthropic's `custom` tool): name, description, input schema."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None

    @field_validator("input_schema")
    @classmethod
    def _check_input_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type") != "object":
            raise FieldError("type", "input_schema must be a JSON schema of type 'object'")
        check_json_schema(value)
        schema_text(value)
        return value


def _client_tools_only(value: Any) -> Any:
    if not isinstance(value, list):
        return value
    if len(value) > MAX_TOOLS:
        raise FieldError(None, f"at most {MAX_TOOLS} tools are allowed, got {len(value)}")
    for i, tool in enumerate(value):
        if isinstance(tool, dict) and tool.get("type") not in (None, "custom"):
            raise FieldError(
                (i, "type"),
                f"tool type {tool.get('type')!r} is not supported: server tools (web search, "
                "code execution, computer use, ...) do not run here; define a custom tool",
            )
    return value


class ToolChoice(OpenAIBaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    """The tool to call, for `type: "tool"`."""
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_for_tool(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise FieldError("name", "tool_choice of type 'tool' needs the tool's name")
        if self.type != "tool" and self.name is not None:
            raise FieldError("name", f"tool_choice of type {self.type!r} takes no name")
        return self


class ThinkingConfig(OpenAIBaseModel):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    """Anything but "disabled" lets the model reason (see `to_chat_request`)."""
    budget_tokens: int | None = Field(default=None, ge=1024)
    """Anthropic's rule (at least 1024, below max_tokens); advisory here: the model's
    reasoning is not cut at the budget, max_tokens bounds the whole answer."""
    display: Literal["summarized", "omitted"] | None = None
    """Accepted; reasoning is returned as the model wrote it."""

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> ThinkingConfig:
        if self.type == "enabled" and self.budget_tokens is None:
            raise FieldError("budget_tokens", "thinking of type 'enabled' needs budget_tokens")
        return self


class JsonOutputFormat(OpenAIBaseModel):
    """Anthropic's structured outputs: the answer's text is JSON of this schema."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")

    @field_validator("schema_")
    @classmethod
    def _check_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        check_json_schema(value)
        schema_text(value)
        return value


class OutputConfig(OpenAIBaseModel):
    effort: str | None = None
    """Accepted and ignored."""
    format: JsonOutputFormat | None = None


MessagesField = Annotated[list[MessageParam], BeforeValidator(cap_messages), Field(min_length=1)]


class MessagesPromptRequest(OpenAIBaseModel):
    """What a Messages request renders into the prompt: all count_tokens reads."""

    unsupported_fields: ClassVar[Mapping[str, str]] = _UNSUPPORTED_MESSAGES_FIELDS

    model: str | None = None
    messages: MessagesField
    system: Annotated[str | list[TextBlockParam] | None, _known_blocks(("text",))] = None
    tools: Annotated[list[ToolParam] | None, BeforeValidator(_client_tools_only)] = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None
    """The older (beta) spelling of `output_config.format`."""
    cache_control: dict[str, Any] | None = None
    """Accepted and ignored: prefix caching is automatic."""

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        reject_unsupported(data, cls.unsupported_fields)
        return data

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, value: list[ToolParam] | None) -> list[ToolParam] | None:
        names = [tool.name for tool in value or ()]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise FieldError((i, "name"), f"tool name {name!r} is used twice")
        return value

    @model_validator(mode="after")
    def _check_prompt(self) -> MessagesPromptRequest:
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not self.tools:
            raise FieldError("tool_choice", f"tool_choice {choice.type!r} needs tools")
        names = {tool.name for tool in self.tools or ()}
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise FieldError(
                ("tool_choice", "name"), f"tool {choice.name!r} is not among the tools"
            )
        last = self.messages[-1]
        if last.role == "assistant" and any(b.type != "text" for b in last.blocks()):
            raise FieldError(
                ("messages", len(self.messages) - 1, "content"),
                "a final assistant message (a prefill the answer continues) may hold only text",
            )
        return self

    @property
    def output_schema(self) -> dict[str, Any] | None:
        """The JSON schema the answer must follow (`output_config.format`), if any."""
        config = self.output_config
        output = config.format if config is not None and config.format else self.output_format
        return output.schema_ if output is not None else None

    @property
    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system or None
        return _joined(self.system) or None


class CountTokensRequest(MessagesPromptRequest):
    """`POST /v1/messages/count_tokens`; `model` is required, as by Anthropic."""

    model: str  # type: ignore[assignment]


class MessagesRequest(MessagesPromptRequest):
    """A Messages request; `model` optional (an `/invocations` body in Bedrock's shape
    carries none). The route requires it: `MessagesRouteRequest`."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    """0: off (as vLLM's top_k 0)."""
    stream: bool = False
    metadata: dict[str, Any] | None = None
    """Accepted and ignored (Anthropic's `user_id`)."""
    service_tier: str | None = None
    """Accepted and ignored."""
    anthropic_version: str | None = None
    """Bedrock's and Vertex's body field; its presence routes an `/invocations` body here."""
    anthropic_beta: list[str] | None = None
    """Accepted and ignored."""

    @field_validator("stop_sequences")
    @classmethod
    def _check_stop_sequences(cls, value: list[str] | None, info: ValidationInfo) -> Any:
        if value is None:
            return None
        limit = limits_from(info.context).max_stop_strings
        if len(value) > limit:
            raise FieldError(None, f"at most {limit} stop sequences are allowed, got {len(value)}")
        for i, item in enumerate(value):
            if not item:
                raise FieldError(i, "stop sequences must not be empty")
        return value

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> MessagesRequest:
        thinking = self.thinking
        budget = thinking.budget_tokens if thinking is not None else None
        if budget is not None and budget >= self.max_tokens:
            raise FieldError(
                ("thinking", "budget_tokens"),
                f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                f"({self.max_tokens})",
            )
        return self


class MessagesRouteRequest(MessagesRequest):
    """`POST /v1/messages`: `model` is required, as by Anthropic."""

    model: str  # type: ignore[assignment]


# -- responses ------------------------------------------------------------------------
class TextBlock(WireModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(WireModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""
    """Anthropic signs its reasoning; hearth has nothing to sign with (empty)."""


class ToolUseBlock(WireModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessagesUsage(WireModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    """With --enable-prompt-tokens-details: prompt tokens read from the prefix cache
    (then not counted in input_tokens, as Anthropic bills them); else null."""


class MessageResponse(WireModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage


class CountTokensResponse(WireModel):
    input_tokens: int


# -- stream events ----------------------------------------------------------------------
class MessageStartEvent(WireModel):
    type: Literal["message_start"] = "message_start"
    message: MessageResponse


class ContentBlockStartEvent(WireModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentBlock


class TextDelta(WireModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(WireModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class InputJsonDelta(WireModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDeltaEvent(WireModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class ContentBlockStopEvent(WireModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(WireModel):
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None


class MessageDeltaEvent(WireModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: MessagesUsage


class MessageStopEvent(WireModel):
    type: Literal["message_stop"] = "message_stop"


class PingEvent(WireModel):
    type: Literal["ping"] = "ping"


StreamEvent = (
    MessageStartEvent
    | ContentBlockStartEvent
    | ContentBlockDeltaEvent
    | ContentBlockStopEvent
    | MessageDeltaEvent
    | MessageStopEvent
    | PingEvent
)
