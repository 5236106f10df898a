"""`POST /inference/v1/generate` (vLLM's token-in-token-out route) over the scripted engine:
token ids in, token ids out, vLLM's sampling_params mapped to the engine's, text mode,
logprobs by id, streaming, and errors named by the generate request's fields."""

from __future__ import annotations

import msgspec
import pytest
from fake_engine import FakeEngine, Script
from handlers_testing import EOS_ID, assert_openai_error, call_asgi, encode

from engine.tokenizer import Tokenizer

GENERATE = "/inference/v1/generate"

pytestmark = pytest.mark.anyio


async def test_tokens_in_tokens_out(client, engine: FakeEngine, tokenizer: Tokenizer):
    out = encode(tokenizer, " Paris.")
    engine.script = Script(token_ids=[*out, EOS_ID])
    prompt = encode(tokenizer, "The capital of France is")
    result = await call_asgi(client.app, GENERATE, {"token_ids": prompt, "return_token_ids": True})
    assert result.status == 200, result.json
    body = result.json
    assert body["request_id"].startswith("generate-tokens-") and body["output_mode"] == "tokens"
    (choice,) = body["choices"]
    assert choice["token_ids"] == [*out, EOS_ID] and choice["finish_reason"] == "stop"
    assert "text" not in choice  # vLLM's tokens-mode choice has none
    assert body["prompt_token_ids"] == prompt
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["completion_tokens"] == len(out) + 1
    added = engine.added[0]
    assert added.prompt_token_ids == prompt  # no special tokens added to given ids
    # max_tokens left out fills the context (vLLM's SamplingParams default of 16 does not)
    assert added.params.max_tokens == engine.info.max_model_len - len(prompt)


async def test_sampling_params_reach_the_engine(client, engine: FakeEngine, tokenizer: Tokenizer):
    engine.script = Script(token_ids=[7, 8, EOS_ID])
    sampling = {
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.1,
        "seed": 3,
        "max_tokens": 5,
        "min_tokens": 1,
        "stop_token_ids": [9],
        "logit_bias": {"11": 2.0},
        "repetition_penalty": 1.1,
        "detokenize": True,
        "output_kind": 2,
        "extra_args": None,
    }
    result = await call_asgi(
        client.app, GENERATE, {"token_ids": [5, 6], "sampling_params": sampling}
    )
    assert result.status == 200, result.json
    params = engine.added[0].params
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.5, 0.9, 20, 0.1)
    assert params.max_tokens == 5 and params.min_tokens == 1 and params.seed == 3
    assert 9 in params.stop_token_ids and params.logit_bias == {11: 2.0}


async def test_text_mode_and_stop_strings(client, engine: FakeEngine, tokenizer: Tokenizer):
    engine.script = Script(token_ids=[*encode(tokenizer, " one two three"), EOS_ID])
    body = {
        "token_ids": encode(tokenizer, "count:"),
        "output_mode": "text",
        "sampling_params": {"stop": [" three"], "max_tokens": 30},
    }
    result = await call_asgi(client.app, GENERATE, body)
    assert result.status == 200, result.json
    (choice,) = result.json["choices"]
    assert choice["text"] == " one two" and choice["stop_reason"] == " three"
    assert tokenizer.decode(choice["token_ids"]).startswith(" one two")


async def test_logprobs_name_tokens_by_id(client, engine: FakeEngine, tokenizer: Tokenizer):
    out = encode(tokenizer, " banana")
    engine.script = Script(token_ids=[*out, EOS_ID])
    body = {"token_ids": [5, 6], "sampling_params": {"logprobs": 2, "max_tokens": 8}}
    result = await call_asgi(client.app, GENERATE, body)
    content = result.json["choices"][0]["logprobs"]["content"]
    assert [entry["token_id"] for entry in content] == [*out, EOS_ID]
    for entry in content:
        assert isinstance(entry["logprob"], float) and entry["rank"] >= 1
        tops = entry["top_logprobs"]
        assert 1 <= len(tops) <= 2 and tops[0]["token_id"] == entry["token_id"]
    text = await call_asgi(client.app, GENERATE, {**body, "output_mode": "text"})
    tokens = [e["token"] for e in text.json["choices"][0]["logprobs"]["content"]]
    assert "".join(tokens[: len(out)]) == " banana"


