"""vLLM's `truncate_prompt_tokens` (completions, chat, embeddings) and TGI's `truncate`:
the engine gets the prompt's last k tokens, a cut text prompt is echoed as what was kept,
-1 means the context length, and sizes past it or of 0 are a 400 naming the field."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine, Script
from handlers_testing import EOS_ID, MAX_MODEL_LEN, call_asgi, encode

from engine.tokenizer import Tokenizer

pytestmark = pytest.mark.anyio

COMPLETIONS = "/v1/completions"
PROMPT = "The capital of France is Paris. Hello world! How are you today?"


@pytest.fixture
def answer(engine: FakeEngine, tokenizer: Tokenizer) -> str:
    engine.script = Script(token_ids=[*encode(tokenizer, " Paris."), EOS_ID])
    return " Paris."


async def test_a_text_prompt_keeps_its_last_tokens(client, engine, tokenizer, answer):
    full = tokenizer.encode(PROMPT)
    assert len(full) > 5
    body = {"prompt": PROMPT, "truncate_prompt_tokens": 5, "echo": True}
    result = await call_asgi(client.app, COMPLETIONS, body)
    assert result.status == 200, result.json
    assert engine.added[0].prompt_token_ids == full[-5:]
    assert result.json["usage"]["prompt_tokens"] == 5
    # the echo is what the model saw, not the text as sent
    assert result.json["choices"][0]["text"] == tokenizer.decode(full[-5:]) + answer


async def test_a_prompt_within_the_size_is_unchanged(client, engine, tokenizer, answer):
    full = tokenizer.encode(PROMPT)
    body = {"prompt": PROMPT, "truncate_prompt_tokens": len(full), "echo": True}
    result = await call_asgi(client.app, COMPLETIONS, body)
    assert engine.added[0].prompt_token_ids == full
    assert result.json["choices"][0]["text"] == PROMPT + answer


async def test_token_id_prompts_and_batches(client, engine, tokenizer, answer):
    ids = encode(tokenizer, PROMPT)
    body = {"prompt": [ids, ids[:2]], "truncate_prompt_tokens": 3}
    result = await call_asgi(client.app, COMPLETIONS, body)
    assert result.status == 200, result.json
    prompts = sorted((r.request_id, r.prompt_token_ids) for r in engine.added)
    assert [p for _, p in prompts] == [ids[-3:], ids[:2]]


async def test_a_text_too_long_to_fit_is_cut_not_refused(client, engine, tokenizer, answer):
    """Without truncation such a text is refused before it is tokenized; with it, only
    its end is tokenized, and the tokens kept are those of the whole text's end."""
    long_text = "banana " * (MAX_MODEL_LEN * tokenizer.max_token_bytes) + PROMPT
    refused = await call_asgi(client.app, COMPLETIONS, {"prompt": long_text})
    assert refused.status == 400
    result = await call_asgi(
        client.app, COMPLETIONS, {"prompt": long_text, "truncate_prompt_tokens": 20}
    )
    assert result.status == 200, result.json
    assert engine.added[0].prompt_token_ids == tokenizer.encode(long_text)[-20:]


async def test_minus_one_is_the_context_length(client, engine, tokenizer, answer):
    ids = [5] * (MAX_MODEL_LEN + 40)
    result = await call_asgi(
        client.app, "/v1/embeddings", {"input": ids, "truncate_prompt_tokens": -1}
    )
    assert result.status == 200, result.json
    assert engine.added[0].prompt_token_ids == ids[-MAX_MODEL_LEN:]
    # a generating prompt of the whole context leaves no room for a token: vLLM's 400
    result = await call_asgi(client.app, COMPLETIONS, {"prompt": ids, "truncate_prompt_tokens": -1})
    assert result.status == 400 and "maximum context length" in result.json["error"]["message"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (MAX_MODEL_LEN + 1, "is greater than max_model_len"),
        (0, "must be -1 (the context length) or at least 1"),
        (-2, "greater than or equal to -1"),
        ("5", "valid integer"),
    ],
)
@pytest.mark.parametrize("path", [COMPLETIONS, "/v1/chat/completions", "/v1/embeddings"])
async def test_bad_sizes_are_a_400_naming_the_field(client, engine, path, value, message):
    body = {"truncate_prompt_tokens": value}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt" if path == COMPLETIONS else "input"] = "hi"
    result = await call_asgi(client.app, path, body)
    assert result.status == 400
    error = result.json["error"]
    assert error["param"] == "truncate_prompt_tokens" and message in error["message"]
    assert engine.added == []


