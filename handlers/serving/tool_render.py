"""Tools in the prompt and forced tool calls, for chat requests with `tools`.

Templates that render tools themselves (Qwen, Hermes, Llama 3.1, Mistral) get the tool
definitions and the history as they are. A template that knows nothing of tools (the
embedded SmolLM2 renders only role and content) gets hearth's documented default,
Qwen 2.5's Hermes-style text: the definitions in `<tools>` appended to the system turn,
earlier calls as `<tool_call>` blocks in the assistant turn, and tool results as a user
turn in `<tool_response>` (small models have never seen a `tool` role). The model's
calls are then parsed back in the same format.

`tool_choice="required"` or a named tool is enforced by structured decoding: the output
is constrained to the call JSON itself (an array of `{"name", "arguments"}` objects, or
the named tool's arguments object), so it always parses and validates.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from engine.sampling_params import StructuredOutputSpec
from handlers.protocol.chat import ChatCompletionRequest, ChatMessageParam, ChatToolParam
from handlers.protocol.json_schema import schema_text
from handlers.serving.tool_parsers import ParsedToolCall, parse_tool_calls

MAX_PARALLEL_CALLS = 4
"""Calls in one forced (`required`) answer when parallel calls are allowed."""

TOOLS_SYSTEM_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def tools_system_text(tools: list[ChatToolParam]) -> str:
    lines = "\n".join(
        json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools
    )
    return TOOLS_SYSTEM_PROMPT.format(tools=lines)


def _call_block(call: Any) -> str:
    try:
        args = json.loads(call.function.arguments)
    except ValueError:
        args = call.function.arguments
    body = json.dumps({"name": call.function.name, "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def hermes_messages(
    messages: list[ChatMessageParam], tools: list[ChatToolParam] | None
) -> list[dict[str, Any]]:
    """The conversation in hearth's default tool format, for a template without tools."""
    out = [m.to_template() for m in messages]
    for rendered, message in zip(out, messages, strict=True):
        if message.role == "assistant" and message.tool_calls:
            blocks = [_call_block(c) for c in message.tool_calls]
            text = rendered["content"]
            rendered["content"] = "\n".join([text, *blocks] if text else blocks)
            rendered.pop("tool_calls", None)
        elif message.role == "tool":
            rendered["role"] = "user"
            rendered["content"] = f"<tool_response>\n{rendered['content']}\n</tool_response>"
            rendered.pop("tool_call_id", None)
    if tools:
        text = tools_system_text(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "role": "system", "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def needs_hermes_rendering(
    messages: list[ChatMessageParam], tools: list[ChatToolParam] | None
) -> bool:
    """Whether the conversation carries anything tool-shaped at all."""
    return bool(tools) or any(m.role == "tool" or m.tool_calls for m in messages)


def _arguments_schema(tool: ChatToolParam) -> Any:
    return tool.function.parameters or {"type": "object"}


def forced_tool_spec(request: ChatCompletionRequest) -> StructuredOutputSpec | None:
    """The constraint for `required` / a named tool, or None for none/auto."""
    choice = request.effective_tool_choice
    if choice == "named":
        tool = request.named_tool
        assert tool is not None
        return StructuredOutputSpec(
            kind="json", value=schema_text(_arguments_schema(tool)), param="tool_choice"
        )
    if choice != "required":
        return None
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "arguments": _arguments_schema(t),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in request.tools or ()
    ]
    schema = {
        "type": "array",
        "items": items[0] if len(items) == 1 else {"anyOf": items},
        "minItems": 1,
        "maxItems": 1 if request.parallel_tool_calls is False else MAX_PARALLEL_CALLS,
    }
    return StructuredOutputSpec(kind="json", value=schema_text(schema), param="tools")


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def tool_calls_from_text(
    text: str, request: ChatCompletionRequest, fmt: str
) -> tuple[str | None, list[ParsedToolCall]]:
    """(content, calls) of one finished choice. Forced outputs are the call JSON itself;
    `auto` parses the model's own format; text that does not parse stays content."""
    choice = request.effective_tool_choice
    if choice == "none" or not request.tools:
        return text, []
    if choice == "named":
        tool = request.named_tool
        assert tool is not None
        try:
            json.loads(text)
        except ValueError:
            return text, []
        # the model's own text, as streamed (and as vLLM answers): checked, not re-written
        return None, [ParsedToolCall(tool.function.name, text)]
    if choice == "required":
        try:
            items = json.loads(text)
            calls = [
                ParsedToolCall(item["name"], json.dumps(item["arguments"], ensure_ascii=False))
                for item in items
            ]
        except (ValueError, TypeError, KeyError):
            return text, []
        return None, calls
    parsed = parse_tool_calls(fmt, text, {t.function.name for t in request.tools})
    return parsed.content, parsed.calls
