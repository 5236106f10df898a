"""vLLM's request extras that change what comes back: `return_token_ids` and
`return_tokens_as_token_ids` on chat and completions (every generated id, a stop token
and the ids of a character split across tokens included, streamed or not; the prompt's
ids once; logprob tokens as `token_id:<id>`), `cache_salt` on every generating and
embedding route, chat's `include_reasoning` and `reasoning_effort`, `allowed_token_ids`, and
`logits_processors` refused."""

from __future__ import annotations

import msgspec
import pytest
from fake_engine import FakeEngine, Script
from handlers_testing import EOS_ID, call_asgi, encode

from engine.tokenizer import Tokenizer

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Say hi"}]
ANSWER = "Hi 😀 there"


@pytest.fixture
def answer_ids(engine: FakeEngine, tokenizer: Tokenizer) -> list[int]:
    tokens = encode(tokenizer, ANSWER)
    assert any("\ufffd" in tokenizer.decode([t]) for t in tokens), "the emoji must be split"
    engine.script = Script(token_ids=[*tokens, EOS_ID])
    return [*tokens, EOS_ID]


def streamed_ids(events: list, key: str = "token_ids") -> dict[int, list[int]]:
    ids: dict[int, list[int]] = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            ids.setdefault(choice["index"], []).extend(choice.get(key) or [])
    return ids


async def test_chat_answers_with_the_ids(client, engine, answer_ids):
    body = {"messages": MESSAGES, "return_token_ids": True}
    result = await call_asgi(client.app, CHAT, body)
    assert result.status == 200, result.json
    assert result.json["choices"][0]["token_ids"] == answer_ids
    assert result.json["prompt_token_ids"] == engine.added[0].prompt_token_ids
    assert result.json["choices"][0]["message"]["content"] == ANSWER

    streamed = await call_asgi(client.app, CHAT, {**body, "stream": True, "n": 2})
    chunks = streamed.events[:-1]
    assert chunks[0]["prompt_token_ids"] == engine.added[1].prompt_token_ids
    assert all("prompt_token_ids" not in chunk for chunk in chunks[1:])
    assert streamed_ids(streamed.events) == {0: answer_ids, 1: answer_ids}


