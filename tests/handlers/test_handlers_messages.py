"""Anthropic Messages (`/v1/messages`, `/v1/messages/count_tokens`) through the
production app on a scripted engine: what reaches the engine (prompt, constraint,
sampling) and the message / events the client gets back."""

from __future__ import annotations

import json

import pytest
from fake_engine import FakeEngine, Script
from handlers_testing import (
    EOS_ID,
    assert_anthropic_error,
    call_asgi,
    encode,
    long_context_info,
    sse_named_events,
)

from engine.config import ModelInfo
from engine.tokenizer import Tokenizer
from handlers.config import ServerConfig

pytestmark = pytest.mark.anyio

MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {
    "name": "get_weather",
    "description": "Current weather",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def body(**fields):
    return {"model": "tiny", "max_tokens": 500, "messages": USER, **fields}


@pytest.fixture
def model_info(model_dir, tokenizer) -> ModelInfo:
    return long_context_info(model_dir, tokenizer)


def script(engine: FakeEngine, tokenizer: Tokenizer, text: str, **kwargs) -> list[int]:
    ids = [*encode(tokenizer, text), EOS_ID]
    engine.script = Script(token_ids=ids, **kwargs)
    return ids


def prompt_of(engine: FakeEngine, tokenizer: Tokenizer, i: int = 0) -> str:
    return tokenizer.decode(engine.added[i].prompt_token_ids, skip_special_tokens=False)


async def test_text_answer_is_one_text_block(client, engine, tokenizer):
    ids = script(engine, tokenizer, "Hello world!")
    result = await call_asgi(client.app, MESSAGES, body(temperature=0.5, top_p=0.9, top_k=7))
    assert result.status == 200, result.body
    message = result.json
    assert message["id"].startswith("msg_") and message["type"] == "message"
    assert message["role"] == "assistant" and message["model"] == "tiny"
    assert message["content"] == [{"type": "text", "text": "Hello world!"}]
    assert message["stop_reason"] == "end_turn" and message["stop_sequence"] is None
    [added] = engine.added
    assert message["usage"]["input_tokens"] == len(added.prompt_token_ids)
    assert message["usage"]["output_tokens"] == len(ids)
    params = added.params
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (500, 0.5, 0.9, 7)


async def test_system_string_and_blocks_open_the_prompt(client, engine, tokenizer):
    script(engine, tokenizer, "ok")
    await call_asgi(client.app, MESSAGES, body(system="Be brief."))
    blocks = [
        {"type": "text", "text": "Be"},
        {"type": "text", "text": "brief.", "cache_control": {"type": "ephemeral"}},
    ]
    await call_asgi(client.app, MESSAGES, body(system=blocks))
    assert prompt_of(engine, tokenizer, 0).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert prompt_of(engine, tokenizer, 1).startswith("<|im_start|>system\nBe\nbrief.<|im_end|>")


async def test_stream_events_in_anthropic_order(client, engine, tokenizer):
    ids = script(engine, tokenizer, "Hello world!")
    result = await call_asgi(client.app, MESSAGES, body(stream=True))
    assert result.status == 200 and result.headers["content-type"].startswith("text/event-stream")
    assert b"[DONE]" not in result.body
    events = sse_named_events(result.body)
    assert all(name == data["type"] for name, data in events), events
    names = [name for name, _ in events]
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == len(engine.added[0].prompt_token_ids)
    assert events[2][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert {d["type"] for d in deltas} == {"text_delta"}
    assert "".join(d["text"] for d in deltas) == "Hello world!"
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert final["usage"]["output_tokens"] == len(ids)


async def test_stop_sequence_and_max_tokens(client, engine, tokenizer):
    script(engine, tokenizer, "Stop here. STOP now.")
    result = await call_asgi(client.app, MESSAGES, body(stop_sequences=["STOP"]))
    message = result.json
    assert message["content"] == [{"type": "text", "text": "Stop here. "}]
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "STOP")
    result = await call_asgi(client.app, MESSAGES, body(max_tokens=2))
    assert result.json["stop_reason"] == "max_tokens"
    assert result.json["usage"]["output_tokens"] == 2
    assert engine.live == set()


async def test_auto_tool_call_is_a_tool_use_block(client, engine, tokenizer):
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    script(engine, tokenizer, call)
    result = await call_asgi(client.app, MESSAGES, body(tools=[WEATHER]))
    message = result.json
    [block] = message["content"]
    assert block["type"] == "tool_use" and block["id"].startswith("toolu_")
    assert (block["name"], block["input"]) == ("get_weather", {"city": "Paris"})
    assert message["stop_reason"] == "tool_use"
    prompt = prompt_of(engine, tokenizer)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    assert engine.added[0].params.structured is None


async def test_forced_tool_is_constrained_to_its_schema_and_streams_input_json(
    client, engine, tokenizer
):
    script(engine, tokenizer, '{"city": "Paris"}')
    forced = body(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    result = await call_asgi(client.app, MESSAGES, forced)
    [block] = result.json["content"]
    assert block["input"] == {"city": "Paris"} and result.json["stop_reason"] == "tool_use"
    structured = engine.added[0].params.structured
    assert structured.kind == "json"
    assert json.loads(structured.value) == WEATHER["input_schema"]

    result = await call_asgi(client.app, MESSAGES, {**forced, "stream": True})
    events = sse_named_events(result.body)
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert len(starts) == 1 and starts[0]["type"] == "tool_use"
    assert starts[0]["name"] == "get_weather" and starts[0]["input"] == {}
    partial = "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta")
    assert json.loads(partial) == {"city": "Paris"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


async def test_tool_choice_any_and_none(client, engine, tokenizer):
    script(engine, tokenizer, '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    no_parallel = {"type": "any", "disable_parallel_tool_use": True}
    result = await call_asgi(client.app, MESSAGES, body(tools=[WEATHER], tool_choice=no_parallel))
    [block] = result.json["content"]
    assert block["input"] == {"city": "Oslo"}
    schema = json.loads(engine.added[0].params.structured.value)
    assert schema["type"] == "array" and schema["maxItems"] == 1
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    script(engine, tokenizer, call)
    result = await call_asgi(
        client.app, MESSAGES, body(tools=[WEATHER], tool_choice={"type": "none"})
    )
    assert result.json["content"] == [{"type": "text", "text": call}]
    assert result.json["stop_reason"] == "end_turn"


async def test_tool_round_trip_renders_the_call_and_its_result(client, engine, tokenizer):
    script(engine, tokenizer, "It is sunny.")
    history = [
        *USER,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "secret", "signature": "sig"},
                {"type": "text", "text": "Let me check."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "sunny, 21C"}],
                },
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    result = await call_asgi(client.app, MESSAGES, body(messages=history, tools=[WEATHER]))
    assert result.json["content"] == [{"type": "text", "text": "It is sunny."}]
    prompt = prompt_of(engine, tokenizer)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in prompt
    )
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in prompt
    assert prompt.index("<tool_response>") < prompt.index("And tomorrow?")
    assert "Let me check." in prompt and "secret" not in prompt


