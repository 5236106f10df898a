"""Tool-call parsing of scripted model outputs, every supported format."""

from __future__ import annotations

import json

import pytest

from handlers.serving.reasoning import split_reasoning
from handlers.serving.tool_parsers import detect_tool_format, parse_tool_calls


def _args(call) -> dict:
    return json.loads(call.arguments)


def test_hermes_single_call_with_text_around() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    out = parse_tool_calls("hermes", text)
    assert out.content == "Let me check."
    assert [(c.name, _args(c)) for c in out.calls] == [("get_weather", {"city": "Paris"})]


def test_hermes_several_calls_and_unclosed_last_block() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": [2]}"}'
    )
    out = parse_tool_calls("hermes", text)
    assert out.content is None
    assert [(c.name, _args(c)) for c in out.calls] == [("a", {"x": 1}), ("b", {"y": [2]})]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "a", "arguments": {"x": 1</tool_call>',  # malformed JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',  # arguments not an object
        "no call here at all",
    ],
)
def test_hermes_text_that_does_not_parse_stays_content(text: str) -> None:
    out = parse_tool_calls("hermes", text)
    assert out.calls == [] and out.content == text


def test_unknown_tool_name_stays_content() -> None:
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    out = parse_tool_calls("hermes", text, {"get_weather"})
    assert out.calls == [] and out.content == text


def test_llama3_json_with_python_tag_and_several_calls() -> None:
    text = '<|python_tag|>{"name": "a", "parameters": {"q": "x"}}; {"name": "b", "parameters": {}}'
    out = parse_tool_calls("llama3_json", text)
    assert out.content is None
    assert [(c.name, _args(c)) for c in out.calls] == [("a", {"q": "x"}), ("b", {})]


def test_llama3_json_bare_object_and_plain_text() -> None:
    out = parse_tool_calls("llama3_json", '{"name": "a", "parameters": {"n": 3}}')
    assert [(c.name, _args(c)) for c in out.calls] == [("a", {"n": 3})]
    plain = parse_tool_calls("llama3_json", "The answer is {not json}")
    assert plain.calls == [] and plain.content == "The answer is {not json}"
    broken = parse_tool_calls("llama3_json", '{"name": "a", "parameters": {"n": ')
    assert broken.calls == []


def test_mistral_list_and_named_forms() -> None:
    text = (
        'Sure. [TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    )
    out = parse_tool_calls("mistral", text)
    assert out.content == "Sure."
    assert [c.name for c in out.calls] == ["a", "b"]
    named = parse_tool_calls("mistral", '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}')
    assert [(c.name, _args(c)) for c in named.calls] == [("a", {"x": 1}), ("b", {})]
    broken = parse_tool_calls("mistral", "[TOOL_CALLS] [{")
    assert broken.calls == [] and broken.content == "[TOOL_CALLS] [{"


def test_format_detection_from_templates() -> None:
    assert detect_tool_format("{{ '<tool_call>' }}{% for t in tools %}{% endfor %}") == (
        "hermes",
        True,
    )
    assert detect_tool_format("<|python_tag|>{{ tools }}")[0] == "llama3_json"
    assert detect_tool_format("[TOOL_CALLS]{{ tools }}")[0] == "mistral"
    assert detect_tool_format("{{ messages }}") == ("hermes", False)
    assert detect_tool_format(None) == ("hermes", False)


def test_think_blocks_split_off() -> None:
    assert split_reasoning("<think>hmm</think>\nAnswer") == ("hmm", "Answer")
    assert split_reasoning("opened in the prompt</think>Answer") == (
        "opened in the prompt",
        "Answer",
    )
    assert split_reasoning("<think>still going") == ("still going", "")
    assert split_reasoning("no reasoning") == (None, "no reasoning")


def _stream(streamer, pieces: list[str]):
    out = [streamer.feed(p) for p in pieces] + [streamer.finish()]
    content = "".join(p.content for p in out)
    calls: dict[int, dict] = {}
    for piece in out:
        for d in piece.tool_calls:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = call["id"] or d.id
            call["name"] = call["name"] or d.function.name
            call["arguments"] += d.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)]


def _chat(**fields):
    from handlers.protocol.chat import ChatCompletionRequest

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": [tool], **fields}
    )


def test_streamed_auto_call_split_across_deltas() -> None:
    from handlers.serving.tool_stream import ToolCallStreamer

    text = 'Sure! <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    content, calls = _stream(ToolCallStreamer(_chat(), "hermes"), pieces)
    assert content == "Sure! "
    assert len(calls) == 1 and calls[0]["name"] == "f" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == {"a": 1}


def test_streamed_auto_text_that_only_looks_like_a_call_stays_content() -> None:
    from handlers.serving.tool_stream import ToolCallStreamer

    text = "a <tool_ca b <tool_call>{broken"
    content, calls = _stream(ToolCallStreamer(_chat(), "hermes"), list(text))
    assert content == text and calls == []


def test_streamed_named_and_required() -> None:
    from handlers.serving.tool_stream import ToolCallStreamer

    named = _chat(tool_choice={"type": "function", "function": {"name": "f"}})
    content, calls = _stream(ToolCallStreamer(named, "hermes"), ['{"a"', ": 1}"])
    assert content == "" and calls[0]["name"] == "f" and calls[0]["arguments"] == '{"a": 1}'
    required = _chat(tool_choice="required")
    content, calls = _stream(
        ToolCallStreamer(required, "hermes"), ['[{"name":"f",', '"arguments":{}}]']
    )
    assert content == "" and [c["name"] for c in calls] == ["f"]


def test_streamed_reasoning() -> None:
    from handlers.serving.tool_stream import ReasoningStreamer

    streamer = ReasoningStreamer(True)
    parts = [streamer.feed(p) for p in ["<th", "ink>hm", "m</th", "ink> Yes"]] + [streamer.finish()]
    assert "".join(r for r, _ in parts) == "hmm"
    assert "".join(c for _, c in parts) == "Yes"
    plain = ReasoningStreamer(True)
    assert plain.feed("Hello") == ("", "Hello")
