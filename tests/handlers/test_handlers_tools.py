"""Tool calling and structured outputs through the serving layer, on a scripted engine:
what reaches the engine (prompt, constraint) and what the client gets back."""

from __future__ import annotations

import json

import pytest
from fake_engine import FakeEngine, Script
from handlers_testing import CHAT_TEMPLATE, EOS_ID, call_asgi, encode, long_context_info

from engine.config import ModelInfo

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


@pytest.fixture
def model_info(model_dir, tokenizer) -> ModelInfo:
    return long_context_info(model_dir, tokenizer)


def _script(engine: FakeEngine, tokenizer, text: str) -> None:
    engine.script = Script(token_ids=[*encode(tokenizer, text), EOS_ID])


async def test_auto_parses_the_hermes_call_and_renders_tools(client, engine, tokenizer):
    _script(
        engine,
        tokenizer,
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    )
    result = await call_asgi(client.app, CHAT, {"messages": MESSAGES, "tools": [WEATHER, TIME]})
    assert result.status == 200, result.body
    choice = result.json["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert choice["message"]["content"] is None
    prompt = tokenizer.decode(engine.added[0].prompt_token_ids, skip_special_tokens=False)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    assert engine.added[0].params.structured is None  # auto: the model decides


async def test_auto_plain_answer_stays_content(client, engine, tokenizer):
    _script(engine, tokenizer, "It is sunny.")
    result = await call_asgi(client.app, CHAT, {"messages": MESSAGES, "tools": [WEATHER]})
    choice = result.json["choices"][0]
    assert choice["message"]["content"] == "It is sunny."
    assert choice["message"]["tool_calls"] == [] and choice["finish_reason"] == "stop"


async def test_required_constrains_to_the_calls_and_parses_them(client, engine, tokenizer):
    _script(engine, tokenizer, '[{"name": "get_time", "arguments": {}}]')
    body = {"messages": MESSAGES, "tools": [WEATHER, TIME], "tool_choice": "required"}
    result = await call_asgi(client.app, CHAT, body)
    spec = engine.added[0].params.structured
    assert spec is not None and spec.kind == "json"
    schema = json.loads(spec.value)
    assert schema["type"] == "array" and schema["minItems"] == 1
    names = [item["properties"]["name"]["const"] for item in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    choice = result.json["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_time"]


async def test_named_tool_constrains_to_its_arguments(client, engine, tokenizer):
    _script(engine, tokenizer, '{"city": "Oslo"}')
    body = {
        "messages": MESSAGES,
        "tools": [WEATHER, TIME],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
    }
    result = await call_asgi(client.app, CHAT, body)
    spec = engine.added[0].params.structured
    assert json.loads(spec.value) == WEATHER["function"]["parameters"]
    [call] = result.json["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


async def test_history_with_calls_and_results_renders(client, engine, tokenizer):
    _script(engine, tokenizer, "It is 20 C in Paris.")
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 20}'},
    ]
    result = await call_asgi(client.app, CHAT, {"messages": messages, "tools": [WEATHER]})
    assert result.json["choices"][0]["message"]["content"] == "It is 20 C in Paris."
    prompt = tokenizer.decode(engine.added[0].prompt_token_ids, skip_special_tokens=False)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in prompt
    )
    assert '<tool_response>\n{"temp": 20}\n</tool_response>' in prompt


async def test_constraints_reach_the_engine_from_every_spelling(client, engine, tokenizer):
    _script(engine, tokenizer, "x")
    cases = [
        ({"response_format": {"type": "json_object"}}, "json_object", "", CHAT),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": {"type": "integer"}},
                }
            },
            "json",
            '{"type":"integer"}',
            CHAT,
        ),
        ({"structured_outputs": {"regex": "a+"}}, "regex", "a+", CHAT),
        ({"guided_choice": ["a", "b"]}, "choice", '["a", "b"]', CHAT),
        ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"', COMPLETIONS),
        ({"guided_json": '{"type": "string"}'}, "json", '{"type":"string"}', COMPLETIONS),
    ]
    for fields, kind, value, path in cases:
        body = {"messages": MESSAGES} if path == CHAT else {"prompt": "hi"}
        result = await call_asgi(client.app, path, {**body, **fields})
        assert result.status == 200, (fields, result.body)
        spec = engine.added[-1].params.structured
        assert (spec.kind, spec.value) == (kind, value), fields


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
STRUCTURAL_TAG = {
    "type": "structural_tag",
    "structures": [{"begin": "<function=get_weather>", "schema": CITY, "end": "</function>"}],
    "triggers": ["<function="],
}
CANONICAL_TAG = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<function="],
        "tags": [
            {
                "type": "tag",
                "begin": "<function=get_weather>",
                "content": {"type": "json_schema", "json_schema": CITY},
                "end": "</function>",
            }
        ],
    },
}


