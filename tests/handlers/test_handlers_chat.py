"""/v1/chat/completions end to end through the Falcon app, with a scripted engine."""

from __future__ import annotations

import asyncio

import pytest
from fake_engine import AddedRequest, FakeEngine, Script
from handlers_testing import EOS_ID, call_asgi, encode

from engine.tokenizer import Tokenizer

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hello"}]

pytestmark = pytest.mark.anyio


def contents(events: list, index: int = 0) -> list[str]:
    """The content deltas of one choice, in order."""
    out = []
    for event in events:
        if event == "[DONE]" or "choices" not in event:
            continue
        for choice in event["choices"]:
            if choice["index"] == index and "content" in choice["delta"]:
                out.append(choice["delta"]["content"])
    return out


def finish_of(events: list, index: int = 0) -> dict:
    for event in events:
        if event != "[DONE]" and "choices" in event:
            for choice in event["choices"]:
                if choice["index"] == index and choice.get("finish_reason"):
                    return choice
    raise AssertionError("no finish chunk")


async def test_non_stream_answer_and_usage(client, engine: FakeEngine, tokenizer: Tokenizer):
    answer = encode(tokenizer, "The capital of France is Paris.")
    engine.script = Script(token_ids=[*answer, EOS_ID, 9, 9])
    result = await call_asgi(client.app, CHAT, {"messages": MESSAGES, "model": "tiny-alias"})
    assert result.status == 200
    body = result.json
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == "tiny-alias"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "The capital of France is Paris."}
    assert choice["finish_reason"] == "stop"
    prompt_len = len(engine.added[0].prompt_token_ids)
    assert body["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": len(answer) + 1,
        "total_tokens": prompt_len + len(answer) + 1,
        "prompt_tokens_details": None,
    }
    # The chat template was applied and encoded without adding special tokens twice.
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert engine.added[0].prompt_token_ids == encode(tokenizer, rendered)
    assert engine.added[0].params.max_tokens == 256 - prompt_len
    assert engine.live == set()


async def test_stop_string_across_tokens_never_leaks_and_aborts(
    client, engine: FakeEngine, tokenizer: Tokenizer
):
    text = "Hello world! STOP now and then some more words"
    tokens = encode(tokenizer, text)
    assert len(tokens) > 8
    # Slow steps: each token is its own output, so the hold-back is really exercised.
    engine.script = Script(token_ids=tokens, step_delay=0.002)
    result = await call_asgi(
        client.app, CHAT, {"messages": MESSAGES, "stream": True, "stop": ["STOP"]}
    )
    pieces = contents(result.events)
    assert len(pieces) >= 4  # about one chunk per token
    # " ST" is one token: its space went out, "ST" was held back until "OP" completed it.
    assert tokenizer.convert_ids_to_tokens(tokens).count("ĠST") == 1
    assert pieces[-1] == " "
    so_far = ""
    for piece in pieces:
        so_far += piece
        assert "Hello world! ".startswith(so_far), f"leaked {so_far!r}"
    assert so_far == "Hello world! "
    final = finish_of(result.events)
    assert (final["finish_reason"], final["stop_reason"]) == ("stop", "STOP")
    assert result.events[-1] == "[DONE]"
    request_id = engine.added[0].request_id
    assert request_id in engine.aborted
    await engine.settle()
    assert engine.live == set()

    # The same request without streaming gives the same text.
    result = await call_asgi(client.app, CHAT, {"messages": MESSAGES, "stop": "STOP"})
    assert result.json["choices"][0]["message"]["content"] == "Hello world! "
    assert result.json["choices"][0]["stop_reason"] == "STOP"
    assert result.json["usage"]["completion_tokens"] < len(tokens)


async def test_include_stop_str_in_output(client, engine: FakeEngine, tokenizer: Tokenizer):
    engine.script = Script(token_ids=encode(tokenizer, "Hello world! STOP now"))
    body = {"messages": MESSAGES, "stop": ["STOP"], "include_stop_str_in_output": True}
    result = await call_asgi(client.app, CHAT, body)
    assert result.json["choices"][0]["message"]["content"] == "Hello world! STOP"
    result = await call_asgi(client.app, CHAT, {**body, "stream": True})
    assert "".join(contents(result.events)) == "Hello world! STOP"