async def test_final_assistant_message_is_a_prefill(client, engine, tokenizer):
    script(engine, tokenizer, " Paris.")
    prefill = [*USER, {"role": "assistant", "content": "The capital is"}]
    result = await call_asgi(client.app, MESSAGES, body(messages=prefill))
    assert result.json["content"] == [{"type": "text", "text": " Paris."}]
    assert prompt_of(engine, tokenizer).endswith("<|im_start|>assistant\nThe capital is")


async def test_count_tokens_equals_input_tokens(client, engine, tokenizer):
    script(engine, tokenizer, "ok")
    request = body(system="Be brief.", tools=[WEATHER])
    created = await call_asgi(client.app, MESSAGES, request)
    counted = await call_asgi(
        client.app, COUNT, {k: v for k, v in request.items() if k != "max_tokens"}
    )
    assert counted.status == 200, counted.body
    assert counted.json == {"input_tokens": created.json["usage"]["input_tokens"]}
    assert len(engine.added) == 1  # counting admits nothing


async def test_thinking_blocks_from_the_reasoning_parser(make_client, engine, tokenizer):
    client = make_client(reasoning_parser="think")
    script(engine, tokenizer, "<think>Paris is in France.</think>Paris.")
    thinking = {"type": "enabled", "budget_tokens": 1024}
    result = await call_asgi(client.app, MESSAGES, body(max_tokens=2000, thinking=thinking))
    assert result.json["content"] == [
        {"type": "thinking", "thinking": "Paris is in France.", "signature": ""},
        {"type": "text", "text": "Paris."},
    ]
    result = await call_asgi(
        client.app, MESSAGES, body(max_tokens=2000, thinking=thinking, stream=True)
    )
    events = sse_named_events(result.body)
    starts = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert starts == ["thinking", "text"]
    by_index: dict[int, str] = {}
    for name, data in events:
        if name == "content_block_delta":
            delta = data["delta"]
            by_index[data["index"]] = by_index.get(data["index"], "") + delta.get(
                "thinking", delta.get("text", "")
            )
    assert by_index == {0: "Paris is in France.", 1: "Paris."}


