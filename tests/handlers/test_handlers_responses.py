"""The Responses API through the production app on a scripted engine: what reaches the
engine (the prompt chat renders, the constraint), the response object, the typed
event stream, the store behind `previous_response_id` and `GET`, and the routes
around it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from fake_engine import FakeEngine, Script
from handlers_testing import EOS_ID, call_asgi, encode, long_context_info, sse_named_events

from engine.config import ModelInfo

pytestmark = pytest.mark.anyio

RESPONSES = "/v1/responses"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture
def model_info(model_dir, tokenizer) -> ModelInfo:
    return long_context_info(model_dir, tokenizer)


def _script(engine: FakeEngine, tokenizer, text: str, **fields: Any) -> None:
    engine.script = Script(token_ids=[*encode(tokenizer, text), EOS_ID], **fields)


def _prompt(engine: FakeEngine, tokenizer, index: int = -1) -> str:
    return tokenizer.decode(engine.added[index].prompt_token_ids, skip_special_tokens=False)


def _output_text(response: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


async def test_a_string_input_answers_with_one_message(client, engine, tokenizer):
    _script(engine, tokenizer, "The capital of France is Paris.", num_cached_tokens=3)
    result = await call_asgi(
        client.app, RESPONSES, {"input": "Capital of France?", "instructions": "Be brief."}
    )
    assert result.status == 200, result.body
    body = result.json
    assert body["object"] == "response" and body["id"].startswith("resp_")
    assert body["status"] == "completed" and body["model"] == "tiny"
    [item] = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["id"].startswith("msg_") and item["status"] == "completed"
    assert item["content"] == [
        {
            "type": "output_text",
            "text": "The capital of France is Paris.",
            "annotations": [],
            "logprobs": [],
        }
    ]
    prompt = _prompt(engine, tokenizer)
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert "<|im_start|>user\nCapital of France?<|im_end|>" in prompt
    usage = body["usage"]
    assert usage["input_tokens"] == len(engine.added[0].prompt_token_ids)
    assert usage["output_tokens"] == len(encode(tokenizer, "The capital of France is Paris.")) + 1
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens_details"]["cached_tokens"] == 3
    assert body["instructions"] == "Be brief." and body["store"] is True


async def test_sampling_fields_reach_the_engine_by_their_chat_meaning(client, engine, tokenizer):
    _script(engine, tokenizer, "Hello world!")
    body = {"input": "Hi", "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3}
    result = await call_asgi(client.app, RESPONSES, body)
    assert result.status == 200, result.body
    params = engine.added[0].params
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (7, 0.5, 0.9, 3)
    assert params.ignore_eos is False
    _script(engine, tokenizer, "one two three four five six seven eight nine ten")
    again = await call_asgi(client.app, RESPONSES, {**body, "ignore_eos": True})  # vLLM's extra
    assert again.status == 200 and engine.added[1].params.ignore_eos is True
    assert result.json["max_output_tokens"] == 7 and result.json["temperature"] == 0.5


async def test_max_output_tokens_cut_short_is_incomplete(client, engine, tokenizer):
    _script(engine, tokenizer, "Hello world! How are you today?")
    result = await call_asgi(client.app, RESPONSES, {"input": "Hi", "max_output_tokens": 2})
    body = result.json
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"
    assert body["usage"]["output_tokens"] == 2


async def test_items_with_calls_and_outputs_render_as_the_chat_history(client, engine, tokenizer):
    _script(engine, tokenizer, "It is 20 C in Paris.")
    body = {
        "input": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {
                "type": "function_call_output",
                "call_id": "call_1",
                "output": '{"temp": 20}',
            },
            {"type": "reasoning", "id": "rs_1", "summary": []},
        ],
        "tools": [WEATHER],
    }
    result = await call_asgi(client.app, RESPONSES, body)
    assert result.status == 200, result.body
    assert _output_text(result.json) == "It is 20 C in Paris."
    prompt = _prompt(engine, tokenizer)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in prompt
    )
    assert '<tool_response>\n{"temp": 20}\n</tool_response>' in prompt


async def test_message_items_take_text_parts(client, engine, tokenizer):
    _script(engine, tokenizer, "x")
    body = {
        "input": [
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Hello"},
                    {"type": "input_text", "text": "world"},
                ],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Hi!", "annotations": []}],
            },
            {"role": "user", "content": "Again"},
        ]
    }
    result = await call_asgi(client.app, RESPONSES, body)
    assert result.status == 200, result.body
    prompt = _prompt(engine, tokenizer)
    assert "user\nHello\nworld<|im_end|>" in prompt
    assert "assistant\nHi!<|im_end|>" in prompt and "user\nAgain<|im_end|>" in prompt


async def test_an_auto_tool_call_is_a_function_call_item(client, engine, tokenizer):
    _script(
        engine,
        tokenizer,
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    )
    result = await call_asgi(client.app, RESPONSES, {"input": "Weather?", "tools": [WEATHER]})
    body = result.json
    assert body["status"] == "completed"
    [call] = body["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    assert engine.added[0].params.structured is None
    assert body["tools"] == [WEATHER] and body["tool_choice"] == "auto"


async def test_a_named_tool_choice_constrains_the_arguments(client, engine, tokenizer):
    _script(engine, tokenizer, '{"city": "Oslo"}')
    body = {
        "input": "Weather?",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False,
    }
    result = await call_asgi(client.app, RESPONSES, body)
    spec = engine.added[0].params.structured
    assert spec is not None and json.loads(spec.value) == WEATHER["parameters"]
    [call] = result.json["output"]
    assert (call["name"], call["arguments"]) == ("get_weather", '{"city": "Oslo"}')
    assert result.json["parallel_tool_calls"] is False


async def test_required_allows_one_call_without_parallel_calls(client, engine, tokenizer):
    _script(engine, tokenizer, '[{"name": "get_weather", "arguments": {"city": "Rome"}}]')
    body = {
        "input": "Weather?",
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
    }
    result = await call_asgi(client.app, RESPONSES, body)
    schema = json.loads(engine.added[0].params.structured.value)
    assert schema["maxItems"] == 1
    assert [item["name"] for item in result.json["output"]] == ["get_weather"]


@pytest.mark.parametrize(
    ("text_format", "kind"),
    [
        ({"type": "json_object"}, "json_object"),
        (
            {
                "type": "json_schema",
                "name": "city",
                "schema": {"type": "object", "properties": {"name": {"type": "string"}}},
                "strict": True,
            },
            "json",
        ),
    ],
)
async def test_text_format_goes_through_structured_outputs(
    client, engine, tokenizer, text_format, kind
):
    _script(engine, tokenizer, '{"name": "Paris"}')
    result = await call_asgi(
        client.app, RESPONSES, {"input": "City?", "text": {"format": text_format}}
    )
    assert result.status == 200, result.body
    spec = engine.added[0].params.structured
    assert spec is not None and spec.kind == kind
    if kind == "json":
        assert json.loads(spec.value) == text_format["schema"]
    assert result.json["text"]["format"] == text_format
    assert json.loads(_output_text(result.json)) == {"name": "Paris"}


async def test_reasoning_is_a_reasoning_item_with_its_summary(make_client, engine, tokenizer):
    client = make_client(reasoning_parser="think")
    _script(engine, tokenizer, "<think>cold up north</think>Take a coat.")
    body = {"input": "Oslo?", "reasoning": {"effort": "low", "summary": "auto"}}
    result = await call_asgi(client.app, RESPONSES, body)
    reasoning, message = result.json["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "cold up north"}]
    assert reasoning["summary"] == [{"type": "summary_text", "text": "cold up north"}]
    assert message["content"][0]["text"] == "Take a coat."
    details = result.json["usage"]["output_tokens_details"]
    assert details["reasoning_tokens"] == len(encode(tokenizer, "cold up north"))


# -- streaming ----------------------------------------------------------------------------
def _events(result) -> list[dict[str, Any]]:
    named = sse_named_events(result.body)
    events = [data for _, data in named]
    assert [name for name, _ in named] == [e["type"] for e in events], "named by its type"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


async def test_a_stream_sends_the_typed_events_in_order(client, engine, tokenizer):
    _script(engine, tokenizer, "Hello world! How are you today?")
    result = await call_asgi(client.app, RESPONSES, {"input": "Hi", "stream": True})
    assert result.status == 200 and result.headers["content-type"] == "text/event-stream"
    events = _events(result)
    types = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) > 1
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0]["response"]["status"] == "in_progress"
    assert events[0]["response"]["output"] == []
    text = "".join(d["delta"] for d in deltas)
    assert text == "Hello world! How are you today?"
    final = events[-1]["response"]
    assert final["status"] == "completed" and _output_text(final) == text
    assert final["id"] == events[0]["response"]["id"]
    item_id = events[2]["item"]["id"]
    assert {e["item_id"] for e in deltas} == {item_id} == {final["output"][0]["id"]}
    assert final["usage"]["output_tokens"] == len(encode(tokenizer, text)) + 1  # and EOS
    assert b"[DONE]" not in result.body
    assert engine.live == set()


async def test_a_streamed_tool_call_sends_argument_events(client, engine, tokenizer):
    _script(
        engine,
        tokenizer,
        'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    )
    body = {"input": "Weather?", "tools": [WEATHER], "stream": True}
    events = _events(await call_asgi(client.app, RESPONSES, body))
    types = [e["type"] for e in events]
    assert types[-5:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert types.index("response.output_item.done") < types.index(
        "response.function_call_arguments.delta"
    ), "the message item closes before the call opens"
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["name"] == "get_weather" and json.loads(done["arguments"]) == {"city": "Paris"}
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Let me check. "


async def test_a_stream_with_reasoning_and_summary(make_client, engine, tokenizer):
    client = make_client(reasoning_parser="think")
    _script(engine, tokenizer, "<think>cold up north</think>Take a coat.")
    body = {"input": "Oslo?", "stream": True, "reasoning": {"summary": "detailed"}}
    events = _events(await call_asgi(client.app, RESPONSES, body))
    types = [e["type"] for e in events]
    first_text = types.index("response.output_text.delta")
    for kind in (
        "response.reasoning_summary_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
        "response.reasoning_text.done",
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
    ):
        assert types.index(kind) < first_text, kind
    done = next(e for e in events if e["type"] == "response.reasoning_text.done")
    assert done["text"] == "cold up north"
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    # each item's content part opens after the item and closes after its text, as vLLM's
    # (the reasoning's part is the SDK's `reasoning_text`)
    reasoning_id, message_id = (item["id"] for item in final["output"])
    parts = [
        (e["type"].rsplit(".", 1)[1], e["item_id"], e["part"]["type"], e["part"].get("text"))
        for e in events
        if e["type"].startswith("response.content_part.")
    ]
    assert parts == [
        ("added", reasoning_id, "reasoning_text", ""),
        ("done", reasoning_id, "reasoning_text", "cold up north"),
        ("added", message_id, "output_text", ""),
        ("done", message_id, "output_text", "Take a coat."),
    ]
    added = types.index("response.content_part.added")
    assert types[added - 1] == "response.output_item.added"
    assert types.index("response.reasoning_text.done") < types.index("response.content_part.done")


async def test_a_failure_mid_stream_is_an_error_event(client, engine, tokenizer):
    engine.script = Script(token_ids=encode(tokenizer, "Hello world! How are you"), fail_at_step=2)
    result = await call_asgi(client.app, RESPONSES, {"input": "Hi", "stream": True})
    events = _events(result)
    error, failed = events[-2:]
    assert error["type"] == "error"
    assert error["code"] == "InternalServerError" and error["message"]
    # then `response.failed`, which ends the SDK's stream helper (same response id)
    assert failed["type"] == "response.failed"
    assert failed["response"]["id"] == events[0]["response"]["id"]
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": error["code"], "message": error["message"]}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "response.completed" not in [e["type"] for e in events]
    assert engine.live == set()


# -- store, previous_response_id, GET / DELETE / cancel ----------------------------------
async def test_previous_response_id_continues_the_stored_conversation(client, engine, tokenizer):
    _script(engine, tokenizer, "Paris.")
    first = (
        await call_asgi(
            client.app, RESPONSES, {"input": "Capital of France?", "instructions": "Be brief."}
        )
    ).json
    _script(engine, tokenizer, "About two million.")
    second = await call_asgi(
        client.app,
        RESPONSES,
        {"input": "How many people live there?", "previous_response_id": first["id"]},
    )
    assert second.status == 200, second.body
    assert second.json["previous_response_id"] == first["id"]
    prompt = _prompt(engine, tokenizer)
    assert "Be brief." not in prompt, "instructions are not carried over"
    assert (
        "user\nCapital of France?<|im_end|>\n<|im_start|>assistant\nParis.<|im_end|>\n"
        "<|im_start|>user\nHow many people live there?<|im_end|>"
    ) in prompt
    fetched = await call_asgi(client.app, f"{RESPONSES}/{first['id']}", method="GET")
    assert fetched.status == 200 and fetched.json == first


async def test_a_streamed_response_is_stored_too(client, engine, tokenizer):
    _script(engine, tokenizer, "Paris.")
    events = _events(await call_asgi(client.app, RESPONSES, {"input": "Capital?", "stream": True}))
    final = events[-1]["response"]
    fetched = await call_asgi(client.app, f"{RESPONSES}/{final['id']}", method="GET")
    assert fetched.json == final


async def test_store_false_keeps_nothing(client, engine, tokenizer):
    _script(engine, tokenizer, "Paris.")
    body = (await call_asgi(client.app, RESPONSES, {"input": "Capital?", "store": False})).json
    assert body["store"] is False
    fetched = await call_asgi(client.app, f"{RESPONSES}/{body['id']}", method="GET")
    assert fetched.status == 404 and fetched.json["error"]["param"] == "response_id"
    follow = await call_asgi(
        client.app, RESPONSES, {"input": "More", "previous_response_id": body["id"]}
    )
    assert follow.status == 404 and follow.json["error"]["param"] == "previous_response_id"
    assert len(engine.added) == 1, "refused before admission"


async def test_delete_then_get_is_404_and_cancel_refuses(client, engine, tokenizer):
    _script(engine, tokenizer, "Paris.")
    body = (await call_asgi(client.app, RESPONSES, {"input": "Capital?"})).json
    cancel = await call_asgi(client.app, f"{RESPONSES}/{body['id']}/cancel", {})
    assert cancel.status == 400 and "synchronous" in cancel.json["error"]["message"]
    deleted = await call_asgi(client.app, f"{RESPONSES}/{body['id']}", method="DELETE")
    assert deleted.status == 200
    assert deleted.json == {"id": body["id"], "object": "response.deleted", "deleted": True}
    for method, path in (
        ("GET", f"{RESPONSES}/{body['id']}"),
        ("DELETE", f"{RESPONSES}/{body['id']}"),
        ("POST", f"{RESPONSES}/{body['id']}/cancel"),
    ):
        again = await call_asgi(client.app, path, {} if method == "POST" else None, method=method)
        assert again.status == 404, (method, path)


async def test_a_store_of_zero_entries_stores_nothing(make_client, engine, tokenizer):
    client = make_client(responses_store_max_entries=0)
    _script(engine, tokenizer, "Paris.")
    body = (await call_asgi(client.app, RESPONSES, {"input": "Capital?"})).json
    fetched = await call_asgi(client.app, f"{RESPONSES}/{body['id']}", method="GET")
    assert fetched.status == 404


async def test_invocations_dispatches_a_responses_body(client, engine, tokenizer):
    _script(engine, tokenizer, "Paris.")
    result = await call_asgi(client.app, "/invocations", {"input": "Capital?"})
    assert result.status == 200 and result.json["object"] == "response"
    assert _output_text(result.json) == "Paris."
    stream = await call_asgi(client.app, "/invocations", {"input": "Capital?", "stream": True})
    assert _events(stream)[-1]["type"] == "response.completed"


async def test_a_tool_round_trip_through_previous_response_id(client, engine, tokenizer):
    """The agent loop with server-side state: the call is stored, the client sends only
    the call's output and the id, and the prompt holds the whole exchange."""
    _script(
        engine,
        tokenizer,
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    )
    first = (
        await call_asgi(client.app, RESPONSES, {"input": "Weather in Paris?", "tools": [WEATHER]})
    ).json
    [call] = first["output"]
    _script(engine, tokenizer, "It is 20 C in Paris.")
    body = {
        "previous_response_id": first["id"],
        "tools": [WEATHER],
        "input": [
            {"type": "function_call_output", "call_id": call["call_id"], "output": '{"temp": 20}'}
        ],
    }
    second = await call_asgi(client.app, RESPONSES, body)
    assert _output_text(second.json) == "It is 20 C in Paris."
    prompt = _prompt(engine, tokenizer)
    assert "user\nWeather in Paris?<|im_end|>" in prompt
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in prompt
    )
    assert '<tool_response>\n{"temp": 20}\n</tool_response>' in prompt