async def test_chat_keeps_the_end_of_the_rendered_prompt(client, engine, tokenizer, answer):
    messages = [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    await call_asgi(client.app, "/v1/chat/completions", {"messages": messages})
    full = engine.added[0].prompt_token_ids
    result = await call_asgi(
        client.app, "/v1/chat/completions", {"messages": messages, "truncate_prompt_tokens": 9}
    )
    assert result.status == 200, result.json
    assert engine.added[1].prompt_token_ids == full[-9:]
    assert result.json["usage"]["prompt_tokens"] == 9


async def test_embeddings_embed_the_kept_tokens(client, engine, tokenizer):
    body = {"input": [PROMPT, "apple"], "truncate_prompt_tokens": 4}
    result = await call_asgi(client.app, "/v1/embeddings", body)
    assert result.status == 200, result.json
    prompts = sorted((r.request_id, r.prompt_token_ids) for r in engine.added)
    assert [p for _, p in prompts] == [tokenizer.encode(PROMPT)[-4:], tokenizer.encode("apple")]
    assert result.json["usage"]["prompt_tokens"] == 4 + len(tokenizer.encode("apple"))


async def test_tgi_truncate(client, engine, tokenizer, answer):
    body = {"inputs": PROMPT, "parameters": {"truncate": 6, "return_full_text": True}}
    result = await call_asgi(client.app, "/invocations", body)
    assert result.status == 200, result.json
    assert engine.added[0].prompt_token_ids == tokenizer.encode(PROMPT)[-6:]
    assert result.json == [{"generated_text": PROMPT + answer, "details": None}]  # as TGI
    too_big = {"inputs": PROMPT, "parameters": {"truncate": MAX_MODEL_LEN + 1}}
    result = await call_asgi(client.app, "/invocations", too_big)
    assert result.status == 400 and result.json["error"]["param"] == "parameters.truncate"


async def test_truncation_side_right_keeps_the_first_tokens(client, engine, tokenizer, answer):
    """vLLM's `truncation_side`: "right" keeps a prompt's first k tokens (text or ids),
    and a text too long to fit is then cut at its end before tokenizing."""
    full = tokenizer.encode(PROMPT)
    body = {"prompt": PROMPT, "truncate_prompt_tokens": 5, "truncation_side": "right"}
    result = await call_asgi(client.app, COMPLETIONS, {**body, "echo": True})
    assert result.status == 200, result.json
    assert engine.added[0].prompt_token_ids == full[:5]
    assert result.json["choices"][0]["text"] == tokenizer.decode(full[:5]) + answer
    ids = encode(tokenizer, PROMPT)
    embed = {"input": ids, "truncate_prompt_tokens": 5, "truncation_side": "right"}
    await call_asgi(client.app, "/v1/embeddings", embed)
    assert engine.added[1].prompt_token_ids == ids[:5]
    long_text = PROMPT + " banana" * (MAX_MODEL_LEN * tokenizer.max_token_bytes)
    result = await call_asgi(client.app, COMPLETIONS, {**body, "prompt": long_text})
    assert engine.added[2].prompt_token_ids == full[:5]
    result = await call_asgi(client.app, COMPLETIONS, {**body, "truncation_side": "middle"})
    assert result.status == 400 and result.json["error"]["param"] == "truncation_side"
