"""vLLM's token-in-token-out route through a real `hearth serve` (the default model, in the
mode whose outputs never depend on load): the tokens `/inference/v1/generate` returns for
a token prompt are the ones `/v1/completions` returns for the same ids, streamed or not,
and text mode's text is those tokens decoded; render → generate → derender answers as the chat
route does."""

from __future__ import annotations

import json

import httpx
import pytest

from engine.tokenizer import Tokenizer
from tests.e2e.server import Server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = "The three primary colors are"


def generate(server: Server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=120)


def test_generate_gives_the_completion_routes_tokens(
    invariant_server: Server, model_smollm2_dir: str
) -> None:
    ids = Tokenizer(model_smollm2_dir).encode(PROMPT, add_special_tokens=False)
    sampling = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    completion = httpx.post(
        f"{invariant_server.v1}/completions",
        json={"prompt": ids, "return_token_ids": True, **sampling},
        timeout=120,
    )
    assert completion.status_code == 200, completion.text
    want = completion.json()["choices"][0]["token_ids"]
    assert len(want) == 12

    tokens = generate(invariant_server, {"token_ids": ids, "sampling_params": sampling})
    assert tokens.status_code == 200, tokens.text
    body = tokens.json()
    assert (
        body["choices"][0]["token_ids"] == want and body["choices"][0]["finish_reason"] == "length"
    )
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(ids), 12)

    text = generate(
        invariant_server, {"token_ids": ids, "sampling_params": sampling, "output_mode": "text"}
    ).json()["choices"][0]
    assert text["token_ids"] == want
    assert text["text"] == completion.json()["choices"][0]["text"]

    streamed: list[int] = []
    with httpx.stream(
        "POST",
        f"{invariant_server.url}/inference/v1/generate",
        json={"token_ids": ids, "sampling_params": sampling, "stream": True},
        timeout=120,
    ) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for line in lines[:-1]:
        for choice in json.loads(line)["choices"]:
            streamed += choice["token_ids"]
    assert streamed == want


def test_a_bad_sampling_field_is_a_400_naming_it(invariant_server: Server) -> None:
    result = generate(invariant_server, {"token_ids": [1, 2], "sampling_params": {"top_k": -5}})
    assert result.status_code == 400
    assert result.json()["error"]["param"] == "sampling_params.top_k"


def test_render_generate_derender_answers_as_the_chat_route(invariant_server: Server) -> None:
    """The token-in-token-out split end to end: a chat rendered, its tokens generated and
    derendered is the chat route's answer (greedy, in the load-invariant mode)."""
    chat = {
        "messages": [{"role": "user", "content": "Name three primary colors."}],
        "temperature": 0,
        "max_tokens": 16,
        "logprobs": True,
        "top_logprobs": 2,
    }
    direct = httpx.post(f"{invariant_server.v1}/chat/completions", json=chat, timeout=120)
    assert direct.status_code == 200, direct.text
    rendered = httpx.post(f"{invariant_server.v1}/chat/completions/render", json=chat, timeout=60)
    assert rendered.status_code == 200, rendered.text
    generated = generate(invariant_server, rendered.json())
    assert generated.status_code == 200, generated.text
    derendered = httpx.post(
        f"{invariant_server.v1}/chat/completions/derender",
        json={
            "generate_response": generated.json(),
            "prompt_tokens": len(rendered.json()["token_ids"]),
            "chat_request": chat,
        },
        timeout=60,
    )
    assert derendered.status_code == 200, derendered.text
    want, got = direct.json()["choices"][0], derendered.json()["choices"][0]
    assert got["message"]["content"] == want["message"]["content"] != ""
    assert got["finish_reason"] == want["finish_reason"]
    assert got["logprobs"] == want["logprobs"]
    assert derendered.json()["usage"] == direct.json()["usage"]
    outside = 10**7  # past any vocabulary
    bad = {
        "generate_response": {"request_id": "x", "choices": [{"index": 0, "token_ids": [outside]}]}
    }
    refused = httpx.post(f"{invariant_server.v1}/chat/completions/derender", json=bad, timeout=60)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "generate_response.choices[0].token_ids[0]"
