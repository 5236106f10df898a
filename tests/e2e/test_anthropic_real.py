"""The `anthropic` SDK, unmodified, against a real `hearth serve` with the default model:
`messages.create`, `messages.stream` (the same text at temperature 0), a forced tool
whose input validates against its schema, a tool round trip, `count_tokens` equal to
the prompt tokens of `messages.create`, errors as the SDK's exceptions, and the
`/invocations` dispatch of an Anthropic body."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from tests.e2e.clients import TIMEOUT, sse_lines
from tests.e2e.server import Server

pytestmark = pytest.mark.slow

MODEL = "smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": WEATHER_SCHEMA,
}
FORCED = {"type": "tool", "name": "get_weather"}
GREEDY = {"temperature": 0}
"""Sampling fields the SDK (2.x) no longer has parameters for; the API takes them."""


@pytest.fixture(scope="module")
def sdk(default_server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=default_server.url, api_key="unused", timeout=TIMEOUT, max_retries=0
    )


def _text(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_create_then_stream_give_the_same_text(sdk: anthropic.Anthropic) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 24,
        "extra_body": GREEDY,
        "system": "Answer in one short sentence.",
        "messages": QUESTION,
    }
    created = sdk.messages.create(**request)
    assert created.type == "message" and created.role == "assistant"
    assert created.id.startswith("msg_") and created.model == MODEL
    text = _text(created)
    assert "Paris" in text, text
    assert created.stop_reason in ("end_turn", "max_tokens")
    assert created.usage.output_tokens >= 1 and created.usage.input_tokens > 10

    types: list[str] = []
    with sdk.messages.stream(**request) as stream:
        for event in stream:
            types.append(event.type)
        streamed = stream.get_final_message()
    assert _text(streamed) == text
    assert streamed.stop_reason == created.stop_reason
    assert streamed.usage.output_tokens == created.usage.output_tokens
    assert streamed.usage.input_tokens == created.usage.input_tokens
    # The SDK's own events: the raw ones plus its `text` helper events.
    raw = [t for t in types if t not in ("text",)]
    assert raw[0] == "message_start" and raw[1] == "content_block_start"
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "content_block_delta" in raw


def test_raw_stream_names_every_event_and_pings(default_server: Server) -> None:
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "messages": QUESTION}
    with httpx.Client(timeout=TIMEOUT) as http:
        reply = http.post(default_server.url + "/v1/messages", json={**body, "stream": True})
    assert reply.status_code == 200
    lines = sse_lines(reply.content)
    names = [line[len("event: ") :] for line in lines if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-1] == "message_stop"
    assert len(names) == len([line for line in lines if line.startswith("data: ")])
    assert "[DONE]" not in reply.text


def test_forced_tool_input_validates_against_its_schema(sdk: anthropic.Anthropic) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 64,
        "extra_body": GREEDY,
        "messages": [{"role": "user", "content": "What is the weather like in Paris?"}],
        "tools": [WEATHER],
        "tool_choice": FORCED,
    }
    message = sdk.messages.create(**request)
    [block] = message.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.id.startswith("toolu_")
    jsonschema.validate(block.input, WEATHER_SCHEMA)
    assert message.stop_reason == "tool_use"

    with sdk.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    [streamed_block] = streamed.content
    assert streamed_block.type == "tool_use"
    assert streamed_block.input == block.input
    assert streamed.stop_reason == "tool_use"


def test_tool_round_trip(sdk: anthropic.Anthropic) -> None:
    """tool_use, then the tool's result sent back: the model answers from it."""
    question = {"role": "user", "content": "What is the weather like in Paris?"}
    first = sdk.messages.create(
        model=MODEL,
        max_tokens=64,
        extra_body=GREEDY,
        messages=[question],
        tools=[WEATHER],
        tool_choice={"type": "any"},
    )
    [call] = [block for block in first.content if block.type == "tool_use"]
    jsonschema.validate(call.input, WEATHER_SCHEMA)
    history: list[Any] = [
        question,
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny and 21 degrees."}
            ],
        },
    ]
    second = sdk.messages.create(
        model=MODEL, max_tokens=32, extra_body=GREEDY, messages=history, tools=[WEATHER]
    )
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert second.content, second
    counted = sdk.messages.count_tokens(model=MODEL, messages=history, tools=[WEATHER])
    without_result = sdk.messages.count_tokens(
        model=MODEL, messages=[*history[:2], question], tools=[WEATHER]
    )
    assert counted.input_tokens == second.usage.input_tokens
    assert counted.input_tokens != without_result.input_tokens


def test_count_tokens_equals_input_tokens_of_create(sdk: anthropic.Anthropic) -> None:
    prompt: dict[str, Any] = {
        "model": MODEL,
        "system": [{"type": "text", "text": "You are terse."}],
        "messages": QUESTION,
        "tools": [WEATHER],
    }
    counted = sdk.messages.count_tokens(**prompt)
    created = sdk.messages.create(**prompt, max_tokens=2, extra_body=GREEDY)
    assert counted.input_tokens == created.usage.input_tokens
    plain = sdk.messages.count_tokens(model=MODEL, messages=QUESTION)
    assert plain.input_tokens < counted.input_tokens  # the tools and system are counted


def test_output_config_format_gives_json_of_the_schema(sdk: anthropic.Anthropic) -> None:
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 30}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    message = sdk.messages.create(
        model=MODEL,
        max_tokens=40,
        messages=QUESTION,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(_text(message)), schema)


def test_errors_raise_the_sdks_exceptions(sdk: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as not_found:
        sdk.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=QUESTION)
    assert not_found.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        sdk.messages.create(
            model=MODEL, max_tokens=4, messages=QUESTION, extra_body={"temperature": 1.5}
        )
    assert bad.value.body["type"] == "error"
    assert "temperature" in bad.value.body["error"]["message"]


def test_invocations_answers_an_anthropic_body(default_server: Server) -> None:
    body = {
        "anthropic_version": "bedrock-2023-05-31",
        "max_tokens": 8,
        "temperature": 0,
        "messages": QUESTION,
    }
    with httpx.Client(timeout=TIMEOUT) as http:
        reply = http.post(default_server.url + "/invocations", json=body)
        direct = http.post(default_server.url + "/v1/messages", json={**body, "model": MODEL})
    assert reply.status_code == 200, reply.text
    message = reply.json()
    assert message["type"] == "message" and message["content"][0]["type"] == "text"
    assert message["content"] == direct.json()["content"]