async def test_stream_sends_token_deltas_then_usage(
    client, engine: FakeEngine, tokenizer: Tokenizer
):
    out = encode(tokenizer, " a b c")
    engine.script = Script(token_ids=[*out, EOS_ID])
    body = {
        "token_ids": [5, 6, 7],
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
        "sampling_params": {"max_tokens": 10},
    }
    result = await call_asgi(client.app, GENERATE, body)
    assert result.status == 200
    events = result.events
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["prompt_token_ids"] == [5, 6, 7]
    assert all("prompt_token_ids" not in chunk for chunk in chunks[1:])
    tokens = [t for chunk in chunks for choice in chunk["choices"] for t in choice["token_ids"]]
    assert tokens == [*out, EOS_ID]
    finishes = [c["finish_reason"] for chunk in chunks for c in chunk["choices"]]
    assert finishes[-1] == "stop" and all(f is None for f in finishes[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(tokens)


async def test_n_choices(client, engine: FakeEngine):
    engine.script = Script(token_ids=[7, EOS_ID])
    body = {"token_ids": [5], "sampling_params": {"n": 3, "max_tokens": 4}}
    result = await call_asgi(client.app, GENERATE, body)
    assert [c["index"] for c in result.json["choices"]] == [0, 1, 2]
    assert len(engine.added) == 3


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [1, -2]}, "token_ids"),
        ({"token_ids": [10**9]}, "token_ids"),
        ({"token_ids": [1], "sampling_params": {"top_p": 2.0}}, "sampling_params.top_p"),
        (
            {"token_ids": [1], "sampling_params": {"max_tokens": 10**7}},
            "sampling_params.max_tokens",
        ),
        ({"token_ids": [1], "sampling_params": {"logprobs": -1}}, "sampling_params.logprobs"),
        ({"token_ids": [1], "sampling_params": {"nonsense": 1}}, "sampling_params.nonsense"),
        (
            {"token_ids": [1], "sampling_params": {"watermarking": {}}},
            "sampling_params.watermarking",
        ),
        (
            {"token_ids": [1], "sampling_params": {"detokenize": False, "stop": ["x"]}},
            "sampling_params.stop",
        ),
        (
            {"token_ids": [1], "output_mode": "text", "sampling_params": {"detokenize": False}},
            "output_mode",
        ),
        ({"token_ids": [1], "features": {"mm_hashes": {}}}, "features"),
        ({"token_ids": [1], "output_mode": "words"}, "output_mode"),
    ],
)
def test_bad_requests_name_the_field(client, engine: FakeEngine, body, param):
    result = client.simulate_post(GENERATE, json=body)
    assert_openai_error(result, 400, param=param)
    assert engine.added == []


# -- render: the generate request a chat or completion would run ------------------------

RENDER_CHAT = "/v1/chat/completions/render"
RENDER_COMPLETION = "/v1/completions/render"
MESSAGES = [{"role": "user", "content": "Name a color."}]


def test_chat_render_runs_as_the_chat_would(client, engine: FakeEngine):
    """The render's token ids are the chat's prompt; fed to generate, the engine gets the
    prompt and the sampling parameters the chat route itself sends."""
    engine.script = Script(token_ids=[7, EOS_ID])
    chat = {"messages": MESSAGES, "temperature": 0.4, "top_p": 0.8, "seed": 5, "stop": ["x"]}
    rendered = client.simulate_post(RENDER_CHAT, json=chat)
    assert rendered.status_code == 200, rendered.text
    body = rendered.json
    assert body["request_id"].startswith("chatcmpl-") and body["stream"] is False
    sampling = body["sampling_params"]
    assert (sampling["temperature"], sampling["top_p"], sampling["seed"]) == (0.4, 0.8, 5)
    assert sampling["stop"] == ["x"] and sampling["max_tokens"] > 0
    assert client.simulate_post("/v1/chat/completions", json=chat).status_code == 200
    generated = client.simulate_post(GENERATE, json=body)
    assert generated.status_code == 200, generated.text
    via_chat, via_generate = engine.added
    assert via_generate.prompt_token_ids == via_chat.prompt_token_ids == body["token_ids"]
    assert via_generate.params == via_chat.params


@pytest.mark.parametrize(
    "constraint",
    [
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_object"}, "guided_whitespace_pattern": ""},
        {"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": "\\s*"}},
        {"structured_outputs": {"json_object": True, "whitespace_pattern": "[ ]?"}},
    ],
    ids=["default", "compact", "any-whitespace", "one-line"],
)
def test_chat_render_keeps_the_json_layout(client, engine: FakeEngine, constraint):
    """A JSON constraint's layout (any whitespace, none, the one-line default) survives
    render → generate: the engine gets the same constraint both ways."""
    engine.script = Script(token_ids=[7, EOS_ID])
    chat = {"messages": MESSAGES, **constraint}
    rendered = client.simulate_post(RENDER_CHAT, json=chat)
    assert rendered.status_code == 200, rendered.text
    assert client.simulate_post("/v1/chat/completions", json=chat).status_code == 200
    assert client.simulate_post(GENERATE, json=rendered.json).status_code == 200
    assert engine.added[0].params.structured is not None
    # the same constraint; only the field its compile errors would name differs
    unnamed = [msgspec.structs.replace(r.params.structured, param="") for r in engine.added]
    assert unnamed[0] == unnamed[1]


