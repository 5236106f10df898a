"""Tool-call formats: find the calls in a model's text, per model family.

Each parser turns the generated text into (content, calls); text that does not parse as
a call stays content, so a wrong guess never loses output. The format is picked from the
chat template (`detect_tool_format`) unless `--tool-call-parser` names one.

- `hermes` (Hermes, Qwen 2/2.5/3, and hearth's default for templates that know nothing of
  tools): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call.
- `llama3_json` (Llama 3.1+): an optional `<|python_tag|>`, then
  `{"name": ..., "parameters": {...}}`, several separated by `;`.
- `mistral`: `[TOOL_CALLS]` followed by a JSON list of `{"name", "arguments"}`, or the
  newer `[TOOL_CALLS]name[ARGS]{...}` per call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

TOOL_FORMATS = ("hermes", "llama3_json", "mistral")


@dataclass(slots=True)
class ParsedToolCall:
    name: str
    arguments: str
    """JSON text of the arguments object."""


@dataclass(slots=True)
class ParsedOutput:
    content: str | None
    calls: list[ParsedToolCall]


def detect_tool_format(template: str | None) -> tuple[str, bool]:
    """(format, template_renders_tools). A template that never mentions tools gets
    hearth's Hermes-style rendering (see handlers/serving/tool_render.py)."""
    t = template or ""
    knows_tools = "tools" in t
    if "[TOOL_CALLS]" in t:
        return "mistral", knows_tools
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json", knows_tools
    return "hermes", knows_tools


def _call_from(
    obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")
) -> ParsedToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a call object")
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models send the arguments already as JSON text
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError("arguments must be an object")
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> ParsedOutput:
    start = text.find("<tool_call>")
    if start < 0:
        return ParsedOutput(text, [])
    try:
        calls = [_call_from(json.loads(m.group(1).strip())) for m in _HERMES_BLOCK.finditer(text)]
    except ValueError:
        return ParsedOutput(text, [])
    rest = _HERMES_BLOCK.sub("", text).strip()
    return ParsedOutput(rest or None, calls)


def parse_llama3_json(text: str) -> ParsedOutput:
    body = text.strip()
    prefix = ""
    tag = body.find("<|python_tag|>")
    if tag >= 0:
        prefix, body = body[:tag].strip(), body[tag + len("<|python_tag|>") :].strip()
    if not body.startswith("{"):
        return ParsedOutput(text, [])
    decoder = json.JSONDecoder()
    calls: list[ParsedToolCall] = []
    pos = 0
    try:
        while pos < len(body):
            obj, end = decoder.raw_decode(body, pos)
            calls.append(_call_from(obj, ("parameters", "arguments")))
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
    except ValueError:
        return ParsedOutput(text, [])
    return ParsedOutput(prefix or None, calls)


_MISTRAL_NAMED = re.compile(r"\[TOOL_CALLS\]\s*([A-Za-z0-9_.\-]+)\s*\[ARGS\]")


def parse_mistral(text: str) -> ParsedOutput:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return ParsedOutput(text, [])
    prefix = text[:start].strip() or None
    tail = text[start:]
    decoder = json.JSONDecoder()
    try:
        if _MISTRAL_NAMED.match(tail):
            calls = []
            pos = 0
            while (m := _MISTRAL_NAMED.match(tail, pos)) is not None:
                args, end = decoder.raw_decode(tail, m.end())
                calls.append(_call_from({"name": m.group(1), "arguments": args}))
                pos = end
                while pos < len(tail) and tail[pos].isspace():
                    pos += 1
            return ParsedOutput(prefix, calls)
        body = tail[len("[TOOL_CALLS]") :].strip()
        items, _ = decoder.raw_decode(body)
        if isinstance(items, dict):
            items = [items]
        return ParsedOutput(prefix, [_call_from(item) for item in items])
    except (ValueError, TypeError):
        return ParsedOutput(text, [])


_PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral}

START_MARKERS = {
    "hermes": "<tool_call>",
    "llama3_json": "<|python_tag|>",
    "mistral": "[TOOL_CALLS]",
}
"""Text that opens a tool call in each format (llama3_json may also open with `{`)."""


def parse_tool_calls(fmt: str, text: str, tool_names: set[str] | None = None) -> ParsedOutput:
    """The calls in `text`; a call to a tool that was not offered leaves it all content."""
    parsed = _PARSERS[fmt](text)
    if tool_names is not None and any(c.name not in tool_names for c in parsed.calls):
        return ParsedOutput(text, [])
    return parsed
