"""Which chat template a chat request renders with, decided once per request.

Four sources, first one set wins: the request's `chat_template`, its
`chat_template_kwargs["chat_template"]` (both only with --trust-request-chat-template),
the server's --chat-template, the model's own. Rendering, the tool-call format and the
reasoning split all read the one `ChatTemplateChoice`, so what the output is parsed as
always matches what the prompt was rendered with (docs/architecture.md, "Where each
rule lives").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from handlers.errors import BadRequestError
from handlers.protocol.chat import ChatMessageParam, ChatToolParam
from handlers.serving.harmony import uses_harmony
from handlers.serving.reasoning import reasoning_enabled
from handlers.serving.served_model import ServedModel
from handlers.serving.tool_parsers import detect_tool_format


class ChatTemplateRequest(Protocol):
    """The fields a request renders through the chat template with: the chat request
    and the /tokenize chat request both have them, so both render the same way."""

    messages: list[ChatMessageParam]
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template: str | None
    chat_template_kwargs: dict[str, Any] | None
    tools: list[ChatToolParam] | None
    reasoning_effort: str | None


@dataclass(frozen=True, slots=True)
class ChatTemplateChoice:
    """The template one request renders with, and what follows from it."""

    source: str | None
    """The Jinja text; None when neither the server nor the model has a template
    (rendering then fails with a 400 that says how to pass one)."""
    from_request: bool
    """Sent by the client: arbitrary Jinja, rendered off the event loop."""
    tool_format: str
    """The tool-call format outputs are parsed in: --tool-call-parser, else detected."""
    renders_tools: bool
    """The template renders `tools` itself; otherwise hearth's Hermes rendering does."""
    reasoning: bool
    """Split `<think>...</think>` into reasoning_content (--reasoning-parser, else
    whether the template mentions <think>)."""
    harmony: bool = False
    """gpt-oss's harmony channels (handlers/serving/harmony.py): the output is
    detokenized with its special tokens and split into reasoning, content and tool
    calls by channel (--reasoning-parser harmony, else a gpt-oss model or a template
    that writes ``<|channel|>``); `reasoning` and `tool_format` are then unused."""

    @property
    def reasons_in_blocks(self) -> bool:
        """Whether outputs hold a reasoning block a thinking budget can cap: `<think>`
        or harmony's analysis channel."""
        return self.reasoning or self.harmony


def reasoning_style(served: ServedModel, source: str | None) -> tuple[bool, bool]:
    """(`<think>` reasoning, harmony channels) of outputs under template `source`: one
    rule for the chat routes and for completions (which render no template, so they ask
    with the server's)."""
    config = served.config
    info = served.engine.model_info
    harmony = uses_harmony(config.reasoning_parser, source, info.architecture if info else "")
    return not harmony and reasoning_enabled(config.reasoning_parser, source), harmony


def requested_template(request: ChatTemplateRequest) -> str | None:
    """The template the request itself names, from either of its two fields."""
    value = request.chat_template or (request.chat_template_kwargs or {}).get("chat_template")
    if value is not None and not isinstance(value, str):
        raise BadRequestError("chat_template: must be a string", param="chat_template")
    return value or None


def choose_chat_template(served: ServedModel, request: ChatTemplateRequest) -> ChatTemplateChoice:
    """The one decision; a 400 when the request sends a template the server does not
    trust."""
    config = served.config
    from_request = requested_template(request)
    if from_request is not None and not config.trust_request_chat_template:
        raise BadRequestError(
            "chat_template: a chat template was passed with the request, but the server "
            "does not trust request chat templates (--trust-request-chat-template).",
            param="chat_template",
        )
    source = from_request or config.chat_template or served.tokenizer().chat_template
    detected_format, renders_tools = detect_tool_format(source)
    reasoning, harmony = reasoning_style(served, source)
    return ChatTemplateChoice(
        source=source,
        from_request=from_request is not None,
        tool_format=config.tool_call_parser or detected_format,
        renders_tools=renders_tools,
        reasoning=reasoning,
        harmony=harmony,
    )