# -- logprobs ---------------------------------------------------------------------------
LOGPROBS = {"include": ["message.output_text.logprobs"], "top_logprobs": 2}


def _tokens_of(entries: list[dict[str, Any]]) -> str:
    return "".join(e["token"] for e in entries)


@pytest.mark.parametrize("stream", [False, True])
async def test_included_logprobs_are_the_output_texts_tokens(client, engine, tokenizer, stream):
    """With `include: ["message.output_text.logprobs"]` every token of the text has an
    entry with its top_logprobs alternatives (streamed: on each text delta and the done
    events); top_logprobs alone returns none, as OpenAI and vLLM."""
    _script(engine, tokenizer, "Hello world")
    body = {"input": "Hi", "stream": stream, **LOGPROBS}
    result = await call_asgi(client.app, RESPONSES, body)
    assert result.status == 200, result.body
    assert engine.added[-1].params.logprobs == 2
    if stream:
        events = _events(result)
        deltas = [e for e in events if e["type"] == "response.output_text.delta"]
        assert _tokens_of([lp for d in deltas for lp in d["logprobs"]]) == "Hello world"
        done = next(e for e in events if e["type"] == "response.output_text.done")
        assert _tokens_of(done["logprobs"]) == "Hello world"
        response = events[-1]["response"]
    else:
        response = result.json
    entries = response["output"][0]["content"][0]["logprobs"]
    assert _tokens_of(entries) == "Hello world"
    assert len(entries) == len(encode(tokenizer, "Hello world"))
    assert all(e["logprob"] == -0.5 and len(e["top_logprobs"]) == 2 for e in entries)
    assert all(e["bytes"] == list(e["token"].encode()) for e in entries)
    plain = await call_asgi(client.app, RESPONSES, {"input": "Hi", "top_logprobs": 2})
    assert plain.status == 200 and engine.added[-1].params.logprobs is None
    assert plain.json["output"][0]["content"][0]["logprobs"] == []