async def test_structural_tag_reaches_the_engine_as_xgrammar_format(client, engine, tokenizer):
    """Issue 9: vLLM's structural_tag, in response_format (OpenAI-style structures and
    triggers, or xgrammar's format) and as structured_outputs.structural_tag (JSON text,
    as vLLM's StructuredOutputsParams types it): one canonical xgrammar tag each."""
    _script(engine, tokenizer, "x")
    new_style = {"type": "structural_tag", "format": CANONICAL_TAG["format"]}
    cases = [
        ({"response_format": STRUCTURAL_TAG}, "response_format"),
        ({"response_format": new_style}, "response_format"),
        (
            {"structured_outputs": {"structural_tag": json.dumps(STRUCTURAL_TAG)}},
            "structured_outputs.structural_tag",
        ),
        (
            {"structured_outputs": {"structural_tag": new_style}},
            "structured_outputs.structural_tag",
        ),
    ]
    for fields, param in cases:
        result = await call_asgi(client.app, CHAT, {"messages": MESSAGES, **fields})
        assert result.status == 200, (fields, result.body)
        spec = engine.added[-1].params.structured
        assert (spec.kind, spec.param) == ("structural_tag", param), fields
        assert json.loads(spec.value) == CANONICAL_TAG, fields


@pytest.mark.parametrize(
    ("pattern", "any_whitespace", "separators"),
    [("", False, (",", ":")), ("[ ]?", False, None), (r"\s*", True, None)],
)
async def test_whitespace_pattern_maps_to_json_layout(
    client, engine, tokenizer, pattern, any_whitespace, separators
):
    _script(engine, tokenizer, "x")
    fields = {"structured_outputs": {"json": CITY, "whitespace_pattern": pattern}}
    result = await call_asgi(client.app, CHAT, {"messages": MESSAGES, **fields})
    assert result.status == 200, result.body
    spec = engine.added[-1].params.structured
    assert (spec.kind, spec.any_whitespace, spec.separators) == ("json", any_whitespace, separators)


@pytest.mark.parametrize(
    ("fields", "kind", "param"),
    [
        ({"guided_json": CITY}, "json", "guided_json"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "c", "schema": CITY},
                }
            },
            "json",
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ],
)
@pytest.mark.parametrize(
    ("pattern", "any_whitespace", "separators"), [("", False, (",", ":")), (r"\s*", True, None)]
)
async def test_guided_whitespace_pattern_lays_out_every_json_constraint(
    client, engine, tokenizer, fields, kind, param, pattern, any_whitespace, separators
):
    """vLLM's top-level `guided_whitespace_pattern` was ignored (logged as unknown), so a
    client asking for compact JSON got the default layout."""
    _script(engine, tokenizer, "x")
    body = {"messages": MESSAGES, "guided_whitespace_pattern": pattern, **fields}
    result = await call_asgi(client.app, CHAT, body)
    assert result.status == 200, result.body
    spec = engine.added[-1].params.structured
    assert (spec.kind, spec.param) == (kind, param)
    assert (spec.any_whitespace, spec.separators) == (any_whitespace, separators)


async def test_tgi_grammar_reaches_the_engine(client, engine, tokenizer):
    _script(engine, tokenizer, "x")
    body = {"inputs": "hi", "parameters": {"grammar": {"type": "regex", "value": "[a-z]+"}}}
    result = await call_asgi(client.app, "/invocations", body)
    assert result.status == 200, result.body
    spec = engine.added[-1].params.structured
    assert (spec.kind, spec.value, spec.param) == ("regex", "[a-z]+", "parameters.grammar.value")


def _rebuild(events) -> tuple[str, list[dict], str]:
    """Join streamed deltas the way the SDK does: content, tool calls by index, finish.
    A chunk holds one entry per call index, as OpenAI's and vLLM's do (openai-python's
    stream helpers before their same-index merge stranded a second one)."""
    content, calls, finish = "", {}, None
    for event in events:
        if not isinstance(event, dict) or not event.get("choices"):
            continue
        choice = event["choices"][0]
        delta = choice["delta"]
        content += delta.get("content") or ""
        indices = [d["index"] for d in delta.get("tool_calls") or []]
        assert len(indices) == len(set(indices)), f"one index twice in a chunk: {indices}"
        for d in delta.get("tool_calls") or []:
            call = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
            if d.get("id"):
                assert call["id"] is None, "id sent twice"
                call["id"] = d["id"]
                assert d["type"] == "function" and d["function"]["name"]
                call["name"] = d["function"]["name"]
            call["arguments"] += d["function"].get("arguments") or ""
        finish = choice.get("finish_reason") or finish
    return content, [calls[i] for i in sorted(calls)], finish


