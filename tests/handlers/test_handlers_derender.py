"""vLLM's derender routes over the scripted engine: a chat or completion rendered
(`.../render`), run as token ids (`/inference/v1/generate`) and derendered gives the
response the chat or completion route gives for the same engine output: the same text,
tool calls, reasoning, stop-string cut, finish reason and logprobs; and every bound of a
caller-supplied body is a 400 naming its field."""

from __future__ import annotations

from typing import Any

import pytest
from fake_engine import FakeEngine, Script
from handlers_testing import (
    EOS_ID,
    MAX_MODEL_LEN,
    assert_openai_error,
    encode,
    long_context_info,
)

from engine.tokenizer import Tokenizer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
DERENDER_CHAT = "/v1/chat/completions/derender"
DERENDER_COMPLETION = "/v1/completions/derender"
GENERATE = "/inference/v1/generate"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _without_call_ids(message: dict[str, Any]) -> dict[str, Any]:
    calls = [{**c, "id": None} for c in message.get("tool_calls") or []]
    return {**message, "tool_calls": calls}


def _round_trip(client, chat: dict[str, Any]) -> tuple[dict, dict]:
    """(the chat route's response, the render → generate → derender one)."""
    direct = client.simulate_post(CHAT, json=chat)
    assert direct.status_code == 200, direct.text
    rendered = client.simulate_post(f"{CHAT}/render", json=chat)
    assert rendered.status_code == 200, rendered.text
    generated = client.simulate_post(GENERATE, json=rendered.json)
    assert generated.status_code == 200, generated.text
    derendered = client.simulate_post(
        DERENDER_CHAT,
        json={
            "model": "tiny",
            "generate_response": generated.json,
            "prompt_tokens": len(rendered.json["token_ids"]),
            "chat_request": chat,
        },
    )
    assert derendered.status_code == 200, derendered.text
    return direct.json, derendered.json