@pytest.mark.parametrize(
    "text", ["Hi \U0001f600 \u4f60\u597d", "\U0001f600 ok"], ids=["inside", "first"]
)
@pytest.mark.parametrize("stream", [False, True])
async def test_logprobs_keep_the_tokens_of_a_character_split_over_several(
    client, engine, tokenizer, stream, text
):
    """A character whose bytes span several tokens (an emoji, CJK) releases no text
    until its last token: the tokens before still belong to the output text. Their
    entries' bytes rebuild it, streamed (deltas, done, final) and not, the first
    character included; the two agree."""
    _script(engine, tokenizer, text)
    ids = encode(tokenizer, text)
    assert len(ids) > len(text.split()) + 2  # the test needs characters split over tokens
    entries_of = {}
    for streamed in (stream, not stream):
        result = await call_asgi(
            client.app, RESPONSES, {"input": "Hi", "stream": streamed, **LOGPROBS}
        )
        assert result.status == 200, result.body
        if streamed:
            events = _events(result)
            deltas = [e for e in events if e["type"] == "response.output_text.delta"]
            joined = [lp for d in deltas for lp in d["logprobs"]]
            done = next(e for e in events if e["type"] == "response.output_text.done")
            response = events[-1]["response"]
            for entries in (joined, done["logprobs"]):
                assert bytes(b for e in entries for b in e["bytes"]).decode() == text
        else:
            response = result.json
        entries = response["output"][0]["content"][0]["logprobs"]
        assert bytes(b for e in entries for b in e["bytes"]).decode() == text
        assert len(entries) == len(ids)
        entries_of[streamed] = entries
    assert entries_of[True] == entries_of[False]