@pytest.mark.parametrize("tokens_per_step", [1, 3])
async def test_stream_equals_non_stream_with_multibyte(
    client, engine: FakeEngine, tokenizer: Tokenizer, tokens_per_step: int
):
    text = "Emoji are fun 😀🎉 and so is 你好世界 in Chinese."
    tokens = encode(tokenizer, text)
    pieces = [tokenizer.decode([t]) for t in tokens]
    assert any("\ufffd" in p for p in pieces), "the emoji must be split across tokens"
    engine.script = Script(token_ids=[*tokens, EOS_ID], tokens_per_step=tokens_per_step)
    plain = await call_asgi(client.app, CHAT, {"messages": MESSAGES})
    streamed = await call_asgi(client.app, CHAT, {"messages": MESSAGES, "stream": True})
    deltas = contents(streamed.events)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == plain.json["choices"][0]["message"]["content"] == text


async def test_n3_streams_interleave_with_indices(client, engine: FakeEngine, tokenizer: Tokenizer):
    words = {0: "apple banana", 1: "cherry apple", 2: "banana cherry"}

    def script(request: AddedRequest) -> Script:
        index = int(request.request_id.rsplit("-", 1)[1])
        return Script(token_ids=[*encode(tokenizer, words[index]), EOS_ID], step_delay=0.003)

    engine.script = script
    body = {"messages": MESSAGES, "stream": True, "n": 3, "stream_options": {"include_usage": True}}
    result = await call_asgi(client.app, CHAT, body)
    events = result.events
    assert events[-1] == "[DONE]"
    assert events.count("[DONE]") == 1
    roles = [e["choices"][0]["index"] for e in events[:3]]
    assert roles == [0, 1, 2] and all(
        e["choices"][0]["delta"]["role"] == "assistant" for e in events[:3]
    )
    for index, text in words.items():
        assert "".join(contents(events, index)) == text
        assert finish_of(events, index)["finish_reason"] == "stop"
    order = [e["choices"][0]["index"] for e in events[3:-2]]
    assert order != sorted(order), "choices should interleave, not run one after another"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == sum(
        len(encode(tokenizer, w)) + 1 for w in words.values()
    )
    ids = sorted(r.request_id for r in engine.added)
    assert len(set(ids)) == 3 and [i.rsplit("-", 1)[1] for i in ids] == ["0", "1", "2"]


async def test_seeded_choices_get_distinct_seeds(client, engine: FakeEngine):
    result = await call_asgi(client.app, CHAT, {"messages": MESSAGES, "n": 3, "seed": 7})
    assert result.status == 200
    assert sorted(r.params.seed for r in engine.added) == [7, 8, 9]


async def test_admission_refused_is_a_clean_503(client, engine: FakeEngine):
    engine.refuse_after = 0
    result = await call_asgi(client.app, CHAT, {"messages": MESSAGES, "stream": True})
    assert result.status == 503
    assert result.headers["content-type"].startswith("application/json")
    assert b"data:" not in result.body
    error = result.json["error"]
    assert (error["code"], error["type"]) == (503, "ServiceUnavailableError")
    assert result.headers.get("retry-after") == "1"


async def test_partial_admission_of_n_aborts_the_admitted(client, engine: FakeEngine):
    engine.refuse_after = 2
    engine.script = Script(token_ids=[5] * 50, hold=asyncio.Event())
    result = await call_asgi(client.app, CHAT, {"messages": MESSAGES, "n": 3, "stream": True})
    assert result.status == 503 and b"data:" not in result.body
    assert sorted(engine.aborted) == sorted(r.request_id for r in engine.added)
    await engine.settle()
    assert engine.live == set()


async def test_engine_failure_mid_stream_is_an_error_chunk_then_done(client, engine: FakeEngine):
    engine.script = Script(token_ids=[5, 6, 7, 8], fail_at_step=2, step_delay=0.002)
    result = await call_asgi(client.app, CHAT, {"messages": MESSAGES, "stream": True})
    assert result.status == 200
    events = result.events
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == 500
    assert events[-2]["error"]["type"] == "InternalServerError"
    assert "scripted" not in events[-2]["error"]["message"]  # no internals
    assert contents(events)  # text before the failure was sent


async def test_engine_death_mid_stream_is_a_503_chunk(client, engine: FakeEngine):
    engine.script = Script(token_ids=[5, 6, 7, 8], raise_at_step=2, step_delay=0.002)
    result = await call_asgi(client.app, CHAT, {"messages": MESSAGES, "stream": True, "n": 2})
    events = result.events
    assert events[-2]["error"]["code"] == 503 and events[-1] == "[DONE]"
    await engine.settle()
    assert engine.live == set()