def test_completion_render_gives_one_request_per_prompt(client, engine: FakeEngine, tokenizer):
    body = {"prompt": ["apple", "banana pie"], "max_tokens": 7, "logprobs": 2}
    rendered = client.simulate_post(RENDER_COMPLETION, json=body)
    assert rendered.status_code == 200, rendered.text
    first, second = rendered.json
    assert first["token_ids"] == tokenizer.encode("apple")
    assert second["token_ids"] == tokenizer.encode("banana pie")
    assert first["sampling_params"]["max_tokens"] == 7
    assert first["sampling_params"]["logprobs"] == 2
    assert engine.added == []  # rendering runs nothing


def test_render_refuses_what_the_route_refuses(client, engine: FakeEngine):
    result = client.simulate_post(RENDER_CHAT, json={"messages": MESSAGES, "top_p": 5})
    assert_openai_error(result, 400, param="top_p")
    result = client.simulate_post(RENDER_COMPLETION, json={"prompt": [10**9]})
    assert_openai_error(result, 400, param="prompt")


def test_messages_render_runs_as_the_messages_call_would(client, engine: FakeEngine):
    """Anthropic's Messages body rendered: fed to generate, the engine gets what
    /v1/messages itself sends; a bad body is refused in Anthropic's error shape."""
    engine.script = Script(token_ids=[7, EOS_ID])
    body = {"model": "tiny", "max_tokens": 9, "messages": MESSAGES, "temperature": 0.3}
    rendered = client.simulate_post("/v1/messages/render", json=body)
    assert rendered.status_code == 200, rendered.text
    assert rendered.json["sampling_params"]["max_tokens"] == 9
    assert client.simulate_post("/v1/messages", json=body).status_code == 200
    assert client.simulate_post(GENERATE, json=rendered.json).status_code == 200
    via_messages, via_generate = engine.added
    assert via_generate.prompt_token_ids == via_messages.prompt_token_ids
    assert via_generate.params == via_messages.params
    bad = client.simulate_post("/v1/messages/render", json={"model": "tiny", "messages": []})
    assert bad.status_code == 400 and bad.json["type"] == "error"


def test_responses_render_runs_as_the_responses_call_would(client, engine: FakeEngine):
    """A Responses body rendered: fed to generate, the engine gets what /v1/responses
    sends; with previous_response_id the stored conversation is part of the prompt."""
    engine.script = Script(token_ids=[7, EOS_ID])
    body = {"model": "tiny", "input": "Name a color.", "max_output_tokens": 6}
    rendered = client.simulate_post("/v1/responses/render", json=body)
    assert rendered.status_code == 200, rendered.text
    assert rendered.json["sampling_params"]["max_tokens"] == 6
    first = client.simulate_post("/v1/responses", json=body)
    assert first.status_code == 200, first.text
    assert client.simulate_post(GENERATE, json=rendered.json).status_code == 200
    via_responses, via_generate = engine.added
    assert via_generate.prompt_token_ids == via_responses.prompt_token_ids
    assert via_generate.params == via_responses.params
    follow_up = {**body, "input": "Another.", "previous_response_id": first.json["id"]}
    continued = client.simulate_post("/v1/responses/render", json=follow_up)
    assert continued.status_code == 200, continued.text
    assert len(continued.json["token_ids"]) > len(rendered.json["token_ids"])
    missing = client.simulate_post(
        "/v1/responses/render", json={**body, "previous_response_id": "resp-nope"}
    )
    assert_openai_error(missing, 404, param="previous_response_id")


def test_thinking_token_budget_is_checked_as_on_completions(client, engine: FakeEngine):
    """Generate starts its runs through the completion route's own start: a thinking
    budget for a model that writes no <think> blocks is the same 400 (it was ignored)."""
    body = {"token_ids": [5, 6], "sampling_params": {"thinking_token_budget": 4}}
    result = client.simulate_post(GENERATE, json=body)
    assert_openai_error(result, 400, param="sampling_params.thinking_token_budget")
    completion = client.simulate_post(
        "/v1/completions", json={"prompt": [5, 6], "thinking_token_budget": 4}
    )
    assert_openai_error(completion, 400, param="thinking_token_budget")
    assert engine.added == []