@pytest.mark.parametrize("stream", [False, True])
async def test_logprobs_leave_out_the_reasoning_tokens(make_client, engine, tokenizer, stream):
    client = make_client(reasoning_parser="think")
    _script(engine, tokenizer, "<think>cold up north</think>Take a coat.")
    body = {"input": "Oslo?", "stream": stream, **LOGPROBS}
    result = await call_asgi(client.app, RESPONSES, body)
    assert result.status == 200, result.body
    response = _events(result)[-1]["response"] if stream else result.json
    reasoning, message = response["output"]
    assert reasoning["type"] == "reasoning"
    assert _tokens_of(message["content"][0]["logprobs"]) == "Take a coat."


async def test_top_logprobs_out_of_range_is_a_400(client, engine):
    result = await call_asgi(client.app, RESPONSES, {"input": "Hi", "top_logprobs": 21})
    assert result.status == 400 and result.json["error"]["param"] == "top_logprobs"


async def test_max_tool_calls_is_echoed(client, engine, tokenizer):
    """It caps built-in tool calls, which this server has none of: accepted and echoed
    (it was a 400); 0 is refused as on OpenAI."""
    _script(engine, tokenizer, "Hi")
    result = await call_asgi(client.app, RESPONSES, {"input": "Hi", "max_tool_calls": 3})
    assert result.status == 200 and result.json["max_tool_calls"] == 3
    zero = await call_asgi(client.app, RESPONSES, {"input": "Hi", "max_tool_calls": 0})
    assert zero.status == 400 and zero.json["error"]["param"] == "max_tool_calls"


