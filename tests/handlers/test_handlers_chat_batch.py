"""vLLM's `/v1/chat/completions/batch` over the scripted engine: each conversation is
rendered as /v1/chat/completions renders it and answered as its own choice, in order,
all admitted together; the shared fields apply to each; an error inside a conversation
names it (`messages[i]...`), and what the endpoint does not do is a 400."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine, Script
from handlers_testing import EOS_ID, assert_openai_error, encode

from engine.tokenizer import Tokenizer

BATCH = "/v1/chat/completions/batch"
CONVERSATIONS = [
    [{"role": "user", "content": "Say hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit"}],
    [{"role": "user", "content": "Count to three"}],
]


def test_one_choice_per_conversation(client, engine: FakeEngine, tokenizer: Tokenizer) -> None:
    engine.script = Script(token_ids=[*encode(tokenizer, "Hello there"), EOS_ID])
    body = {"model": "tiny", "messages": CONVERSATIONS, "max_tokens": 8, "temperature": 0}
    result = client.simulate_post(BATCH, json=body)
    assert result.status_code == 200, result.text
    out = result.json
    assert out["object"] == "chat.completion" and out["model"] == "tiny"
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "Hello there" for c in out["choices"])
    rendered = [
        client.simulate_post("/tokenize", json={"messages": conv}).json["tokens"]
        for conv in CONVERSATIONS
    ]
    assert [a.prompt_token_ids for a in engine.added] == rendered
    assert {a.params.max_tokens for a in engine.added} == {8}
    assert out["usage"]["prompt_tokens"] == sum(map(len, rendered))
    assert engine.live == set()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [CONVERSATIONS[0], "hi"]}, "messages[1]"),
        (
            {"messages": [CONVERSATIONS[0], [{"role": "robot", "content": "x"}]]},
            "messages[1][0].role",
        ),
        ({"messages": [CONVERSATIONS[0], []]}, "messages[1]"),
        ({"messages": CONVERSATIONS, "stream": True}, "stream"),
        ({"messages": CONVERSATIONS, "n": 2}, "n"),
        (
            {"messages": CONVERSATIONS, "tools": [{"type": "function", "function": {"name": "f"}}]},
            "tools",
        ),
        ({"messages": CONVERSATIONS, "temperature": 5}, "temperature"),
        ({"messages": [CONVERSATIONS[0]] * 1025}, "messages"),
    ],
)
def test_bad_batches(client, engine: FakeEngine, body, param) -> None:
    assert_openai_error(client.simulate_post(BATCH, json=body), 400, param)
    assert engine.added == []
