"""Anthropic Messages <-> chat completions: the request into the chat request that the
chat serving path runs, and its answer back into Anthropic's blocks.

The translation is the whole Messages implementation's contract with chat: the system
prompt is the first (system) message; a user turn's `tool_result` blocks become `tool`
messages (in their order among the turn's text); an assistant turn's `tool_use` blocks
become its `tool_calls` (ids kept, so results pair with calls); earlier `thinking`
blocks are not rendered. `tool_choice` any/tool/none map to chat's
required/named/none, whose structured-output constraint forces a valid call;
`output_config.format` is chat's `response_format` json_schema; a final assistant
message is a prefill the answer continues (`continue_final_message`).
"""

from __future__ import annotations

import json
from typing import Any

from handlers.protocol.anthropic import (
    ContentBlock,
    MessageParam,
    MessageResponse,
    MessagesPromptRequest,
    MessagesRequest,
    MessagesUsage,
    StopReason,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
)
from handlers.protocol.base import RequestLimits, UsageInfo, parse_request
from handlers.protocol.chat import ChatCompletionRequest, ChatCompletionResponse

TOOL_USE_PREFIX = "toolu_"
"""Anthropic's tool-use id prefix; chat's call ids (`call_...`) are renamed to it."""


def tool_use_id(call_id: str) -> str:
    return TOOL_USE_PREFIX + call_id.removeprefix("call_")


def message_id(response_id: str) -> str:
    """`msg_...` from the chat run's id (`chatcmpl-...`), keeping a client's X-Request-Id."""
    return "msg_" + response_id.removeprefix("chatcmpl-")


def _assistant_message(message: MessageParam) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in message.blocks():
        if block.type == "text":
            texts.append(block.text)
        elif block.type == "tool_use":
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": arguments},
                }
            )
    entry: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if calls:
        entry["tool_calls"] = calls
    elif entry["content"] is None:
        entry["content"] = ""
    return entry


def _user_messages(message: MessageParam) -> list[dict[str, Any]]:
    """Text runs as user messages, each tool result as a `tool` message, in order."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for block in message.blocks():
        if block.type == "text":
            texts.append(block.text)
        elif block.type == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def chat_messages(request: MessagesPromptRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if request.system_text is not None:
        messages.append({"role": "system", "content": request.system_text})
    for message in request.messages:
        if message.role == "assistant":
            messages.append(_assistant_message(message))
        else:
            messages.extend(_user_messages(message))
    return messages


def _tool_fields(request: MessagesPromptRequest) -> dict[str, Any]:
    if not request.tools:
        # Without tools only "none" means anything to chat (and needs nothing).
        return {}
    fields: dict[str, Any] = {
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "parameters": tool.input_schema,
                    **({"description": tool.description} if tool.description else {}),
                },
            }
            for tool in request.tools
        ]
    }
    choice = request.tool_choice
    if choice is None:
        return fields
    if choice.type == "tool":
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


def to_chat_request(
    request: MessagesPromptRequest, limits: RequestLimits | None = None
) -> ChatCompletionRequest:
    """The chat request that renders the same prompt and samples the same way."""
    data: dict[str, Any] = {"messages": chat_messages(request), **_tool_fields(request)}
    if request.model is not None:
        data["model"] = request.model
    if request.messages[-1].role == "assistant":
        data["continue_final_message"] = True
        data["add_generation_prompt"] = False
    if request.output_schema is not None:
        data["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": request.output_schema},
        }
    if request.thinking is not None:
        # Qwen3-style templates switch their reasoning on and off with this.
        data["chat_template_kwargs"] = {"enable_thinking": request.thinking.type != "disabled"}
    if isinstance(request, MessagesRequest):
        data["max_tokens"] = request.max_tokens
        data["stream"] = request.stream
        for name in ("temperature", "top_p", "top_k"):
            value = getattr(request, name)
            if value is not None:
                data[name] = value
        if request.stop_sequences:
            data["stop"] = request.stop_sequences
    return parse_request(ChatCompletionRequest, data, limits)


# -- the answer ------------------------------------------------------------------------
def stop_reason_of(
    finish_reason: str | None, stop: int | str | None
) -> tuple[StopReason | None, str | None]:
    """(stop_reason, stop_sequence) of a chat finish reason and vLLM's stop_reason."""
    if finish_reason is None:
        return None, None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def messages_usage(usage: UsageInfo) -> MessagesUsage:
    """Anthropic's usage. With cached-token reporting on (--enable-prompt-tokens-details)
    the prompt splits as Anthropic bills it: input_tokens are the tokens computed, the
    prefix-cache hits are cache_read_input_tokens; otherwise input_tokens is the whole
    prompt (what count_tokens answers)."""
    details = usage.prompt_tokens_details
    if details is None:
        return MessagesUsage(
            input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens
        )
    return MessagesUsage(
        input_tokens=usage.prompt_tokens - details.cached_tokens,
        output_tokens=usage.completion_tokens,
        cache_creation_input_tokens=0,
        cache_read_input_tokens=details.cached_tokens,
    )


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the `input` object (the parsers only yield objects)."""
    value = json.loads(arguments)
    return value if isinstance(value, dict) else {"value": value}


def message_from_chat(response: ChatCompletionResponse) -> MessageResponse:
    choice = response.choices[0]
    message = choice.message
    content: list[ContentBlock] = []
    if message.reasoning_content:
        content.append(ThinkingBlock(thinking=message.reasoning_content))
    if message.content:
        content.append(TextBlock(text=message.content))
    for call in message.tool_calls:
        content.append(
            ToolUseBlock(
                id=tool_use_id(call.id),
                name=call.function.name,
                input=tool_input(call.function.arguments),
            )
        )
    stop_reason, stop_sequence = stop_reason_of(choice.finish_reason, choice.stop_reason)
    return MessageResponse(
        id=message_id(response.id),
        model=response.model,
        content=content,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=messages_usage(response.usage),
    )