async def test_completion_answers_with_the_ids(client, engine, tokenizer, answer_ids):
    prompts = ["apple banana", "cherry"]
    body = {"prompt": prompts, "n": 2, "return_token_ids": True, "max_tokens": 50}
    result = await call_asgi(client.app, COMPLETIONS, body)
    assert result.status == 200, result.json
    for choice in result.json["choices"]:
        assert choice["token_ids"] == answer_ids
        assert choice["prompt_token_ids"] == tokenizer.encode(prompts[choice["index"] // 2])

    streamed = await call_asgi(client.app, COMPLETIONS, {**body, "stream": True})
    assert streamed_ids(streamed.events) == {i: answer_ids for i in range(4)}
    firsts: dict[int, list[int]] = {}
    for event in streamed.events[:-1]:
        for choice in event["choices"]:
            if "prompt_token_ids" in choice:
                assert choice["index"] not in firsts, "the prompt's ids come once per choice"
                firsts[choice["index"]] = choice["prompt_token_ids"]
    assert firsts == {i: tokenizer.encode(prompts[i // 2]) for i in range(4)}


async def test_without_the_flag_there_are_no_ids(client, engine, answer_ids):
    result = await call_asgi(client.app, CHAT, {"messages": MESSAGES})
    assert result.json["choices"][0]["token_ids"] is None  # vLLM's null
    assert result.json["prompt_token_ids"] is None
    streamed = await call_asgi(client.app, COMPLETIONS, {"prompt": "hi", "stream": True})
    for event in streamed.events[:-1]:
        for choice in event["choices"]:
            assert "token_ids" not in choice and "prompt_token_ids" not in choice


async def test_logprob_tokens_as_token_ids(client, engine, answer_ids):
    body = {
        "messages": MESSAGES,
        "logprobs": True,
        "top_logprobs": 2,
        "return_tokens_as_token_ids": True,
    }
    content = (await call_asgi(client.app, CHAT, body)).json["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in content] == [f"token_id:{t}" for t in answer_ids]
    assert all(bytes(e["bytes"]).decode() == e["token"] for e in content)
    assert all(top["token"].startswith("token_id:") for e in content for top in e["top_logprobs"])

    body = {"prompt": "hi", "logprobs": 1, "return_tokens_as_token_ids": True, "max_tokens": 50}
    logprobs = (await call_asgi(client.app, COMPLETIONS, body)).json["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in answer_ids]
    plain = {"prompt": "hi", "logprobs": 1, "max_tokens": 50}
    decoded = (await call_asgi(client.app, COMPLETIONS, plain)).json["choices"][0]["logprobs"]
    assert decoded["tokens"][0] != logprobs["tokens"][0]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, {"messages": MESSAGES}),
        (COMPLETIONS, {"prompt": "hi", "n": 2}),
        ("/v1/embeddings", {"input": ["a", "b"]}),
        ("/v1/responses", {"input": "hi"}),
    ],
)
async def test_cache_salt_reaches_the_engine(client, engine, answer_ids, path, body):
    """vLLM's cache_salt goes with every engine request of the call (the engine seeds its
    prefix-cache hash chain with it: tests/engine/test_block_manager.py); an empty or
    non-string salt is a 400."""
    result = await call_asgi(client.app, path, {**body, "cache_salt": "tenant-7"})
    assert result.status == 200, result.json
    assert len(engine.added) >= 2 or path in (CHAT, "/v1/responses")
    assert {r.cache_salt for r in engine.added} == {"tenant-7"}
    for bad in ("", 7):
        result = await call_asgi(client.app, path, {**body, "cache_salt": bad})
        assert result.status == 400 and result.json["error"]["param"] == "cache_salt"


@pytest.mark.parametrize("stream", [False, True])
async def test_include_reasoning_false_leaves_the_reasoning_out(
    make_client, engine, tokenizer, stream
):
    client = make_client(reasoning_parser="think")
    text = "<think>Paris is in France.</think>Paris."
    engine.script = Script(token_ids=[*encode(tokenizer, text), EOS_ID])

    async def answer(**extra) -> tuple[str | None, str]:
        body = {"messages": MESSAGES, "stream": stream, **extra}
        result = await call_asgi(client.app, CHAT, body)
        assert result.status == 200, result.body
        if not stream:
            message = result.json["choices"][0]["message"]
            return message["reasoning_content"], message["content"]
        deltas = [c["delta"] for e in result.events[:-1] for c in e["choices"]]
        thought = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
        return ("".join(thought) if thought else None), "".join(
            d.get("content", "") for d in deltas
        )

    assert await answer() == ("Paris is in France.", "Paris.")
    assert await answer(include_reasoning=False) == (None, "Paris.")


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_logits_processors_are_refused(client, engine, path):
    body = {"logits_processors": ["my_module.MyProcessor"]}
    body |= {"messages": MESSAGES} if path == CHAT else {"prompt": "hi"}
    result = await call_asgi(client.app, path, body)
    assert result.status == 400 and result.json["error"]["param"] == "logits_processors"
    assert engine.added == []


EFFORT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "|effort={{ reasoning_effort | default('unset') }}"
)


async def test_reasoning_effort_is_a_template_variable(make_client, engine, tokenizer, answer_ids):
    """vLLM's chat `reasoning_effort` reaches the chat template (gpt-oss's reads it), on
    chat and on /tokenize alike; a chat_template_kwargs entry of that name wins."""
    client = make_client(trust_request_chat_template=True)
    base = {"messages": MESSAGES, "chat_template": EFFORT_TEMPLATE}

    async def rendered(**extra) -> str:
        result = await call_asgi(client.app, "/tokenize", {**base, **extra})
        assert result.status == 200, result.json
        return tokenizer.decode(result.json["tokens"])

    assert (await rendered()).endswith("|effort=unset")
    assert (await rendered(reasoning_effort="low")).endswith("|effort=low")
    kwargs = {"chat_template_kwargs": {"reasoning_effort": "high"}}
    assert (await rendered(reasoning_effort="low", **kwargs)).endswith("|effort=high")
    await call_asgi(client.app, CHAT, {**base, "reasoning_effort": "medium"})
    assert tokenizer.decode(engine.added[0].prompt_token_ids).endswith("|effort=medium")
    result = await call_asgi(client.app, CHAT, {**base, "reasoning_effort": "extreme"})
    assert result.status == 400 and result.json["error"]["param"] == "reasoning_effort"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_allowed_token_ids_reach_the_engine(client, engine, tokenizer, answer_ids, path):
    """vLLM's allowed_token_ids: deduplicated into the engine's params (the sampler masks
    the rest: tests/engine/test_sampler.py); out of the vocabulary, empty, negative, or
    with structured outputs (two masks could leave nothing) a 400 naming the field."""
    base = {"messages": MESSAGES} if path == CHAT else {"prompt": "hi"}
    result = await call_asgi(client.app, path, {**base, "allowed_token_ids": [9, 4, 9]})
    assert result.status == 200, result.json
    assert engine.added[0].params.allowed_token_ids == [4, 9]
    for bad in ([], [-1], [tokenizer.vocab_size], "4"):
        result = await call_asgi(client.app, path, {**base, "allowed_token_ids": bad})
        assert result.status == 400 and result.json["error"]["param"] == "allowed_token_ids"
    json_mode = {"response_format": {"type": "json_object"}, "allowed_token_ids": [4]}
    result = await call_asgi(client.app, path, {**base, **json_mode})
    assert result.status == 400 and result.json["error"]["param"] == "allowed_token_ids"
    assert len(engine.added) == 1


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_bad_words_reach_the_engine_tokenized(client, engine, tokenizer, answer_ids, path):
    """vLLM's bad_words: each word tokenized without special tokens, bare and (when that
    is a different first token of the same length) after a space, deduplicated, into the
    engine's params (the sampler bans them: tests/engine/test_sampler.py); an empty or
    blank word, too many words or too long a word is a 400 naming the field."""
    base = {"messages": MESSAGES} if path == CHAT else {"prompt": "hi"}
    words = ["Paris", " Paris", "Hello world"]
    result = await call_asgi(client.app, path, {**base, "bad_words": words})
    assert result.status == 200, result.json
    expected = []
    for word in ("Paris", "Hello world"):
        bare = tokenizer.encode(word, add_special_tokens=False)
        spaced = tokenizer.encode(" " + word, add_special_tokens=False)
        expected.append(bare)
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            expected.append(spaced)
    assert len(expected) > 2, "the tiny vocabulary should give a spaced form too"
    assert engine.added[0].params.bad_words_token_ids == expected
    for bad, param in (
        ([""], "bad_words[0]"),
        (["ok", "  "], "bad_words[1]"),
        (["x" * 1025], "bad_words[0]"),
        ([f"w{i}" for i in range(129)], "bad_words"),
        ("banana", "bad_words"),
    ):
        result = await call_asgi(client.app, path, {**base, "bad_words": bad})
        assert result.status == 400 and result.json["error"]["param"] == param, (bad, result.json)
    many = [f"word{i} other{i} more{i}" for i in range(128)]
    result = await call_asgi(client.app, path, {**base, "bad_words": many})
    assert result.status == 400 and result.json["error"]["param"] == "bad_words"
    assert len(engine.added) == 1


async def test_logprob_token_ids_reach_the_engine_and_the_answer(client, engine, answer_ids):
    """Chat's logprob_token_ids (vLLM): the ids reach the engine with logprobs = their
    count, and every position's top_logprobs lists as many entries as asked (the
    engine's entries, in order); without logprobs, out of the vocabulary, negative or
    more than 128 ids a 400 naming the field."""
    named = [5, 9, 5]
    body = {"messages": MESSAGES, "logprobs": True, "logprob_token_ids": named}
    result = await call_asgi(client.app, CHAT, body)
    assert result.status == 200, result.json
    params = engine.added[0].params
    assert params.logprob_token_ids == named and params.logprobs == len(named)
    content = result.json["choices"][0]["logprobs"]["content"]
    assert content and all(len(entry["top_logprobs"]) == len(named) for entry in content)
    for bad in (
        {"logprob_token_ids": [5]},
        {"logprobs": True, "logprob_token_ids": [-1]},
        {"logprobs": True, "logprob_token_ids": [10**9]},
        {"logprobs": True, "logprob_token_ids": list(range(129))},
    ):
        result = await call_asgi(client.app, CHAT, {"messages": MESSAGES, **bad})
        assert result.status == 400 and result.json["error"]["param"] == "logprob_token_ids", (
            bad,
            result.json,
        )
    assert len(engine.added) == 1


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_thinking_token_budget_reaches_the_engine(make_client, engine, tokenizer, path):
    """vLLM's thinking_token_budget on a model that reasons in <think> blocks: the budget
    and the tags' ids reach the engine (which forces the closing tag:
    tests/engine/test_thinking_budget.py); -1 is no cap; on a model that does not reason,
    with structured outputs, or negative, a 400 naming the field."""
    base = {"messages": MESSAGES} if path == CHAT else {"prompt": "hi"}
    reasoning = make_client(reasoning_parser="think")
    result = await call_asgi(reasoning.app, path, {**base, "thinking_token_budget": 7})
    assert result.status == 200, result.json
    spec = engine.added[-1].params.thinking
    assert spec is not None and spec.budget == 7
    assert spec.start_ids == tokenizer.encode("<think>", add_special_tokens=False)
    assert spec.end_ids == tokenizer.encode("</think>", add_special_tokens=False)
    result = await call_asgi(reasoning.app, path, {**base, "thinking_token_budget": -1})
    assert result.status == 200 and engine.added[-1].params.thinking is None
    count = len(engine.added)
    plain = make_client()
    for client, extra in (
        (plain, {"thinking_token_budget": 5}),
        (reasoning, {"thinking_token_budget": -2}),
        (reasoning, {"thinking_token_budget": 5, "response_format": {"type": "json_object"}}),
        (reasoning, {"thinking_token_budget": 1.5}),
    ):
        result = await call_asgi(client.app, path, {**base, **extra})
        assert result.status == 400, (extra, result.json)
        assert result.json["error"]["param"] == "thinking_token_budget", result.json
    assert len(engine.added) == count


async def test_anthropic_budget_tokens_caps_reasoning_where_the_model_reasons(
    make_client, engine, tokenizer
):
    # Anthropic's budget_tokens is >= 1024 and below max_tokens: a context that fits it.
    engine.info = msgspec.structs.replace(engine.info, max_model_len=8192)
    body = {
        "model": "tiny",
        "max_tokens": 4096,
        "messages": [{"role": "user", "content": "hi"}],
        "thinking": {"type": "enabled", "budget_tokens": 2048},
    }
    result = await call_asgi(make_client(reasoning_parser="think").app, "/v1/messages", body)
    assert result.status == 200, result.json
    assert engine.added[-1].params.thinking.budget == 2048
    result = await call_asgi(make_client().app, "/v1/messages", body)
    assert result.status == 200, result.json  # advisory where the model does not reason
    assert engine.added[-1].params.thinking is None


async def test_return_prompt_text_is_the_rendered_prompt(client, engine, tokenizer, answer_ids):
    """vLLM's return_prompt_text on chat: the prompt the template rendered (its tokens
    are the engine's prompt), in the answer or in the stream's first chunk only."""
    body = {"messages": MESSAGES, "return_prompt_text": True}
    result = await call_asgi(client.app, CHAT, body)
    assert result.status == 200, result.json
    text = result.json["prompt_text"]
    assert MESSAGES[0]["content"] in text and text.startswith("<|im_start|>")
    assert tokenizer.encode(text, add_special_tokens=False) == engine.added[0].prompt_token_ids
    streamed = await call_asgi(client.app, CHAT, {**body, "stream": True})
    chunks = streamed.events[:-1]
    assert chunks[0]["prompt_text"] == text
    assert all("prompt_text" not in chunk for chunk in chunks[1:])
    plain = await call_asgi(client.app, CHAT, {"messages": MESSAGES})
    assert "prompt_text" not in plain.json or plain.json["prompt_text"] is None