# -- background ---------------------------------------------------------------------------
async def _poll(client, response_id: str, until: set[str]) -> dict[str, Any]:
    """GET the response until its status is one of `until` (a few seconds at most)."""
    for _ in range(200):
        got = await call_asgi(client.app, f"{RESPONSES}/{response_id}", method="GET")
        assert got.status == 200, got.body
        if got.json["status"] in until:
            return got.json
        await asyncio.sleep(0.02)
    raise AssertionError(f"{response_id} never reached {until}: {got.json['status']}")


async def test_a_background_response_answers_queued_and_completes(client, engine, tokenizer):
    _script(engine, tokenizer, "Take a coat.", step_delay=0.01)
    result = await call_asgi(client.app, RESPONSES, {"input": "Oslo?", "background": True})
    assert result.status == 200, result.body
    assert result.json["status"] == "queued" and result.json["background"] is True
    assert result.json["output"] == []
    done = await _poll(client, result.json["id"], {"completed"})
    assert _output_text(done) == "Take a coat." and done["background"] is True
    assert done["usage"]["output_tokens"] == len(encode(tokenizer, "Take a coat.")) + 1
    follow = {"input": "And Bergen?", "previous_response_id": done["id"]}
    assert (await call_asgi(client.app, RESPONSES, follow)).status == 200
    assert "Take a coat." in _prompt(engine, tokenizer)  # the stored turn continues
    assert engine.live == set()