@pytest.mark.parametrize(
    ("text", "fields"),
    [
        ("It is sunny in Paris.", {}),
        ("Sunny. STOP and more", {"stop": ["STOP"]}),
        (
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
            {"tools": [WEATHER]},
        ),
        ("Cloudy.", {"logprobs": True, "top_logprobs": 2}),
        ("Cloudy.", {"n": 2, "seed": 3}),
        ("Cloudy.", {"skip_special_tokens": False}),  # the stop token's text still left out
    ],
    ids=["text", "stop-string", "tool-call", "logprobs", "n", "special-tokens"],
)
def test_chat_derender_answers_as_the_chat_route(
    client, engine: FakeEngine, tokenizer: Tokenizer, model_dir, text: str, fields: dict
) -> None:
    engine.info = long_context_info(model_dir, tokenizer)  # the tools' long prompt
    engine.script = Script(token_ids=[*encode(tokenizer, text), EOS_ID])
    direct, derendered = _round_trip(client, {"model": "tiny", "messages": MESSAGES, **fields})
    assert len(derendered["choices"]) == len(direct["choices"]) == fields.get("n", 1)
    for want, got in zip(direct["choices"], derendered["choices"], strict=True):
        assert _without_call_ids(got["message"]) == _without_call_ids(want["message"])
        assert (got["finish_reason"], got["stop_reason"]) == (
            want["finish_reason"],
            want["stop_reason"],
        )
        assert got["logprobs"] == want["logprobs"]
    assert derendered["usage"] == direct["usage"]
    assert derendered["object"] == "chat.completion" and derendered["model"] == "tiny"
    if "tools" in fields:
        assert derendered["choices"][0]["finish_reason"] == "tool_calls"
        (call,) = derendered["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and call["id"]


def test_chat_derender_splits_reasoning_as_the_chat_route(
    make_client, engine: FakeEngine, tokenizer: Tokenizer
) -> None:
    client = make_client(reasoning_parser="think")
    engine.script = Script(token_ids=[*encode(tokenizer, "<think>Warm.</think>Sunny."), EOS_ID])
    direct, derendered = _round_trip(client, {"model": "tiny", "messages": MESSAGES})
    message = derendered["choices"][0]["message"]
    assert message == direct["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Warm.", "Sunny.")


def test_without_the_chat_request_the_tokens_are_decoded(
    client, engine: FakeEngine, tokenizer: Tokenizer
) -> None:
    """vLLM's behaviour: no parsing, special tokens skipped; vLLM's `token_id:<id>`
    logprob names are read as ids and written as the tokens' text."""
    ids = [*encode(tokenizer, " Paris."), EOS_ID]
    logprobs = {
        "content": [
            {
                "token": f"token_id:{t}",
                "logprob": -0.25,
                "top_logprobs": [{"token_id": 5, "logprob": -1.0}],
            }
            for t in ids
        ]
    }
    generated = {
        "request_id": "gen-1",
        "choices": [{"index": 0, "token_ids": ids, "finish_reason": "stop", "logprobs": logprobs}],
        "prompt_token_ids": [11, 12, 13],
    }
    result = client.simulate_post(DERENDER_CHAT, json={"generate_response": generated})
    assert result.status_code == 200, result.text
    body = result.json
    (choice,) = body["choices"]
    assert choice["message"]["content"] == " Paris." and choice["finish_reason"] == "stop"
    assert [e["token"] for e in choice["logprobs"]["content"]] == [
        tokenizer.decode([t], skip_special_tokens=False) for t in ids
    ]
    assert choice["logprobs"]["content"][0]["top_logprobs"][0]["token"] == tokenizer.decode([5])
    assert body["id"] == "gen-1"
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (3, len(ids))
    assert usage["total_tokens"] == 3 + len(ids)
    assert engine.added == []  # nothing runs
    del generated["prompt_token_ids"]  # the generate response's usage says it then
    generated["usage"] = {"prompt_tokens": 5, "completion_tokens": len(ids), "total_tokens": 9}
    result = client.simulate_post(DERENDER_CHAT, json={"generate_response": generated})
    assert result.json["usage"]["prompt_tokens"] == 5


def test_completion_derender_answers_as_the_completion_route(
    client, engine: FakeEngine, tokenizer: Tokenizer
) -> None:
    engine.script = Script(token_ids=[*encode(tokenizer, " pie is sweet"), EOS_ID])
    request = {"model": "tiny", "prompt": ["apple", "banana"], "max_tokens": 6, "logprobs": 2}
    direct = client.simulate_post(COMPLETIONS, json=request)
    assert direct.status_code == 200, direct.text
    rendered = client.simulate_post(f"{COMPLETIONS}/render", json=request)
    assert rendered.status_code == 200, rendered.text
    generated = [client.simulate_post(GENERATE, json=r).json for r in rendered.json]
    derendered = client.simulate_post(
        DERENDER_COMPLETION,
        json={
            "generate_responses": generated,
            "prompt_tokens": [len(r["token_ids"]) for r in rendered.json],
            "completion_request": request,
        },
    )
    assert derendered.status_code == 200, derendered.text
    body = derendered.json
    assert body["object"] == "text_completion" and body["usage"] == direct.json["usage"]
    for want, got in zip(direct.json["choices"], body["choices"], strict=True):
        for field in ("index", "text", "finish_reason", "stop_reason", "logprobs"):
            assert got[field] == want[field], field


@pytest.mark.parametrize(
    ("choice", "param"),
    [
        ({"index": 0, "token_ids": [5, 10**6]}, "generate_response.choices[0].token_ids[1]"),
        (
            {"index": 0, "token_ids": [5] * (MAX_MODEL_LEN + 1)},
            "generate_response.choices[0].token_ids",
        ),
        ({"index": 0, "token_ids": []}, "generate_response.choices[0].token_ids"),
        ({"index": 0, "token_ids": [5, -1]}, "generate_response.choices[0].token_ids"),
        (
            {
                "index": 0,
                "token_ids": [5, 6],
                "logprobs": {"content": [{"token_id": 5, "logprob": -1.0}]},
            },
            "generate_response.choices[0].logprobs.content",
        ),
        (
            {
                "index": 0,
                "token_ids": [5],
                "logprobs": {"content": [{"token": "five", "logprob": -1.0}]},
            },
            "generate_response.choices[0].logprobs.content[0].token",
        ),
        (
            {
                "index": 0,
                "token_ids": [5],
                "logprobs": {"content": [{"token_id": 10**6, "logprob": -1.0}]},
            },
            "generate_response.choices[0].logprobs.content[0]",
        ),
        (
            {
                "index": 0,
                "token_ids": [5],
                "logprobs": {
                    "content": [
                        {
                            "token_id": 5,
                            "logprob": -1.0,
                            "top_logprobs": [{"token_id": 1, "logprob": -2.0}] * 21,
                        }
                    ]
                },
            },
            "generate_response.choices[0].logprobs.content[0].top_logprobs",
        ),
    ],
    ids=[
        "outside-vocab",
        "past-context",
        "empty",
        "negative",
        "logprobs-count",
        "logprob-by-text",
        "logprob-outside-vocab",
        "too-many-top",
    ],
)
def test_a_bad_generate_response_is_a_400_naming_the_field(
    client, engine: FakeEngine, choice: dict, param: str
) -> None:
    body = {"generate_response": {"request_id": "g", "choices": [choice]}}
    assert_openai_error(client.simulate_post(DERENDER_CHAT, json=body), 400, param=param)


def test_bounds_of_the_whole_body_are_400s(client, engine: FakeEngine) -> None:
    one = {"index": 0, "token_ids": [5]}
    many = {"request_id": "g", "choices": [{**one, "index": i} for i in range(17)]}
    result = client.simulate_post(DERENDER_CHAT, json={"generate_response": many})
    assert_openai_error(result, 400, param="generate_response.choices")
    twice = {"request_id": "g", "choices": [one, one]}
    result = client.simulate_post(DERENDER_CHAT, json={"generate_response": twice})
    assert_openai_error(result, 400, param="generate_response.choices")
    single = {"request_id": "g", "choices": [one]}
    result = client.simulate_post(DERENDER_CHAT, json={"generate_response": single, "stream": True})
    assert_openai_error(result, 400, param="stream")
    result = client.simulate_post(
        DERENDER_COMPLETION, json={"generate_responses": [single], "prompt_tokens": [1, 2]}
    )
    assert_openai_error(result, 400, param="prompt_tokens")
    result = client.simulate_post(DERENDER_COMPLETION, json={"generate_responses": []})
    assert_openai_error(result, 400, param="generate_responses")
    sixteen = {"request_id": "g", "choices": many["choices"][:16]}
    result = client.simulate_post(DERENDER_COMPLETION, json={"generate_responses": [sixteen] * 65})
    assert_openai_error(result, 400, param="generate_responses")
    result = client.simulate_post(
        DERENDER_CHAT,
        json={"generate_response": single, "chat_request": {"messages": MESSAGES, "top_p": 5}},
    )
    assert_openai_error(result, 400, param="chat_request.top_p")
    result = client.simulate_post(
        DERENDER_CHAT, json={"generate_response": single, "model": "other"}
    )
    assert result.status_code == 404