async def test_engine_failure_without_stream_is_500(client, engine: FakeEngine):
    engine.script = Script(token_ids=[5, 6, 7], fail_at_step=1)
    result = await call_asgi(client.app, CHAT, {"messages": MESSAGES})
    assert result.status == 500
    assert result.json["error"]["type"] == "InternalServerError"


def comment_lines(body: bytes) -> list[bytes]:
    """SSE comment lines (`: ...`), which some clients (vllm bench serve) mis-parse."""
    return [line for line in body.split(b"\n") if line.startswith(b":")]


async def test_disconnect_during_prefill_aborts_without_comments(client, engine: FakeEngine):
    hold = asyncio.Event()  # a prefill that never ends: only the disconnect can end it
    engine.script = Script(token_ids=[5, 6, 7, EOS_ID], hold=hold)
    result = await call_asgi(
        client.app,
        CHAT,
        {"messages": MESSAGES, "stream": True},
        disconnect_when=lambda body: b'"role"' in body,
    )
    assert comment_lines(result.body) == []  # no keep-alive comments by default
    request_id = engine.added[0].request_id
    assert engine.aborted == [request_id]
    assert request_id not in engine.live


async def test_non_stream_disconnect_aborts_the_request(make_client, engine: FakeEngine):
    sink = RecordingSink()
    client = make_client(stats=sink)
    # Far more tokens than the test waits for: the request cannot end by itself here.
    engine.script = Script(token_ids=[5] * 200, step_delay=0.01)
    disconnect = asyncio.Event()

    def when(body: bytes) -> bool:
        return disconnect.is_set()

    asyncio.get_running_loop().call_later(0.05, disconnect.set)
    result = await call_asgi(client.app, CHAT, {"messages": MESSAGES}, disconnect_when=when)
    assert result.status is None and result.body == b""  # nothing was sent
    request_id = engine.added[0].request_id
    assert engine.aborted == [request_id]
    assert engine.live == set() and engine.num_in_flight == 0
    assert [r.status for r in sink.records] == ["aborted"]


async def test_keep_alive_comments_only_when_configured(make_client, engine: FakeEngine):
    client = make_client(sse_keep_alive_interval=0.02)
    hold = asyncio.Event()
    engine.script = Script(token_ids=[5, EOS_ID], hold=hold)

    def release_after_pings(body: bytes) -> bool:
        if body.count(b": ping") >= 2:
            hold.set()
        return False

    result = await call_asgi(
        client.app,
        CHAT,
        {"messages": MESSAGES, "stream": True},
        disconnect_when=release_after_pings,
    )
    assert comment_lines(result.body)[:2] == [b": ping", b": ping"]
    assert result.events[-1] == "[DONE]"


@pytest.mark.parametrize("stream", [False, True])
async def test_request_timeout_ends_and_aborts(make_client, engine: FakeEngine, stream: bool):
    client = make_client(request_timeout=0.05)
    engine.script = Script(token_ids=[5] * 200, step_delay=0.01)
    result = await call_asgi(client.app, CHAT, {"messages": MESSAGES, "stream": stream})
    request_id = engine.added[0].request_id
    assert engine.aborted == [request_id]
    assert engine.live == set()
    if stream:
        assert result.status == 200
        assert result.events[-1] == "[DONE]"
        error = result.events[-2]["error"]
    else:
        assert result.status == 504
        error = result.json["error"]
    assert (error["code"], error["type"]) == (504, "RequestTimeoutError")
    assert "--request-timeout" in error["message"]


async def test_logprobs_in_chat_format(client, engine: FakeEngine, tokenizer: Tokenizer):
    tokens = encode(tokenizer, "Hi 😀")
    engine.script = Script(token_ids=[*tokens, EOS_ID])
    body = {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2}
    result = await call_asgi(client.app, CHAT, body)
    content = result.json["choices"][0]["logprobs"]["content"]
    assert len(content) == len(tokens) + 1
    assert engine.added[0].params.logprobs == 2
    raw = b"".join(bytes(entry["bytes"]) for entry in content[: len(tokens)])
    assert raw.decode() == "Hi 😀"  # bytes reassemble the split emoji
    assert all(len(entry["top_logprobs"]) == 2 for entry in content)
    streamed = await call_asgi(client.app, CHAT, {**body, "stream": True})
    entries = [
        item
        for event in streamed.events[:-1]
        for choice in event["choices"]
        if choice.get("logprobs")
        for item in choice["logprobs"]["content"]
    ]
    assert [e["token"] for e in entries] == [e["token"] for e in content]