async def test_cancel_stops_a_background_response(client, engine, tokenizer):
    """The cancel is written to the store; the run sees it, stops, and frees the engine;
    the response stays cancelled, and cancelling again changes nothing."""
    _script(engine, tokenizer, "word " * 200, step_delay=0.02)
    started = await call_asgi(client.app, RESPONSES, {"input": "Talk.", "background": True})
    response_id = started.json["id"]
    await _poll(client, response_id, {"in_progress"})
    cancelled = await call_asgi(client.app, f"{RESPONSES}/{response_id}/cancel")
    assert cancelled.status == 200 and cancelled.json["status"] == "cancelled"
    for _ in range(100):
        if not engine.live:
            break
        await asyncio.sleep(0.02)
    assert engine.live == set()
    await asyncio.sleep(0.1)
    again = await call_asgi(client.app, f"{RESPONSES}/{response_id}/cancel")
    assert again.json["status"] == "cancelled"
    assert (await _poll(client, response_id, {"cancelled"}))["status"] == "cancelled"


async def test_background_needs_the_store(client, engine):
    body = {"input": "Hi", "background": True, "store": False}
    result = await call_asgi(client.app, RESPONSES, body)
    assert result.status == 400 and result.json["error"]["param"] == "background"
    assert engine.added == []


