"""Random mixes of request parameters, eight requests at a time, against the real default
server: the engine batches what each test of `test_openai_params.py` sends alone (seeds
beside penalties, grammars beside logprobs, beam search beside streams, a tool call beside
a prompt of token ids), so its batched paths (the sampler's per-row work, grammar masks,
prompt logprobs, stop strings) meet each other under load.

Each body is drawn from a fixed seed, so a failure names a body that reproduces. Whatever
the mix, a request is answered 200 or a 400 naming its field (some draws are invalid on
purpose: `min_tokens` past `max_tokens`, a logit bias under beam search), never a 5xx, a
`finish_reason` of `error`, or a stream that does not end with `[DONE]`; afterwards
nothing runs and no KV block is held.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.e2e.clients import TIMEOUT, wait_metric
from tests.e2e.server import Server

pytestmark = pytest.mark.slow

REQUESTS = 120
"""About 12 s on two cores (max_tokens <= 16)."""
VOCAB = 49152
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "string", "maxLength": 5},
    {"enum": ["x", "y"]},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def _sampling(rng: random.Random) -> dict[str, Any]:
    """Each parameter present with its own chance, at values from its edges and middle."""

    def maybe(chance: float, value: Any) -> Any:
        return value if rng.random() < chance else None

    params = {
        "max_tokens": rng.choice([1, 2, 3, 5, 8, 16]),
        "temperature": maybe(0.7, rng.choice([0, 0.0001, 0.5, 1.0, 1.7, 2.0])),
        "top_p": maybe(0.4, rng.choice([0.01, 0.5, 0.9, 0.999, 1.0])),
        "top_k": maybe(0.3, rng.choice([-1, 0, 1, 5, 50, 1000, VOCAB, 100_000])),
        "min_p": maybe(0.2, rng.choice([0.0, 0.05, 0.5, 1.0])),
        "presence_penalty": maybe(0.2, rng.choice([-2, 0.5, 2])),
        "frequency_penalty": maybe(0.2, rng.choice([-2, 0.5, 2])),
        "repetition_penalty": maybe(0.2, rng.choice([0.5, 1.0, 1.3, 2.0])),
        "seed": maybe(0.3, rng.choice([0, 1, 42, 2**63 - 1])),
        "n": maybe(0.2, rng.choice([1, 2, 4])),
        "logprobs": maybe(0.2, True),
        "stop": maybe(0.2, rng.choice([["."], [" "], ["a", "e", "i"], "\n"])),
        "min_tokens": maybe(0.2, rng.choice([0, 1, 4, 20])),
        "ignore_eos": maybe(0.2, rng.choice([True, False])),
        "logit_bias": maybe(
            0.15,
            {
                str(rng.randrange(VOCAB)): rng.choice([-100, 100, 5])
                for _ in range(rng.randint(1, 4))
            },
        ),
        "allowed_token_ids": maybe(0.1, [rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))]),
        "bad_words": maybe(0.1, [rng.choice(["the", "Paris", " a", "hello world"])]),
        "prompt_logprobs": maybe(0.1, rng.choice([0, 1, 5])),
        "stream": maybe(0.4, True),
        "response_format": maybe(
            0.15,
            rng.choice(
                [
                    {"type": "json_object"},
                    {
                        "type": "json_schema",
                        "json_schema": {"name": "s", "schema": rng.choice(SCHEMAS)},
                    },
                ]
            ),
        ),
        "structured_outputs": maybe(
            0.08,
            rng.choice(
                [
                    {"choice": ["yes", "no"]},
                    {"regex": "[0-9]{2}"},
                    {"grammar": 'root ::= "a" | "b"'},
                ]
            ),
        ),
        "use_beam_search": maybe(0.05, True),
        "skip_special_tokens": maybe(0.1, False),
        "include_stop_str_in_output": maybe(0.1, True),
    }
    if params["logprobs"]:
        params["top_logprobs"] = rng.choice([0, 1, 5, 20])
    if params["response_format"] and params["structured_outputs"]:
        params["structured_outputs"] = None
    if params["use_beam_search"]:
        params.update(n=2, temperature=0, stream=None)
    return {k: v for k, v in params.items() if v is not None}


def draw(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """One request: a chat, a chat with a tool, or a completion (text or token ids)."""
    kind = rng.choice(["chat", "chat", "completion", "chat-tools"])
    params = _sampling(rng)
    if kind == "completion":
        params.pop("response_format", None)
        top = params.pop("top_logprobs", 1)
        if params.pop("logprobs", None):
            params["logprobs"] = top
        if rng.random() < 0.2:
            params["echo"] = True
        prompt = rng.choice(["Hello", "The capital of France is", [1, 2, 3], "x" * 50])
        return "/v1/completions", {"model": "smollm2", "prompt": prompt, **params}
    question = rng.choice(["Hi", "What's the weather in Paris?", "Count to 5", "Write JSON"])
    body = {"model": "smollm2", "messages": [{"role": "user", "content": question}], **params}
    if kind == "chat-tools":
        for key in ("response_format", "structured_outputs", "use_beam_search"):
            body.pop(key, None)
        body["tools"] = TOOLS
        body["tool_choice"] = rng.choice(
            ["auto", "none", "required", {"type": "function", "function": {"name": "get_weather"}}]
        )
    return "/v1/chat/completions", body


def send(server: Server, path: str, body: dict[str, Any]) -> tuple[int, str | None]:
    """The status of the answer to `body`, and what is wrong with it (or None)."""
    if body.get("stream"):
        with httpx.stream("POST", server.url + path, json=body, timeout=TIMEOUT) as response:
            status, text = response.status_code, response.read().decode()
    else:
        response = httpx.post(server.url + path, json=body, timeout=TIMEOUT)
        status, text = response.status_code, response.text
    if status == 400:
        error = json.loads(text)["error"]
        return status, None if error["param"] else f"400 without a param: {error}"
    if status != 200:
        return status, text[:300]
    if '"finish_reason":"error"' in text.replace(" ", ""):
        return status, f"finish_reason error: {text[-300:]}"
    if body.get("stream") and not text.rstrip().endswith("data: [DONE]"):
        return status, f"stream did not end: {text[-300:]}"
    return status, None


def test_random_parameter_mixes_are_answered_and_leave_nothing(default_server: Server) -> None:
    rng = random.Random(20261207)
    requests = [draw(rng) for _ in range(REQUESTS)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda r: send(default_server, *r), requests))
    found = [(body, why) for (_, body), (_, why) in zip(requests, answers, strict=True) if why]
    assert not found, found[:3]
    # most draws are valid: the mixes reach the engine, not only the validators
    assert sum(status == 200 for status, _ in answers) >= 0.7 * REQUESTS
    assert wait_metric(default_server, "hearth:num_requests_running", 0) == 0
    assert wait_metric(default_server, "hearth:kv_cache_usage_perc", 0) == 0