async def test_stream_usage_options(client, engine: FakeEngine):
    engine.script = Script(token_ids=[5, 6, EOS_ID], step_delay=0.001)
    body = {
        "messages": MESSAGES,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    events = (await call_asgi(client.app, CHAT, body)).events
    assert all("usage" in e for e in events[:-1])
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 3
    plain = (await call_asgi(client.app, CHAT, {"messages": MESSAGES, "stream": True})).events
    assert all("usage" not in e for e in plain[:-1])


async def test_echo_prepends_the_last_assistant_message(client, engine: FakeEngine, tokenizer):
    engine.script = Script(token_ids=[*encode(tokenizer, " Paris."), EOS_ID])
    messages = [*MESSAGES, {"role": "assistant", "content": "The capital is"}]
    body = {
        "messages": messages,
        "echo": True,
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    result = await call_asgi(client.app, CHAT, body)
    assert result.json["choices"][0]["message"]["content"] == "The capital is Paris."
    streamed = await call_asgi(client.app, CHAT, {**body, "stream": True})
    assert "".join(contents(streamed.events)) == "The capital is Paris."


async def test_stop_token_ids_and_min_tokens(client, engine: FakeEngine, tokenizer: Tokenizer):
    tokens = encode(tokenizer, "apple banana cherry")
    engine.script = Script(token_ids=[EOS_ID, *tokens, EOS_ID])
    result = await call_asgi(client.app, CHAT, {"messages": MESSAGES, "min_tokens": 2})
    # EOS before min_tokens does not stop (the engine masks it); it is not shown either.
    assert result.json["choices"][0]["message"]["content"] == "apple banana cherry"
    engine.script = Script(token_ids=[*tokens, EOS_ID])
    body = {"messages": MESSAGES, "stop_token_ids": [tokens[1]]}
    result = await call_asgi(client.app, CHAT, body)
    choice = result.json["choices"][0]
    assert choice["stop_reason"] == tokens[1] and choice["finish_reason"] == "stop"
    assert engine.added[-1].params.stop_token_ids == [tokens[1]]


async def test_length_finish_and_sampling_params(client, engine: FakeEngine):
    engine.script = Script(token_ids=[5] * 40)
    body = {
        "messages": MESSAGES,
        "max_completion_tokens": 4,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 0,
        "min_p": 0.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "logit_bias": {"5": -100},
        "ignore_eos": True,
        "priority": 3,
        "user": "someone",
    }
    result = await call_asgi(client.app, CHAT, body)
    assert result.json["choices"][0]["finish_reason"] == "length"
    added = engine.added[0]
    params = added.params
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (4, 0.5, 0.9, -1)
    assert (params.min_p, params.presence_penalty, params.frequency_penalty) == (0.1, 0.5, -0.5)
    assert (params.repetition_penalty, params.logit_bias, params.ignore_eos) == (
        1.1,
        {5: -100.0},
        True,
    )
    assert added.priority == 3


async def test_request_id_names_response_and_engine_ids_stay_unique(client, engine: FakeEngine):
    headers = {"X-Request-Id": "abc-123"}
    first = await call_asgi(client.app, CHAT, {"messages": MESSAGES}, headers=headers)
    second = await call_asgi(client.app, CHAT, {"messages": MESSAGES}, headers=headers)
    assert first.json["id"] == second.json["id"] == "chatcmpl-abc-123"
    assert engine.added[0].request_id != engine.added[1].request_id
    body_id = await call_asgi(client.app, CHAT, {"messages": MESSAGES, "request_id": "mine"})
    assert body_id.json["id"] == "chatcmpl-mine"


async def test_skip_special_tokens_false_shows_them(client, engine: FakeEngine, tokenizer):
    tokens = encode(tokenizer, "Hello")
    engine.script = Script(token_ids=[1, *tokens, EOS_ID])
    result = await call_asgi(client.app, CHAT, {"messages": MESSAGES, "skip_special_tokens": False})
    # <|im_start|> is shown; the EOS that stopped the request is not (vLLM's rule).
    assert result.json["choices"][0]["message"]["content"] == "<|im_start|>Hello"


async def test_content_parts_and_developer_role_render(client, engine: FakeEngine, tokenizer):
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]
    result = await call_asgi(client.app, CHAT, {"messages": messages})
    assert result.status == 200
    rendered = tokenizer.decode(engine.added[0].prompt_token_ids, skip_special_tokens=False)
    assert "<|im_start|>developer\nBe brief.<|im_end|>" in rendered
    assert "<|im_start|>user\na\nb<|im_end|>" in rendered
    assert "<|im_start|>tool\n42<|im_end|>" in rendered


async def test_generation_config_defaults_apply(make_client, engine: FakeEngine, model_dir):
    (model_dir / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.95}')
    try:
        client = make_client()
        await call_asgi(client.app, CHAT, {"messages": MESSAGES})
        await call_asgi(client.app, CHAT, {"messages": MESSAGES, "temperature": 0.1})
        vllm_client = make_client(generation_config="vllm")
        await call_asgi(vllm_client.app, CHAT, {"messages": MESSAGES})
    finally:
        (model_dir / "generation_config.json").unlink()
    temps = [(r.params.temperature, r.params.top_p) for r in engine.added]
    assert temps == [(0.6, 0.95), (0.1, 0.95), (1.0, 1.0)]


async def test_trusted_request_chat_template(make_client, engine: FakeEngine, tokenizer):
    client = make_client(trust_request_chat_template=True)
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    result = await call_asgi(client.app, CHAT, {"messages": MESSAGES, "chat_template": template})
    assert result.status == 200
    assert tokenizer.decode(engine.added[0].prompt_token_ids) == "[Hello]"


class RecordingSink:
    def __init__(self) -> None:
        self.first: list[float] = []
        self.inter: list[float] = []
        self.records: list = []

    def observe_first_token(self, seconds: float) -> None:
        self.first.append(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.inter.append(seconds)

    def observe_finished(self, record) -> None:
        self.records.append(record)


async def test_stats_and_cached_tokens(make_client, engine: FakeEngine):
    sink = RecordingSink()
    client = make_client(stats=sink, enable_prompt_tokens_details=True)
    engine.script = Script(token_ids=[5, 6, 7, EOS_ID], step_delay=0.002, num_cached_tokens=8)
    result = await call_asgi(client.app, CHAT, {"messages": MESSAGES})
    assert result.json["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
    events = (
        await call_asgi(
            client.app,
            CHAT,
            {"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}},
        )
    ).events
    assert events[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
    assert len(sink.first) == 2 and len(sink.inter) >= 4
    ok = sink.records[0]
    assert (ok.status, ok.kind, ok.num_output_tokens, ok.finish_reasons) == (
        "ok",
        "chat",
        4,
        ["stop"],
    )
    assert ok.ttft is not None and ok.e2e >= ok.ttft
    assert ok.num_cached_tokens == 8

    engine.script = Script(token_ids=[5] * 100, step_delay=0.002)
    await call_asgi(
        client.app,
        CHAT,
        {"messages": MESSAGES, "stream": True},
        disconnect_when=lambda body: body.count(b"data:") >= 3,
    )
    await engine.settle()
    assert sink.records[-1].status == "aborted"
    assert sink.records[-1].finish_reasons == ["abort"]


async def test_tools_reach_the_template(make_client, engine: FakeEngine, tokenizer):
    client = make_client(trust_request_chat_template=True)
    template = "{% for t in tools %}<{{ t.function.name }}>{% endfor %}{{ messages[0].content }}"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    body = {"messages": MESSAGES, "chat_template": template, "tools": tools, "tool_choice": "none"}
    result = await call_asgi(client.app, CHAT, body)
    assert result.status == 200
    assert tokenizer.decode(engine.added[0].prompt_token_ids) == "<get_weather>Hello"


async def test_template_failure_is_a_400(make_client, engine: FakeEngine):
    client = make_client(trust_request_chat_template=True)
    body = {"messages": MESSAGES, "chat_template": "{{ raise_exception('no system') }}"}
    result = await call_asgi(client.app, CHAT, body)
    assert result.status == 400 and result.json["error"]["param"] == "messages"
    body = {"messages": MESSAGES, "chat_template": "{{ messages[0].content + 5 }}"}
    result = await call_asgi(client.app, CHAT, body)
    assert result.status == 400 and result.json["error"]["param"] == "messages"
    assert engine.added == []
