"""Admission control, headers and served names on a small second server; TGI's generate
API and the other /invocations bodies on the default server.

The second server runs one sequence at a time with a waiting queue of one, so three
requests are enough to fill it: the third must get a plain 503 JSON answer before any
status line of a stream, never a 200 stream that fails.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.clients import assert_openai_error, client, metric, sse_data, wait_metric
from tests.e2e.server import Server, start_server

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"
ATTRIBUTES = "trace=abc-123;variant=blue"


@pytest.fixture(scope="module")
def small_server(server_logs: Path, model_smollm2_dir: str) -> Iterator[Server]:
    """One running sequence, one waiting, request ids echoed, two served names."""
    server = start_server(
        server_logs,
        "--max-num-seqs",
        "1",
        "--max-num-queued-reqs",
        "1",
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "256MiB",
        "--enable-request-id-headers",
        "--served-model-name",
        "smollm2",
        "hearth-small",
        "--sse-keep-alive-interval",
        "1",
    )
    yield server
    server.stop()


# -- admission --------------------------------------------------------------------------------
async def _fill_queue_then_refuse(server: Server) -> dict[str, Any]:
    """A runs (long stream), B waits (stream), C..E are refused; then A is cut and B runs."""
    seen: dict[str, Any] = {"b_lines": []}
    a_started = asyncio.Event()
    release_a = asyncio.Event()
    b_pinged = asyncio.Event()

    async def run_a() -> None:
        # Minutes of CPU decoding if it ran to its end: only an abort frees the slot soon.
        body = {
            "model": "smollm2",
            "prompt": "Count from one to one thousand:",
            "max_tokens": 1000,
            "ignore_eos": True,
            "stream": True,
        }
        async with (
            httpx.AsyncClient(timeout=300) as http,
            http.stream("POST", server.v1 + "/completions", json=body) as r,
        ):
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    a_started.set()
                if release_a.is_set():
                    return  # closing the connection aborts A in the engine

    async def run_b() -> None:
        body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True}
        async with (
            httpx.AsyncClient(timeout=300) as http,
            http.stream("POST", server.v1 + "/completions", json=body) as r,
        ):
            seen["b_status"] = r.status_code
            async for line in r.aiter_lines():
                if not line.strip():
                    continue
                if line.startswith(": ping") and not any(
                    seen_line.startswith("data:") for seen_line in seen["b_lines"]
                ):
                    b_pinged.set()
                seen["b_lines"].append(line)

    task_a = asyncio.create_task(run_a())
    await asyncio.wait_for(a_started.wait(), 240)
    await asyncio.to_thread(wait_metric, server, "hearth:num_requests_running", 1)
    task_b = asyncio.create_task(run_b())
    seen["waiting"] = await asyncio.to_thread(
        wait_metric, server, "hearth:num_requests_waiting", 1, 60
    )

    async with httpx.AsyncClient(timeout=120) as http:
        seen["refused_chat_stream"] = await http.post(
            server.v1 + "/chat/completions",
            json={"messages": FRANCE, "max_tokens": 4, "stream": True},
        )
        seen["refused_completion_stream"] = await http.post(
            server.v1 + "/completions",
            json={"prompt": PROMPT, "max_tokens": 4, "stream": True, "n": 1},
        )
        seen["refused_plain"] = await http.post(
            server.v1 + "/chat/completions", json={"messages": FRANCE, "max_tokens": 4}
        )
        seen["refused_invocations"] = await http.post(
            server.url + "/invocations",
            json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}, "stream": True},
        )
    # B is still queued; the 1 s keep-alive has pinged it while it waits.
    await asyncio.wait_for(b_pinged.wait(), 60)
    release_a.set()
    await asyncio.wait_for(task_a, 240)
    # With one running slot, B leaves the queue only once A is out of the batch: closing
    # A's connection must have aborted it in the engine, long before its 1000 tokens.
    seen["waiting_after_cut"] = await asyncio.to_thread(
        wait_metric, server, "hearth:num_requests_waiting", 0, 60
    )
    await asyncio.wait_for(task_b, 240)
    return seen


def test_full_queue_refuses_a_stream_before_the_status_line(small_server: Server) -> None:
    seen = asyncio.run(_fill_queue_then_refuse(small_server))
    assert seen["waiting"] == 1
    assert seen["waiting_after_cut"] == 0, "the cut stream was not aborted in the engine"
    for name in (
        "refused_chat_stream",
        "refused_completion_stream",
        "refused_plain",
        "refused_invocations",
    ):
        response: httpx.Response = seen[name]
        error = assert_openai_error(response, 503)
        assert error["type"] == "ServiceUnavailableError", name
        assert response.headers.get("retry-after") == "1", name
        assert b"data:" not in response.content and b": ping" not in response.content, name
        assert not response.headers["content-type"].startswith("text/event-stream"), name

    # The waiting request was admitted, pinged while queued, then ran to its end.
    assert seen["b_status"] == 200
    lines = seen["b_lines"]
    assert ": ping" in lines
    events = sse_data("\n".join(lines).encode())
    assert events[-1] == "[DONE]"
    text = "".join(c["choices"][0]["text"] for c in events[:-1] if c["choices"])
    assert text and "Paris" in text

    # The queue has drained: a request succeeds and nothing is left in the engine.
    assert wait_metric(small_server, "hearth:num_requests_waiting", 0) == 0
    reply = client(small_server).chat.completions.create(
        model="smollm2", messages=FRANCE, temperature=0, max_tokens=8
    )
    assert "Paris" in reply.choices[0].message.content
    assert wait_metric(small_server, "hearth:kv_cache_used_blocks", 0) == 0
    assert metric(small_server, "hearth:num_requests_running") == 0


# -- headers, names, routes of the second server -------------------------------------------------
def test_request_id_header_is_echoed(small_server: Server) -> None:
    body = {"messages": FRANCE, "max_tokens": 2, "temperature": 0}
    r = httpx.post(
        small_server.v1 + "/chat/completions",
        json=body,
        headers={"X-Request-Id": "client-id-7"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "client-id-7"
    assert r.json()["id"] == "chatcmpl-client-id-7"

    # The header wins over the body's request_id; streams echo it too.
    stream = httpx.post(
        small_server.v1 + "/completions",
        json={"prompt": PROMPT, "max_tokens": 2, "stream": True, "request_id": "body-id"},
        headers={"X-Request-Id": "client-id-8"},
        timeout=120,
    )
    assert stream.status_code == 200
    assert stream.headers["x-request-id"] == "client-id-8"
    assert {c["id"] for c in sse_data(stream.content)[:-1]} == {"cmpl-client-id-8"}

    # Without the header a fresh id is made and sent back; errors carry it as well.
    fresh = httpx.post(small_server.v1 + "/chat/completions", json=body, timeout=120)
    assert len(fresh.headers["x-request-id"]) >= 16
    assert fresh.json()["id"] == "chatcmpl-" + fresh.headers["x-request-id"]
    bad = httpx.post(
        small_server.v1 + "/chat/completions",
        json={"messages": []},
        headers={"X-Request-Id": "client-id-9"},
        timeout=120,
    )
    assert_openai_error(bad, 400, "messages")
    assert bad.headers["x-request-id"] == "client-id-9"


def test_several_served_model_names(small_server: Server) -> None:
    api = client(small_server)
    cards = api.models.list().data
    assert [m.id for m in cards] == ["smollm2", "hearth-small"]
    assert all((m.model_extra or {}).get("max_model_len") == 1024 for m in cards)
    reply = api.chat.completions.create(
        model="hearth-small", messages=FRANCE, temperature=0, max_tokens=8
    )
    assert reply.model == "hearth-small"
    assert "Paris" in reply.choices[0].message.content
    out = api.completions.create(model="hearth-small", prompt=PROMPT, max_tokens=2)
    assert out.model == "hearth-small"
    default = httpx.post(
        small_server.v1 + "/completions", json={"prompt": PROMPT, "max_tokens": 1}, timeout=120
    )
    assert default.json()["model"] == "smollm2"
    unknown = httpx.post(
        small_server.v1 + "/completions",
        json={"model": "gpt-4o", "prompt": PROMPT, "max_tokens": 1},
        timeout=120,
    )
    assert_openai_error(unknown, 404, "model")
    # /load exists only with --enable-server-load-tracking.
    assert_openai_error(httpx.get(small_server.url + "/load", timeout=30), 404)


# -- TGI on /invocations ---------------------------------------------------------------------------
def _invoke(server: Server, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(
        server.url + "/invocations",
        json=body,
        headers={"X-Amzn-SageMaker-Custom-Attributes": ATTRIBUTES, **headers},
        timeout=300,
    )


def test_tgi_generate_non_stream(default_server: Server) -> None:
    completion = client(default_server).completions.create(
        model="smollm2", prompt=PROMPT, temperature=0, max_tokens=5
    )
    greedy = completion.choices[0].text

    r = _invoke(default_server, {"inputs": PROMPT, "parameters": {"max_new_tokens": 5}})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert r.headers["x-amzn-sagemaker-custom-attributes"] == ATTRIBUTES
    assert r.json() == [{"generated_text": greedy, "details": None}]

    r = _invoke(
        default_server,
        {"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "details": True}},
        **{"Content-Type": "text/plain"},  # SageMaker callers send any content type
    )
    assert r.status_code == 200, r.text
    [answer] = r.json()
    details = answer["details"]
    assert answer["generated_text"] == greedy
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 5
    assert details["prefill"] == []
    tokens = details["tokens"]
    assert len(tokens) == 5
    assert "".join(t["text"] for t in tokens) == greedy
    for token in tokens:
        assert set(token) == {"id", "text", "logprob", "special"}
        assert 0 <= token["id"] < 49152 and token["logprob"] <= 0 and token["special"] is False

    full = _invoke(
        default_server,
        {"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "return_full_text": True}},
    )
    assert full.json()[0]["generated_text"] == PROMPT + greedy

    stop = _invoke(
        default_server,
        {"inputs": PROMPT, "parameters": {"max_new_tokens": 8, "stop": ["Paris"], "details": True}},
    )
    [stopped] = stop.json()
    assert stopped["generated_text"].endswith("Paris")  # TGI keeps the stop sequence
    assert stopped["details"]["finish_reason"] == "stop_sequence"

    sampled = [
        _invoke(
            default_server,
            {
                "inputs": "Once upon a time",
                "parameters": {"max_new_tokens": 8, "do_sample": True, "seed": seed},
            },
        ).json()[0]["generated_text"]
        for seed in (7, 7, 8)
    ]
    assert sampled[0] == sampled[1]
    # do_sample really samples: the seeded TGI text is the seeded sample that
    # /v1/completions draws with the same parameters, and not the greedy text.
    same = client(default_server).completions.create(
        model="smollm2",
        prompt="Once upon a time",
        max_tokens=8,
        temperature=1.0,
        top_p=1.0,
        seed=7,
        extra_body={"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0},
    )
    greedy_story = client(default_server).completions.create(
        model="smollm2", prompt="Once upon a time", max_tokens=8, temperature=0
    )
    assert sampled[0] == same.choices[0].text
    assert sampled[0] != greedy_story.choices[0].text


def test_tgi_generate_stream(default_server: Server) -> None:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 5}}
    whole = _invoke(default_server, body).json()[0]["generated_text"]

    r = _invoke(default_server, {**body, "stream": True})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-amzn-sagemaker-custom-attributes"] == ATTRIBUTES
    events = sse_data(r.content)
    assert events and "[DONE]" not in events  # TGI streams end without [DONE]
    for i, event in enumerate(events):
        assert set(event) == {"index", "token", "generated_text", "details"}
        assert event["index"] == i
        assert set(event["token"]) == {"id", "text", "logprob", "special"}
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    last = events[-1]
    assert last["generated_text"] == whole
    assert last["details"] == {"finish_reason": "length", "generated_tokens": 5, "seed": None}
    assert "".join(e["token"]["text"] for e in events) == whole


def test_tgi_top_tokens_and_prefill_details(default_server: Server) -> None:
    """`top_n_tokens`: each generated position's n most likely tokens (greedy: the first
    is the token generated), streamed too; `decoder_input_details`: each prompt token's
    logprob, the ones `/v1/completions` gives as `prompt_logprobs` for the same ids."""
    parameters = {"max_new_tokens": 4, "details": True, "top_n_tokens": 3}
    [answer] = _invoke(default_server, {"inputs": PROMPT, "parameters": parameters}).json()
    details = answer["details"]
    assert len(details["top_tokens"]) == len(details["tokens"]) == 4
    for token, top in zip(details["tokens"], details["top_tokens"], strict=True):
        assert len(top) == 3 and top[0]["id"] == token["id"]
        assert top[0]["logprob"] == pytest.approx(token["logprob"], abs=1e-5)
        assert top[0]["logprob"] >= top[1]["logprob"] >= top[2]["logprob"]
    assert details["prefill"] == []  # not asked for

    with_prefill = {**parameters, "decoder_input_details": True}
    [answer] = _invoke(default_server, {"inputs": PROMPT, "parameters": with_prefill}).json()
    prefill = answer["details"]["prefill"]
    completion = httpx.post(
        f"{default_server.v1}/completions",
        json={"model": "smollm2", "prompt": [t["id"] for t in prefill], "max_tokens": 1,
              "prompt_logprobs": 0},
        timeout=120,
    ).json()  # fmt: skip
    want = completion["choices"][0]["prompt_logprobs"]
    assert prefill[0]["logprob"] is None and want[0] is None
    for token, entry in zip(prefill[1:], want[1:], strict=True):
        assert token["logprob"] == pytest.approx(entry[str(token["id"])]["logprob"], abs=1e-4)

    stream = _invoke(
        default_server,
        {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 4, "top_n_tokens": 2}},
    )
    events = sse_data(stream.content)
    assert all(len(e["top_tokens"]) == 2 for e in events)
    assert [e["top_tokens"][0]["id"] for e in events] == [e["token"]["id"] for e in events]


def test_invocations_completion_and_streaming_chat_bodies(default_server: Server) -> None:
    api = client(default_server)
    completion = api.completions.create(model="smollm2", prompt=PROMPT, temperature=0, max_tokens=5)
    r = _invoke(default_server, {"prompt": PROMPT, "temperature": 0, "max_tokens": 5})
    assert r.status_code == 200, r.text
    assert r.headers["x-amzn-sagemaker-custom-attributes"] == ATTRIBUTES
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == completion.choices[0].text

    chat = api.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0)
    r = _invoke(default_server, {"messages": FRANCE, "temperature": 0, "stream": True})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-amzn-sagemaker-custom-attributes"] == ATTRIBUTES
    events = sse_data(r.content)
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text == chat.choices[0].message.content

    garbage = _invoke(default_server, {"hello": "world"})
    error = assert_openai_error(garbage, 400, None)
    for kind in ("messages", "prompt", "inputs"):
        assert kind in error["message"]


def test_tool_call_history_renders(default_server: Server) -> None:
    """An assistant turn that only called a tool (`content: null`, as the SDK sends it)
    followed by the tool's answer renders with the model's template."""
    messages = [
        {"role": "user", "content": "What is 6 times 7?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "multiply", "arguments": '{"a": 6, "b": 7}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    reply = client(default_server).chat.completions.create(
        model="smollm2", messages=messages, temperature=0, max_tokens=4
    )
    assert reply.choices[0].message.content
    # The whole history reached the model: the prompt is the template's rendering of all
    # three turns, the tool's answer included.
    rendered = httpx.post(
        default_server.url + "/tokenize", json={"messages": messages}, timeout=120
    ).json()
    assert reply.usage.prompt_tokens == rendered["count"]
    text = httpx.post(
        default_server.url + "/detokenize", json={"tokens": rendered["tokens"]}, timeout=120
    ).json()["prompt"]
    assert "What is 6 times 7?" in text
    assert "42" in text.split("What is 6 times 7?", 1)[1]


def test_tiny_sampling_values_stay_numerically_sane(default_server: Server) -> None:
    """Values inside the documented ranges but below float32's reach (1e-320 is 0 there)
    must not turn the logits into inf/NaN: they behave like their limit (greedy)."""
    api = client(default_server)
    greedy = api.completions.create(model="smollm2", prompt=PROMPT, temperature=0, max_tokens=4)
    want = greedy.choices[0].text
    for kwargs in (
        {"temperature": 1e-320, "seed": 1},
        {"temperature": 1e-40, "seed": 1},
        {"temperature": 1.0, "top_p": 1e-320, "seed": 1},
    ):
        out = api.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4, **kwargs)
        assert out.choices[0].text == want, kwargs
    tiny_penalty = api.completions.create(
        model="smollm2",
        prompt=PROMPT,
        temperature=0,
        max_tokens=4,
        logprobs=1,
        extra_body={"repetition_penalty": 1e-320},
    )
    logprobs = tiny_penalty.choices[0].logprobs
    assert "<|endoftext|>" not in logprobs.tokens, logprobs.tokens
    assert all(lp > -9999.0 for lp in logprobs.token_logprobs), logprobs.token_logprobs
    tgi = _invoke(
        default_server,
        {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "temperature": 1e-320, "seed": 1}},
    )
    assert tgi.json()[0]["generated_text"] == want
