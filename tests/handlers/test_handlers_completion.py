"""/v1/completions: batches, token-id prompts, echo, logprobs, streaming."""

from __future__ import annotations

import pytest
from fake_engine import AddedRequest, FakeEngine, Script
from handlers_testing import EOS_ID, call_asgi, encode

from engine.tokenizer import Tokenizer

COMPLETIONS = "/v1/completions"

pytestmark = pytest.mark.anyio


async def test_single_prompt_defaults(client, engine: FakeEngine, tokenizer: Tokenizer):
    engine.script = Script(token_ids=[*encode(tokenizer, " Paris."), EOS_ID])
    result = await call_asgi(client.app, COMPLETIONS, {"prompt": "The capital of France is"})
    body = result.json
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == " Paris."
    assert body["choices"][0]["finish_reason"] == "stop"
    added = engine.added[0]
    assert added.prompt_token_ids == tokenizer.encode("The capital of France is")
    assert added.params.max_tokens == 16  # OpenAI's completion default


async def test_batch_of_prompts_and_n(client, engine: FakeEngine, tokenizer: Tokenizer):
    def script(request: AddedRequest) -> Script:
        index = int(request.request_id.rsplit("-", 1)[1])
        return Script(token_ids=[*encode(tokenizer, f" {index}"), EOS_ID])

    engine.script = script
    body = {"prompt": ["apple", "banana"], "n": 2, "max_tokens": 5}
    result = await call_asgi(client.app, COMPLETIONS, body)
    assert result.status == 200, result.json
    choices = result.json["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices] == [" 0", " 1", " 2", " 3"]
    prompts = [r.prompt_token_ids for r in sorted(engine.added, key=lambda r: r.request_id)]
    apple, banana = tokenizer.encode("apple"), tokenizer.encode("banana")
    assert prompts == [apple, apple, banana, banana]
    usage = result.json["usage"]
    assert usage["prompt_tokens"] == len(apple) + len(banana)
    assert usage["completion_tokens"] == sum(len(encode(tokenizer, f" {i}")) + 1 for i in range(4))


async def test_token_id_prompts_and_echo(client, engine: FakeEngine, tokenizer: Tokenizer):
    engine.script = Script(token_ids=[*encode(tokenizer, " cherry"), EOS_ID])
    ids = encode(tokenizer, "apple banana")
    result = await call_asgi(client.app, COMPLETIONS, {"prompt": ids, "echo": True})
    assert result.json["choices"][0]["text"] == "apple banana cherry"
    assert engine.added[0].prompt_token_ids == ids
    result = await call_asgi(
        client.app, COMPLETIONS, {"prompt": [ids, ids[:1]], "echo": True, "stream": True}
    )
    texts: dict[int, str] = {}
    for event in result.events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    first = tokenizer.decode(ids[:1])
    assert texts == {0: "apple banana cherry", 1: first + " cherry"}
    assert result.events[-1] == "[DONE]"


async def test_logprobs_completion_format(client, engine: FakeEngine, tokenizer: Tokenizer):
    tokens = encode(tokenizer, " banana")
    engine.script = Script(token_ids=[*tokens, EOS_ID])
    result = await call_asgi(client.app, COMPLETIONS, {"prompt": "apple", "logprobs": 3})
    logprobs = result.json["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(tokens) + 1
    assert logprobs["text_offset"][0] == 0
    assert all(len(top) >= 1 for top in logprobs["top_logprobs"])
    assert engine.added[0].params.logprobs == 3
    streamed = await call_asgi(
        client.app, COMPLETIONS, {"prompt": "apple", "logprobs": 3, "stream": True}
    )
    tokens_streamed = [
        t for e in streamed.events[:-1] for c in e["choices"] for t in c["logprobs"]["tokens"]
    ]
    assert tokens_streamed == logprobs["tokens"]
    offsets = [
        o for e in streamed.events[:-1] for c in e["choices"] for o in c["logprobs"]["text_offset"]
    ]
    assert offsets == logprobs["text_offset"]


async def test_stream_stop_string_and_usage(client, engine: FakeEngine, tokenizer: Tokenizer):
    engine.script = Script(token_ids=encode(tokenizer, "Stop here. STOP now."), step_delay=0.001)
    body = {
        "prompt": "x",
        "stream": True,
        "stop": [". STOP"],
        "max_tokens": 50,
        "stream_options": {"include_usage": True},
    }
    events = (await call_asgi(client.app, COMPLETIONS, body)).events
    text = "".join(c["text"] for e in events[:-2] for c in e["choices"])
    assert text == "Stop here"
    assert events[-2]["usage"]["prompt_tokens"] == len(tokenizer.encode("x"))
    assert engine.aborted == [engine.added[0].request_id]


async def test_prompt_too_long_names_the_prompt(client, engine: FakeEngine):
    result = await call_asgi(client.app, COMPLETIONS, {"prompt": ["ok", "word " * 400]})
    assert result.status == 400
    assert result.json["error"]["param"] == "prompt[1]"
    assert engine.added == []


# -- scoring: echo + logprobs, max_tokens 0, prompt_logprobs (vLLM's shapes) -------------
async def test_echo_with_logprobs_lists_prompt_then_output(
    client, engine: FakeEngine, tokenizer: Tokenizer
):
    engine.script = Script(token_ids=[*encode(tokenizer, " cherry"), EOS_ID])
    ids = encode(tokenizer, "apple banana")
    body = {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1}
    choice = (await call_asgi(client.app, COMPLETIONS, body)).json["choices"][0]
    assert engine.added[0].params.prompt_logprobs == 1
    lp = choice["logprobs"]
    generated = encode(tokenizer, " cherry")[:1]
    assert lp["tokens"] == [tokenizer.decode([t]) for t in [*ids, *generated]]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1 : len(ids)] == [-i / 10 for i in range(1, len(ids))]
    assert lp["token_logprobs"][len(ids)] == -0.5  # the generated token's (fake) logprob
    # Each top_logprobs entry: the top 1 plus the token itself (vLLM's k + 1).
    assert all(len(top) == 2 for top in lp["top_logprobs"][1 : len(ids)])
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert lp["text_offset"] == offsets
    assert choice["text"] == "apple banana" + tokenizer.decode(generated)
    # vLLM also reports the engine's prompt logprobs on the choice for echo + logprobs.
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(ids)


async def test_max_tokens_zero_scores_the_prompt_only(
    client, engine: FakeEngine, tokenizer: Tokenizer
):
    ids = encode(tokenizer, "apple banana cherry")
    body = {"prompt": ["apple banana cherry"] * 2, "echo": True, "logprobs": 0, "max_tokens": 0}
    result = await call_asgi(client.app, COMPLETIONS, body)
    assert result.status == 200, result.json
    choices = result.json["choices"]
    assert [c["text"] for c in choices] == ["apple banana cherry", "apple banana cherry"]
    for choice in choices:
        assert choice["finish_reason"] == "length"
        assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in ids]
        assert len(choice["logprobs"]["token_logprobs"]) == len(ids)
    assert result.json["usage"]["completion_tokens"] == 0
    assert all(r.params.max_tokens == 0 for r in engine.added)
    streamed = await call_asgi(client.app, COMPLETIONS, {**body, "stream": True})
    chunks = [c for e in streamed.events[:-1] for c in e["choices"]]
    assert sorted(c["text"] for c in chunks) == ["apple banana cherry"] * 2
    assert all(c["logprobs"]["token_logprobs"][0] is None for c in chunks)
    assert all(c["finish_reason"] == "length" for c in chunks)