async def test_a_streamed_background_response_survives_its_client_and_resumes(
    client, engine, tokenizer
):
    """`background` + `stream`: the POST streams the events (`response.created` says
    `queued`); the client leaving after a few events stops nothing; `GET ?stream=true
    &starting_after=N` sends the rest, numbered on from N + 1, to `response.completed`, whose
    text is the stored response's."""
    text = "word " * 30
    _script(engine, tokenizer, text, step_delay=0.01)
    body = {"input": "Talk.", "background": True, "stream": True}
    first = await call_asgi(
        client.app, RESPONSES, body, disconnect_when=lambda b: b.count(b"event: ") >= 6
    )
    assert first.status == 200 and first.headers["content-type"] == "text/event-stream"
    head = [data for _, data in sse_named_events(first.body)]
    assert head[0]["type"] == "response.created" and head[0]["response"]["status"] == "queued"
    assert head[1]["type"] == "response.in_progress"
    assert head[-1]["type"] != "response.completed", "the client left before the end"
    response_id = head[0]["response"]["id"]
    done = await _poll(client, response_id, {"completed"})
    after = head[-1]["sequence_number"]
    rest = await call_asgi(
        client.app, f"{RESPONSES}/{response_id}?stream=true&starting_after={after}", method="GET"
    )
    events = [data for _, data in sse_named_events(rest.body)]
    assert [e["sequence_number"] for e in events] == list(range(after + 1, after + 1 + len(events)))
    assert events[-1]["type"] == "response.completed"
    deltas = "".join(
        e["delta"] for e in [*head, *events] if e["type"] == "response.output_text.delta"
    )
    assert deltas == _output_text(events[-1]["response"]) == _output_text(done)
    whole = await call_asgi(client.app, f"{RESPONSES}/{response_id}?stream=true", method="GET")
    assert _events(whole)[: len(head)] == head, "from the start: the same events"
    assert engine.live == set()


async def test_a_streamed_background_response_that_fails_ends_its_stream(client, engine, tokenizer):
    """The engine dies mid-response: the kept stream ends with an `error` event, then
    `response.failed` (as a stream not in the background), the response is stored
    `failed` with the items it finished, and a reader that comes later ends there too."""
    _script(engine, tokenizer, "word " * 30, step_delay=0.01, raise_at_step=5)
    body = {"input": "Talk.", "background": True, "stream": True}
    first = await call_asgi(client.app, RESPONSES, body)
    events = [data for _, data in sse_named_events(first.body)]
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    response_id = events[0]["response"]["id"]
    stored = await _poll(client, response_id, {"failed"})
    assert stored["error"]["code"] == events[-2]["code"]
    assert events[-1]["response"] == stored
    again = await call_asgi(client.app, f"{RESPONSES}/{response_id}?stream=true", method="GET")
    assert [data for _, data in sse_named_events(again.body)] == events


async def test_only_a_streamed_background_response_streams_back(client, engine, tokenizer):
    _script(engine, tokenizer, "Hi")
    plain = await call_asgi(client.app, RESPONSES, {"input": "Hi"})
    refused = await call_asgi(
        client.app, f"{RESPONSES}/{plain.json['id']}?stream=true", method="GET"
    )
    assert refused.status == 400 and refused.json["error"]["param"] == "stream"
    missing = await call_asgi(client.app, f"{RESPONSES}/resp_nope?stream=true", method="GET")
    assert missing.status == 404
    bad = await call_asgi(
        client.app, f"{RESPONSES}/{plain.json['id']}?stream=true&starting_after=x", method="GET"
    )
    assert bad.status == 400


async def test_a_synchronous_response_cannot_be_cancelled(client, engine, tokenizer):
    _script(engine, tokenizer, "Hi")
    done = await call_asgi(client.app, RESPONSES, {"input": "Hi"})
    refused = await call_asgi(client.app, f"{RESPONSES}/{done.json['id']}/cancel")
    assert refused.status == 400


async def test_background_needs_the_response_store(make_client, engine):
    client = make_client(responses_store_max_entries=0)
    result = await call_asgi(client.app, RESPONSES, {"input": "Hi", "background": True})
    assert result.status == 400 and result.json["error"]["param"] == "background"
    assert engine.added == []
