"""SageMaker /invocations dispatch (chat, completion, TGI) and /tokenize, /detokenize."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine, Script
from handlers_testing import EOS_ID, assert_openai_error, call_asgi, encode

from engine.tokenizer import Tokenizer

pytestmark = pytest.mark.anyio


@pytest.fixture
def answer(engine: FakeEngine, tokenizer: Tokenizer) -> str:
    text = "Hello world!"
    engine.script = Script(token_ids=[*encode(tokenizer, text), EOS_ID], step_delay=0.001)
    return text


async def test_chat_body_is_chat(client, answer):
    body = {"messages": [{"role": "user", "content": "hi"}]}
    result = await call_asgi(client.app, "/invocations", body)
    assert result.json["object"] == "chat.completion"
    assert result.json["choices"][0]["message"]["content"] == answer


async def test_chat_body_streams_when_asked(client, answer):
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    result = await call_asgi(client.app, "/invocations", body)
    assert result.headers["content-type"].startswith("text/event-stream")
    assert result.events[0]["object"] == "chat.completion.chunk"
    assert result.events[-1] == "[DONE]"


async def test_prompt_body_is_completion_whatever_the_content_type(client, answer):
    result = await call_asgi(
        client.app, "/invocations", {"prompt": "hi"}, headers={"content-type": "text/plain"}
    )
    assert result.json["object"] == "text_completion"
    assert result.json["choices"][0]["text"] == answer


async def test_tgi_body(client, engine: FakeEngine, answer):
    body = {"inputs": "Say hi", "parameters": {"max_new_tokens": 20, "details": True}}
    result = await call_asgi(client.app, "/invocations", body)
    [item] = result.json
    assert item["generated_text"] == answer
    details = item["details"]
    assert details["finish_reason"] == "eos_token"
    assert details["generated_tokens"] == len(details["tokens"])
    assert details["tokens"][-1]["special"] is True
    params = engine.added[0].params
    assert params.temperature == 0.0 and params.max_tokens == 20  # TGI: greedy unless sampling


async def test_tgi_full_text_sampling_and_stop(client, engine: FakeEngine, answer):
    body = {
        "inputs": "Say: ",
        "parameters": {"return_full_text": True, "temperature": 0.7, "stop": ["world"]},
    }
    result = await call_asgi(client.app, "/invocations", body)
    assert result.json == [{"generated_text": "Say: Hello world", "details": None}]
    assert engine.added[0].params.temperature == 0.7
    assert engine.added[0].params.max_tokens == 100  # TGI's default


async def test_tgi_stream(client, answer):
    body = {"inputs": "Say hi", "stream": True}
    result = await call_asgi(client.app, "/invocations", body)
    events = result.events
    assert "[DONE]" not in events  # TGI streams end without it
    assert [e["index"] for e in events] == list(range(len(events)))
    assert "".join(e["token"]["text"] for e in events) == answer
    assert events[-1]["generated_text"] == answer
    assert events[-1]["details"]["finish_reason"] == "eos_token"
    assert all(e["generated_text"] is None for e in events[:-1])


async def test_tgi_engine_failure_in_stream(client, engine: FakeEngine):
    engine.script = Script(token_ids=[5, 6, 7], fail_at_step=1, step_delay=0.001)
    result = await call_asgi(client.app, "/invocations", {"inputs": "x", "stream": True})
    assert result.events[-1]["error_type"] == "generation"


@pytest.mark.parametrize(
    "body",
    [{"foo": 1}, {}, [1, 2], "messages", {"text": "no API has this shape"}],
)
async def test_unknown_body_lists_what_is_accepted(client, engine: FakeEngine, body):
    result = await call_asgi(client.app, "/invocations", body)
    assert result.status == 400
    message = result.json["error"]["message"]
    assert "messages" in message and "prompt" in message and "inputs" in message
    assert "'input'" in message
    assert engine.added == []


async def test_invalid_chat_body_keeps_the_precise_error(client):
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 9}
    result = await call_asgi(client.app, "/invocations", body)
    assert result.status == 400 and result.json["error"]["param"] == "temperature"


def test_tokenize_prompt_and_messages(client, tokenizer: Tokenizer):
    result = client.simulate_post(
        "/tokenize", json={"prompt": "Hello 😀", "return_token_strs": True}
    ).json
    assert result["tokens"] == tokenizer.encode("Hello 😀")
    assert result["count"] == len(result["tokens"]) and result["max_model_len"] == 256
    assert result["token_strs"] == tokenizer.convert_ids_to_tokens(result["tokens"])
    messages = [{"role": "user", "content": "hi"}]
    chat = client.simulate_post("/tokenize", json={"messages": messages}).json
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert chat["tokens"] == encode(tokenizer, rendered)
    assert chat["token_strs"] is None


def test_detokenize_round_trip(client, tokenizer: Tokenizer):
    text = "<|im_start|>user\nEmoji 😀 你好"
    tokens = encode(tokenizer, text)
    assert client.simulate_post("/detokenize", json={"tokens": tokens}).json == {"prompt": text}
    result = client.simulate_post("/detokenize", json={"tokens": [1, 10_000]})
    assert_openai_error(result, 400, "tokens")
    result = client.simulate_post("/detokenize", json={"tokens": [1], "model": "nope"})
    assert_openai_error(result, 404, "model")