async def test_errors_are_in_anthropic_shape(client, engine):
    assert_anthropic_error(await call_asgi(client.app, MESSAGES, body(model="claude-x")), 404)
    assert_anthropic_error(await call_asgi(client.app, MESSAGES, {"messages": USER}), 400)
    assert_anthropic_error(await call_asgi(client.app, MESSAGES, method="GET"), 405)
    assert_anthropic_error(await call_asgi(client.app, COUNT, {"model": "tiny"}), 400)
    assert engine.added == []


async def test_x_api_key_is_accepted_and_a_missing_key_is_an_anthropic_401(
    make_client, engine, tokenizer
):
    client = make_client(api_key_digests=ServerConfig.with_api_keys(["sk-a"]).api_key_digests)
    script(engine, tokenizer, "ok")
    assert_anthropic_error(await call_asgi(client.app, MESSAGES, body()), 401)
    wrong = await call_asgi(client.app, MESSAGES, body(), headers={"x-api-key": "sk-b"})
    assert_anthropic_error(wrong, 401)
    good = await call_asgi(client.app, MESSAGES, body(), headers={"x-api-key": "sk-a"})
    assert good.status == 200, good.body
    chat = await call_asgi(
        client.app, "/v1/chat/completions", {"messages": USER}, headers={"x-api-key": "sk-a"}
    )
    assert chat.status == 200


async def test_failure_mid_stream_is_an_anthropic_error_event(client, engine, tokenizer):
    script(engine, tokenizer, "Hello world! How are you today?", fail_at_step=3)
    result = await call_asgi(client.app, MESSAGES, body(stream=True))
    events = sse_named_events(result.body)
    name, data = events[-1]
    assert name == "error" and data["type"] == "error"
    assert data["error"].keys() == {"type", "message"}
    assert engine.live == set()


async def test_invocations_dispatches_anthropic_bodies(client, engine, tokenizer):
    script(engine, tokenizer, "Hello world!")
    bedrock = {"anthropic_version": "bedrock-2023-05-31", "max_tokens": 20, "messages": USER}
    result = await call_asgi(client.app, "/invocations", bedrock)
    assert result.json["type"] == "message"
    assert result.json["content"] == [{"type": "text", "text": "Hello world!"}]
    by_field = {"system": "Be brief.", "max_tokens": 20, "messages": USER, "stream": True}
    events = sse_named_events((await call_asgi(client.app, "/invocations", by_field)).body)
    assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
    # messages + max_tokens alone is still a chat completion.
    chat = await call_asgi(client.app, "/invocations", {"max_tokens": 20, "messages": USER})
    assert chat.json["object"] == "chat.completion"
    bad = await call_asgi(client.app, "/invocations", {**bedrock, "max_tokens": 0})
    assert_anthropic_error(bad, 400)


async def test_output_config_format_constrains_the_answer(client, engine, tokenizer):
    script(engine, tokenizer, '{"a": 1}')
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    output = {"format": {"type": "json_schema", "schema": schema}}
    result = await call_asgi(client.app, MESSAGES, body(output_config=output))
    assert result.json["content"] == [{"type": "text", "text": '{"a": 1}'}]
    structured = engine.added[0].params.structured
    assert structured.kind == "json" and json.loads(structured.value) == schema


async def test_keep_alive_ticks_are_ping_events(make_client, engine, tokenizer):
    client = make_client(sse_keep_alive_interval=0.01)
    script(engine, tokenizer, "Hello world!", step_delay=0.05)
    result = await call_asgi(client.app, MESSAGES, body(stream=True))
    # Anthropic's clients get events, not SSE comments.
    assert not [line for line in result.body.split(b"\n") if line.startswith(b":")]
    names = [name for name, _ in sse_named_events(result.body)]
    assert names.count("ping") > 2
    assert names[-1] == "message_stop"


async def test_a_client_that_leaves_mid_stream_aborts_the_request(client, engine, tokenizer):
    script(engine, tokenizer, "Hello world! How are you today?", step_delay=0.02)
    result = await call_asgi(
        client.app,
        MESSAGES,
        body(stream=True),
        disconnect_when=lambda sent: sent.count(b"content_block_delta") >= 4,
    )
    assert b"message_stop" not in result.body
    assert engine.aborted and engine.live == set()