async def test_prompt_logprobs_field_in_vllm_shape(
    client, engine: FakeEngine, tokenizer: Tokenizer
):
    ids = encode(tokenizer, "apple banana")
    body = {"prompt": ids, "prompt_logprobs": 2, "max_tokens": 2}
    choice = (await call_asgi(client.app, COMPLETIONS, body)).json["choices"][0]
    assert choice["logprobs"] is None  # prompt_logprobs alone adds no `logprobs`
    entries = choice["prompt_logprobs"]
    assert entries is not None, (engine.added[0].params, choice)
    assert entries[0] is None and len(entries) == len(ids)
    second = entries[1]
    assert next(iter(second)) == str(ids[1])  # the prompt token first, then the top k
    assert second[str(ids[1])] == {
        "logprob": -0.1,
        "rank": 2,
        "decoded_token": tokenizer.decode([ids[1]]),
    }
    assert [v["rank"] for v in list(second.values())[1:]] == [1, 2]
    plain = (await call_asgi(client.app, COMPLETIONS, {"prompt": ids})).json["choices"][0]
    assert plain["prompt_logprobs"] is None
    assert engine.added[-1].params.prompt_logprobs is None


async def test_chat_prompt_logprobs_on_the_response(client, engine: FakeEngine):
    body = {"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 1}
    result = await call_asgi(client.app, "/v1/chat/completions", body)
    entries = result.json["prompt_logprobs"]
    assert entries[0] is None
    assert len(entries) == len(engine.added[0].prompt_token_ids)
    assert all(len(e) in (1, 2) for e in entries[1:])
    assert engine.added[0].params.prompt_logprobs == 1


async def test_echo_max_tokens_zero_without_logprobs(client, engine: FakeEngine):
    body = {"prompt": "apple banana", "echo": True, "max_tokens": 0}
    result = await call_asgi(client.app, COMPLETIONS, body)
    assert result.status == 200, result.json
    assert result.json["choices"][0]["text"] == "apple banana"
    assert result.json["choices"][0]["logprobs"] is None
    params = engine.added[0].params
    assert params.max_tokens == 0 and params.prompt_logprobs is None