async def test_streamed_auto_call_equals_non_streamed(client, engine, tokenizer):
    text = 'Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    _script(engine, tokenizer, text)
    body = {"messages": MESSAGES, "tools": [WEATHER, TIME]}
    whole = (await call_asgi(client.app, CHAT, body)).json["choices"][0]
    streamed = await call_asgi(client.app, CHAT, {**body, "stream": True})
    content, calls, finish = _rebuild(streamed.events)
    assert finish == whole["finish_reason"] == "tool_calls"
    assert content.strip() == whole["message"]["content"] == "Checking."
    [call] = whole["message"]["tool_calls"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (call["function"]["name"], json.loads(call["function"]["arguments"]))
    ]
    assert calls[0]["id"].startswith("call_")


async def test_streamed_named_tool_sends_name_first_then_arguments(client, engine, tokenizer):
    _script(engine, tokenizer, '{"city":"Oslo"}')
    body = {
        "messages": MESSAGES,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "stream": True,
    }
    streamed = await call_asgi(client.app, CHAT, body)
    content, calls, finish = _rebuild(streamed.events)
    assert content == "" and finish == "tool_calls"
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {
        "city": "Oslo"
    }
    # streamed or not, the arguments are the model's own text, as vLLM answers
    whole = (await call_asgi(client.app, CHAT, {**body, "stream": False})).json
    [call] = whole["choices"][0]["message"]["tool_calls"]
    assert call["function"]["arguments"] == calls[0]["arguments"] == '{"city":"Oslo"}'


async def test_two_streamed_calls_get_indices_zero_and_one(client, engine, tokenizer):
    """Clients join streamed tool-call deltas by `index`: two calls must arrive as 0 and
    1, each with its own id and name, or the SDK merges them into one broken call."""
    text = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    _script(engine, tokenizer, text)
    body = {"messages": MESSAGES, "tools": [WEATHER, TIME], "stream": True}
    streamed = await call_asgi(client.app, CHAT, body)
    opened = [
        (d["index"], d["function"]["name"])
        for event in streamed.events
        if isinstance(event, dict) and event.get("choices")
        for d in event["choices"][0]["delta"].get("tool_calls") or []
        if d.get("id")
    ]
    assert opened == [(0, "get_weather"), (1, "get_time")]
    _, calls, finish = _rebuild(streamed.events)
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Rome"}),
        ("get_time", {}),
    ]
    assert calls[0]["id"] != calls[1]["id"]


MISTRAL_STYLE_TEMPLATE = CHAT_TEMPLATE + "{# calls come back as [TOOL_CALLS] [...] #}"
THINKING_TEMPLATE = CHAT_TEMPLATE + "{# the answer starts with <think> #}"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_template_sent_in_chat_template_kwargs_sets_the_tool_format(
    make_client, engine, tokenizer, stream
):
    """The template a request renders with also decides how its output is parsed: one
    sent as chat_template_kwargs["chat_template"] is a Mistral-style one here, so a
    `[TOOL_CALLS]` answer is a tool call (it was parsed as Hermes, i.e. plain text)."""
    client = make_client(trust_request_chat_template=True)
    _script(
        engine, tokenizer, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    )
    body = {
        "messages": MESSAGES,
        "tools": [WEATHER],
        "chat_template_kwargs": {"chat_template": MISTRAL_STYLE_TEMPLATE},
        "stream": stream,
    }
    result = await call_asgi(client.app, CHAT, body)
    assert result.status == 200, result.body
    if stream:
        _, calls, finish = _rebuild(result.events)
        names = [(c["name"], json.loads(c["arguments"])) for c in calls]
    else:
        choice = result.json["choices"][0]
        finish = choice["finish_reason"]
        names = [
            (c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in choice["message"]["tool_calls"]
        ]
    assert finish == "tool_calls"
    assert names == [("get_weather", {"city": "Oslo"})]


async def test_a_template_sent_in_chat_template_kwargs_sets_the_reasoning_split(
    make_client, engine, tokenizer
):
    client = make_client(trust_request_chat_template=True)
    _script(engine, tokenizer, "<think>cold up north</think>Take a coat.")
    body = {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": THINKING_TEMPLATE}}
    message = (await call_asgi(client.app, CHAT, body)).json["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("cold up north", "Take a coat.")
