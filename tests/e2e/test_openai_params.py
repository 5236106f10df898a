"""Every supported request parameter, through the real `openai` SDK against the real
default server (gunicorn + 2 uvicorn workers + engine core + SmolLM2), each test
asserting the parameter's effect on the output, not only that the call succeeds.

Greedy means temperature 0. Token budgets are small: the engine runs on two shared cores.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.clients import async_client, client, metric, sse_data, wait_metric
from tests.e2e.server import Server

pytestmark = pytest.mark.slow

MODEL = "smollm2"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
ROCKET = [{"role": "user", "content": "Write the emoji for a rocket and the earth."}]
CHINESE = [{"role": "user", "content": "Translate to Chinese: Hello, world!"}]
PROMPT = "The capital of France is"


@dataclass(frozen=True)
class Greedy:
    """The greedy answer to FRANCE, and facts about its first token."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    tokens: list[str]
    """The answer's tokens as text (from its logprobs)."""
    first_token_id: int

    @property
    def first_token(self) -> str:
        return self.tokens[0]


def tokenize(server: Server, **body: Any) -> dict[str, Any]:
    r = httpx.post(server.url + "/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def token_id(server: Server, text: str) -> int:
    tokens = tokenize(server, prompt=text, add_special_tokens=False)["tokens"]
    assert len(tokens) == 1, (text, tokens)
    return tokens[0]


def extra(obj: Any, name: str) -> Any:
    """A vLLM field the SDK's models do not declare (kept as an extra attribute)."""
    return (obj.model_extra or {}).get(name)


@pytest.fixture(scope="module")
def france(default_server: Server) -> Greedy:
    reply = client(default_server).chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, logprobs=True
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and "Paris" in choice.message.content
    tokens = [entry.token for entry in choice.logprobs.content]
    return Greedy(
        text=choice.message.content,
        prompt_tokens=reply.usage.prompt_tokens,
        completion_tokens=reply.usage.completion_tokens,
        tokens=tokens,
        first_token_id=token_id(default_server, tokens[0]),
    )


def chat(server: Server, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", FRANCE)
    return client(server).chat.completions.create(model=MODEL, **kwargs)


def complete(server: Server, **kwargs: Any) -> Any:
    return client(server).completions.create(model=MODEL, **kwargs)


async def gather(*calls: Any) -> list[Any]:
    return list(await asyncio.gather(*calls))


# -- logit_bias -----------------------------------------------------------------------
def test_logit_bias_removes_and_forces_tokens(default_server: Server, france: Greedy) -> None:
    banned = chat(
        default_server,
        temperature=0,
        max_tokens=8,
        logprobs=True,
        logit_bias={str(france.first_token_id): -100},
    )
    tokens = [entry.token for entry in banned.choices[0].logprobs.content]
    assert tokens and france.first_token not in tokens
    assert not banned.choices[0].message.content.startswith(france.first_token)

    forced_id = token_id(default_server, "Hello")
    forced = chat(default_server, temperature=0, max_tokens=3, logit_bias={str(forced_id): 100})
    assert forced.choices[0].message.content == "Hello" * 3


# -- stop strings -----------------------------------------------------------------------
def test_stop_string_truncates_and_include_stop_str(default_server: Server, france: Greedy) -> None:
    assert "France" in france.text
    before = france.text.split("France")[0]
    stopped = chat(default_server, temperature=0, stop=["Atlantis", "France"])
    choice = stopped.choices[0]
    assert choice.message.content == before
    assert choice.finish_reason == "stop" and extra(choice, "stop_reason") == "France"

    kept = chat(
        default_server,
        temperature=0,
        stop="France",
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].message.content == before + "France"
    assert extra(kept.choices[0], "stop_reason") == "France"

    # Streamed: the same text, no part of the stop string, and the stop reason at the end.
    chunks = list(chat(default_server, temperature=0, stop=["France"], stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == before
    last = [c for c in chunks if c.choices][-1].choices[0]
    assert last.finish_reason == "stop" and extra(last, "stop_reason") == "France"

    never = chat(default_server, temperature=0, stop=["Atlantis"])
    assert never.choices[0].message.content == france.text
    assert extra(never.choices[0], "stop_reason") is None


# -- n ---------------------------------------------------------------------------------
def test_n_three_choices_and_interleaved_stream(default_server: Server) -> None:
    reply = chat(default_server, n=3, temperature=1.0, seed=11, max_tokens=8)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) > 1, "seed + i per choice"
    assert 3 <= reply.usage.completion_tokens <= 24

    stream = chat(
        default_server,
        n=3,
        temperature=1.0,
        seed=5,
        max_tokens=8,
        stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True},
    )
    order: list[int] = []
    finished: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                order.append(choice.index)
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert set(order) == {0, 1, 2}
    assert finished == {0: "length", 1: "length", 2: "length"}
    first = {i: order.index(i) for i in range(3)}
    last = {i: len(order) - 1 - order[::-1].index(i) for i in range(3)}
    assert max(first.values()) < min(last.values()), f"not interleaved: {order}"
    assert usage is not None and usage.completion_tokens == 24


# -- seed -----------------------------------------------------------------------------
def test_seed_reproduces_sampled_text(default_server: Server) -> None:
    def sample(seed: int) -> str:
        out = complete(
            default_server, prompt="Once upon a time", temperature=1.0, seed=seed, max_tokens=8
        )
        return out.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    others = [sample(4321), sample(99)]
    assert any(text != first for text in others), (first, others)


# -- echo -------------------------------------------------------------------------------
def test_completion_echo_prepends_the_prompt(default_server: Server) -> None:
    plain = complete(default_server, prompt=PROMPT, temperature=0, max_tokens=4)
    echoed = complete(default_server, prompt=PROMPT, temperature=0, max_tokens=4, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.usage.completion_tokens == 4

    chunks = list(
        complete(default_server, prompt=PROMPT, temperature=0, max_tokens=4, echo=True, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.choices[0].text


# -- stream_options ------------------------------------------------------------------------
def test_include_usage_and_continuous_usage_stats(default_server: Server, france: Greedy) -> None:
    chunks = list(
        chat(
            default_server,
            temperature=0,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert all(c.usage is None for c in chunks[:-1])
    final = chunks[-1]
    assert final.choices == []
    assert final.usage.completion_tokens == 5
    assert final.usage.prompt_tokens == france.prompt_tokens
    assert final.usage.total_tokens == france.prompt_tokens + 5

    plain = list(chat(default_server, temperature=0, max_tokens=3, stream=True))
    assert all(c.usage is None and c.choices for c in plain)

    continuous = list(
        chat(
            default_server,
            temperature=0,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert all(c.usage is not None for c in continuous)
    counts = [c.usage.completion_tokens for c in continuous]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 5
    assert len(set(counts)) > 2, counts
    assert continuous[-1].choices == []

    # The same for completions.
    comp = list(
        complete(
            default_server,
            prompt=PROMPT,
            temperature=0,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    assert comp[-1].choices == [] and comp[-1].usage.completion_tokens == 4
    assert all(c.usage is not None for c in comp)


# -- streamed text == non-streamed text, multi-byte output included ------------------------
@pytest.mark.parametrize(
    ("messages", "max_tokens", "kind"),
    [(FRANCE, None, "ascii"), (CHINESE, 10, "cjk"), (ROCKET, 12, "emoji")],
    ids=["ascii", "cjk", "emoji"],
)
def test_stream_equals_non_stream(
    default_server: Server, messages: list[dict[str, str]], max_tokens: int | None, kind: str
) -> None:
    reply = chat(default_server, messages=messages, temperature=0, max_tokens=max_tokens)
    text = reply.choices[0].message.content
    chunks = list(
        chat(default_server, messages=messages, temperature=0, max_tokens=max_tokens, stream=True)
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert "\ufffd" not in text
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1
    if kind == "cjk":
        assert any("\u4e00" <= ch <= "\u9fff" for ch in text), text
    if kind == "emoji":
        assert any(ord(ch) >= 0x1F300 for ch in text), text


@pytest.mark.parametrize(
    "prompt", ["The Chinese word for hello is", "Rocket emojis: 🚀🚀🚀"], ids=["cjk", "emoji"]
)
def test_completion_stream_equals_non_stream_multibyte(default_server: Server, prompt: str) -> None:
    done = complete(default_server, prompt=prompt, temperature=0, max_tokens=10)
    text = done.choices[0].text
    pieces = complete(default_server, prompt=prompt, temperature=0, max_tokens=10, stream=True)
    assert "".join(c.choices[0].text for c in pieces if c.choices) == text
    assert not text.isascii() and "\ufffd" not in text, text


# -- max_tokens / max_completion_tokens -------------------------------------------------------
def test_max_tokens_and_max_completion_tokens(default_server: Server) -> None:
    for kwargs, want in (
        ({"max_tokens": 3}, 3),
        ({"max_completion_tokens": 4}, 4),
        ({"max_tokens": 2, "max_completion_tokens": 5}, 5),
    ):
        reply = chat(default_server, temperature=0, **kwargs)
        assert reply.choices[0].finish_reason == "length", kwargs
        assert reply.usage.completion_tokens == want, kwargs
    out = complete(default_server, prompt=PROMPT, temperature=0, max_tokens=3)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3


# -- min_tokens, stop_token_ids, ignore_eos ------------------------------------------------
def test_min_tokens_with_stop_token_ids(default_server: Server, france: Greedy) -> None:
    stop_id = france.first_token_id
    at_once = chat(default_server, temperature=0, extra_body={"stop_token_ids": [stop_id]})
    choice = at_once.choices[0]
    assert choice.message.content == "" and at_once.usage.completion_tokens == 1
    assert choice.finish_reason == "stop" and extra(choice, "stop_reason") == stop_id

    # Until min_tokens the stop ids are masked (vLLM): the request cannot stop on them.
    later = chat(
        default_server,
        temperature=0,
        max_tokens=6,
        logprobs=True,
        extra_body={"stop_token_ids": [stop_id], "min_tokens": 3},
    )
    assert later.usage.completion_tokens >= 3
    assert later.choices[0].logprobs.content[0].token != france.first_token

    # After min_tokens they stop it: " Paris" is the 6th greedy token.
    paris = next(i for i, t in enumerate(france.tokens) if "Paris" in t)
    paris_id = token_id(default_server, france.tokens[paris])
    at_paris = chat(
        default_server,
        temperature=0,
        extra_body={"stop_token_ids": [paris_id], "min_tokens": 2},
    )
    assert at_paris.usage.completion_tokens == paris + 1
    assert at_paris.choices[0].message.content == "".join(france.tokens[:paris])
    assert extra(at_paris.choices[0], "stop_reason") == paris_id

    # min_tokens also holds EOS off.
    want = france.completion_tokens + 4
    longer = chat(default_server, temperature=0, max_tokens=want, extra_body={"min_tokens": want})
    assert longer.usage.completion_tokens == want
    assert longer.choices[0].finish_reason == "length"


def test_ignore_eos(default_server: Server, france: Greedy) -> None:
    want = france.completion_tokens + 3
    reply = chat(default_server, temperature=0, max_tokens=want, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == want
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content.startswith(france.text)
    # Without it the same request stops at EOS.
    normal = chat(default_server, temperature=0, max_tokens=want)
    assert normal.choices[0].finish_reason == "stop"
    assert normal.usage.completion_tokens == france.completion_tokens


# -- logprobs -------------------------------------------------------------------------------
def test_chat_logprobs_and_top_logprobs(default_server: Server) -> None:
    reply = chat(default_server, temperature=0, max_tokens=4, logprobs=True, top_logprobs=5)
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert len(content) == 4
    for entry in content:
        top = entry.top_logprobs
        assert len(top) == 5
        values = [t.logprob for t in top]
        assert values == sorted(values, reverse=True)
        assert all(v <= 0 for v in values)
        # Greedy: the sampled token is the most likely one.
        assert entry.token == top[0].token
        assert entry.logprob == pytest.approx(top[0].logprob, abs=1e-4)
        assert bytes(entry.bytes).decode("utf-8") == entry.token
    assert "".join(e.token for e in content) == choice.message.content

    none = chat(default_server, temperature=0, max_tokens=2, logprobs=True, top_logprobs=0)
    assert all(e.top_logprobs == [] for e in none.choices[0].logprobs.content)
    plain = chat(default_server, temperature=0, max_tokens=2)
    assert plain.choices[0].logprobs is None

    chunks = list(
        chat(
            default_server, temperature=0, max_tokens=4, logprobs=True, top_logprobs=5, stream=True
        )
    )
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_logprob_bytes_reassemble_split_characters(default_server: Server) -> None:
    """An emoji is three byte-level tokens here: each token's text is U+FFFD, but their
    `bytes` joined are the UTF-8 of the content."""
    reply = chat(default_server, messages=ROCKET, temperature=0, max_tokens=12, logprobs=True)
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert any(entry.token == "\ufffd" for entry in content)
    assert b"".join(bytes(entry.bytes) for entry in content) == choice.message.content.encode()


def test_completion_logprobs_with_text_offset(default_server: Server) -> None:
    out = complete(default_server, prompt=PROMPT, temperature=0, max_tokens=5, logprobs=3)
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset[0] == 0
    for i in range(1, 5):
        assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 3 <= len(top) <= 4
        assert top[token] == pytest.approx(logprob, abs=1e-4)
        assert logprob == pytest.approx(max(top.values()), abs=1e-4)

    chunks = list(
        complete(
            default_server, prompt=PROMPT, temperature=0, max_tokens=5, logprobs=3, stream=True
        )
    )
    offsets = [
        o
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for o in c.choices[0].logprobs.text_offset
    ]
    assert offsets == lp.text_offset


# -- sampling filters ----------------------------------------------------------------------
def test_top_k_top_p_min_p_narrow_to_greedy(invariant_server: Server) -> None:
    """Five requests at once, compared with each other: the batch-invariant mode (how many
    share a step depends on arrival)."""

    async def run() -> list[str]:
        api = async_client(invariant_server)

        async def one(**kwargs: Any) -> str:
            out = await api.completions.create(
                model=MODEL, prompt="Once upon a time", max_tokens=10, **kwargs
            )
            return out.choices[0].text

        try:
            return await gather(
                one(temperature=0),
                one(temperature=1.5, seed=3, extra_body={"top_k": 1}),
                one(temperature=1.5, seed=3, top_p=1e-6),
                one(temperature=1.5, seed=3, extra_body={"min_p": 1.0}),
                one(temperature=1.5, seed=3),
            )
        finally:
            await api.close()

    greedy, top_k, top_p, min_p, free = asyncio.run(run())
    assert top_k == greedy
    assert top_p == greedy
    assert min_p == greedy
    assert free != greedy, "the filters above had something to filter"


def test_penalties_change_repetitive_greedy_output(default_server: Server) -> None:
    async def run() -> list[str]:
        api = async_client(default_server)

        async def one(**kwargs: Any) -> str:
            out = await api.chat.completions.create(
                model=MODEL, messages=ROCKET, temperature=0, max_tokens=12, **kwargs
            )
            return out.choices[0].message.content

        try:
            return await gather(
                one(),
                one(presence_penalty=2.0),
                one(frequency_penalty=2.0),
                one(extra_body={"repetition_penalty": 1.5}),
            )
        finally:
            await api.close()

    base, presence, frequency, repetition = asyncio.run(run())
    assert base.count("🚀") >= 3, base
    assert presence != base
    assert frequency != base
    assert repetition != base


# -- special tokens, chat template switches --------------------------------------------------
def test_skip_special_tokens_false_shows_special_tokens(default_server: Server) -> None:
    rendered = tokenize(default_server, messages=FRANCE, return_token_strs=True)
    prompt_ids = (
        rendered["tokens"]
        + tokenize(
            default_server, prompt="The capital of France is Paris.", add_special_tokens=False
        )["tokens"]
    )
    common = {"prompt": prompt_ids, "temperature": 0, "max_tokens": 3}
    shown = complete(
        default_server, **common, extra_body={"ignore_eos": True, "skip_special_tokens": False}
    )
    hidden = complete(default_server, **common, extra_body={"ignore_eos": True})
    assert "<|im_end|>" in shown.choices[0].text
    assert "<|im_end|>" not in hidden.choices[0].text

    # In chat the EOS text shows only when asked for both.
    both = chat(
        default_server,
        temperature=0,
        extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True},
    )
    assert both.choices[0].message.content.endswith("<|im_end|>")
    only_skip = chat(default_server, temperature=0, extra_body={"skip_special_tokens": False})
    assert "<|im_end|>" not in only_skip.choices[0].message.content


def test_add_generation_prompt_and_continue_final_message(
    default_server: Server, france: Greedy
) -> None:
    without = chat(
        default_server, temperature=0, max_tokens=1, extra_body={"add_generation_prompt": False}
    )
    assert without.usage.prompt_tokens < france.prompt_tokens
    counted = tokenize(default_server, messages=FRANCE, add_generation_prompt=False)["count"]
    assert without.usage.prompt_tokens == counted
    assert tokenize(default_server, messages=FRANCE)["count"] == france.prompt_tokens

    partial = "The capital of France is"
    messages = [*FRANCE, {"role": "assistant", "content": partial}]
    body = {"add_generation_prompt": False, "continue_final_message": True}
    continued = chat(
        default_server, messages=messages, temperature=0, max_tokens=3, extra_body=body
    )
    assert "Paris" in continued.choices[0].message.content
    assert not continued.choices[0].message.content.startswith(partial)
    echoed = chat(
        default_server,
        messages=messages,
        temperature=0,
        max_tokens=3,
        extra_body={**body, "echo": True},
    )
    assert echoed.choices[0].message.content == partial + continued.choices[0].message.content


# -- response_format, request_id, user ----------------------------------------------------------
def test_response_format_text_is_plain_generation(default_server: Server) -> None:
    # json_object / json_schema: tests/e2e/test_structured_outputs.py
    reply = chat(
        default_server, temperature=0, max_tokens=2, response_format={"type": "text"}, user="u-1"
    )
    assert reply.usage.completion_tokens == 2


def test_body_request_id_names_the_response(default_server: Server) -> None:
    reply = chat(default_server, temperature=0, max_tokens=1, extra_body={"request_id": "abc-42"})
    assert reply.id == "chatcmpl-abc-42"
    out = complete(default_server, prompt=PROMPT, max_tokens=1, extra_body={"request_id": "abc-43"})
    assert out.id == "cmpl-abc-43"


# -- completion prompts ------------------------------------------------------------------------
def test_prompt_as_token_ids_and_lists(default_server: Server) -> None:
    text_out = complete(default_server, prompt=PROMPT, temperature=0, max_tokens=4)
    ids = tokenize(default_server, prompt=PROMPT)["tokens"]
    id_out = complete(default_server, prompt=ids, temperature=0, max_tokens=4)
    assert id_out.choices[0].text == text_out.choices[0].text
    assert id_out.usage.prompt_tokens == text_out.usage.prompt_tokens == len(ids)

    second = "One, two, three,"
    ids2 = tokenize(default_server, prompt=second)["tokens"]
    lists = complete(default_server, prompt=[ids, ids2], temperature=0, max_tokens=4)
    assert [c.index for c in lists.choices] == [0, 1]
    assert lists.choices[0].text == text_out.choices[0].text
    assert lists.usage.prompt_tokens == len(ids) + len(ids2)

    many = complete(
        default_server,
        prompt=[PROMPT, second],
        n=2,
        temperature=0.8,
        seed=1,
        max_tokens=4,
        echo=True,
    )
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert all(c.text.startswith(PROMPT) for c in many.choices[:2])
    assert all(c.text.startswith(second) for c in many.choices[2:])
    assert many.usage.prompt_tokens == len(ids) + len(ids2)
    assert many.usage.completion_tokens == 16


def test_truncate_prompt_tokens(default_server: Server) -> None:
    """vLLM's truncate_prompt_tokens through the SDK's extra_body: completions, chat and
    embeddings run on the prompt's last k tokens, exactly as if those ids were sent."""
    long = "The quick brown fox jumps over the lazy dog, and then it naps. " * 40
    ids = tokenize(default_server, prompt=long)["tokens"]
    assert len(ids) > 100
    cut = complete(
        default_server,
        prompt=long,
        temperature=0,
        max_tokens=4,
        echo=True,
        extra_body={"truncate_prompt_tokens": 12},
    )
    as_ids = complete(default_server, prompt=ids[-12:], temperature=0, max_tokens=4, echo=True)
    assert cut.usage.prompt_tokens == 12
    assert cut.choices[0].text == as_ids.choices[0].text  # the echo is the kept tokens too
    assert len(cut.choices[0].text) < len(long) / 10

    sdk = client(default_server)
    reply = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": long}],
        max_tokens=2,
        extra_body={"truncate_prompt_tokens": 20},
    )
    assert reply.usage.prompt_tokens == 20

    vectors = sdk.embeddings.create(
        model=MODEL, input=long, extra_body={"truncate_prompt_tokens": 16}
    )
    same = sdk.embeddings.create(model=MODEL, input=ids[-16:])
    assert vectors.usage.prompt_tokens == 16
    assert vectors.data[0].embedding == same.data[0].embedding

    with pytest.raises(openai.BadRequestError, match="select a smaller truncation size"):
        complete(default_server, prompt=long, extra_body={"truncate_prompt_tokens": 10**6})


def test_return_token_ids(default_server: Server, france: Greedy) -> None:
    """vLLM's return_token_ids through the SDK: the ids are the answer's (detokenized they
    are its text, the stop token last) and the prompt's are what /tokenize renders."""
    reply = chat(
        default_server, messages=FRANCE, temperature=0, extra_body={"return_token_ids": True}
    )
    ids = extra(reply.choices[0], "token_ids")
    assert len(ids) == reply.usage.completion_tokens
    text = httpx.post(
        default_server.url + "/detokenize", json={"model": MODEL, "tokens": ids[:-1]}, timeout=60
    ).json()["prompt"]
    assert text == reply.choices[0].message.content == france.text
    rendered = tokenize(default_server, model=MODEL, messages=FRANCE)["tokens"]
    assert extra(reply, "prompt_token_ids") == rendered

    stream = client(default_server).completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True},
        logprobs=1,
    )
    streamed: list[int] = []
    tokens: list[str] = []
    prompt_ids = None
    for chunk in stream:
        choice = chunk.choices[0]
        streamed += extra(choice, "token_ids") or []
        prompt_ids = prompt_ids or extra(choice, "prompt_token_ids")
        tokens += choice.logprobs.tokens if choice.logprobs else []
    assert len(streamed) == 6
    assert tokens == [f"token_id:{t}" for t in streamed]
    assert prompt_ids == tokenize(default_server, prompt=PROMPT)["tokens"]


def test_cache_salt_keeps_prefix_cache_hits_within_a_salt(default_server: Server) -> None:
    """vLLM's cache_salt on the real engine: a prompt cached under one salt is a miss
    under another (the prefix-cache hit counter does not move) and a hit under its own."""
    messages = [{"role": "user", "content": "Salted prompt: " + "tell me about owls. " * 12}]

    def hits_after(salt: str) -> float:
        reply = chat(
            default_server, messages=messages, max_tokens=1, extra_body={"cache_salt": salt}
        )
        assert reply.usage.prompt_tokens > 64
        time.sleep(0.5)  # the engine counts after it sent the last output
        return metric(default_server, "hearth:prefix_cache_hits_total")

    first = hits_after("tenant-a")
    assert hits_after("tenant-b") == first
    assert hits_after("tenant-a") >= first + 64

    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        chat(default_server, max_tokens=1, extra_body={"cache_salt": ""})


def test_allowed_token_ids_restrict_the_output(default_server: Server) -> None:
    """vLLM's allowed_token_ids on the real engine: every generated id is one of them
    (seen through return_token_ids), sampled or greedy."""
    allowed = [token_id(default_server, word) for word in (" yes", " no", " maybe")]
    for temperature in (0.0, 1.0):
        out = complete(
            default_server,
            prompt="Is the sky blue? Answer:",
            max_tokens=5,
            temperature=temperature,
            seed=4,
            extra_body={"allowed_token_ids": allowed, "return_token_ids": True},
        )
        ids = extra(out.choices[0], "token_ids")
        assert len(ids) == 5 and set(ids) <= set(allowed), ids


def _contains(ids: list[int], seq: list[int]) -> bool:
    return any(ids[i : i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))


def test_bad_words_are_never_generated(default_server: Server) -> None:
    """vLLM's bad_words on the real engine: the greedy answer's words, banned, no longer
    appear as their token sequences (bare or after a space), and the answer changes."""
    prompt = "The capital of France is"
    free = complete(
        default_server, prompt=prompt, max_tokens=12, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    words = free.choices[0].text.split()[:2]
    assert words, free.choices[0].text
    banned = [
        tokenize(default_server, prompt=form, add_special_tokens=False)["tokens"]
        for word in words
        for form in (word, " " + word)
    ]
    assert any(_contains(extra(free.choices[0], "token_ids"), seq) for seq in banned)
    for temperature in (0.0, 1.0):
        out = complete(
            default_server, prompt=prompt, max_tokens=12, temperature=temperature, seed=2,
            extra_body={"bad_words": words, "return_token_ids": True},
        )  # fmt: skip
        ids = extra(out.choices[0], "token_ids")
        assert not any(_contains(ids, seq) for seq in banned), (out.choices[0].text, words)
        if temperature == 0.0:
            assert out.choices[0].text != free.choices[0].text
    with pytest.raises(openai.BadRequestError, match="bad_words"):
        complete(default_server, prompt=prompt, max_tokens=1, extra_body={"bad_words": [""]})


def test_logprob_token_ids_report_the_named_tokens(default_server: Server) -> None:
    """Chat's logprob_token_ids on the real engine: each position's top_logprobs are the
    named tokens, in order; where the sampled token is one of them, the two logprobs
    agree, and the plain top_logprobs of the same greedy answer agree too."""
    names = [" yes", " no", "Yes", "No"]
    ids = [token_id(default_server, name) for name in names]
    question = [{"role": "user", "content": "Is Paris in France? Answer yes or no."}]
    named = chat(
        default_server, messages=question, max_tokens=3, temperature=0, logprobs=True,
        extra_body={"logprob_token_ids": ids},
    )  # fmt: skip
    plain = chat(
        default_server, messages=question, max_tokens=3, temperature=0, logprobs=True,
        top_logprobs=20,
    )  # fmt: skip
    # Two requests: the same sums where the default mode is batch-invariant (`gguf`); where
    # it is `gguf-bf16` (AMX, AVX512-BF16 hosts) the second one's prompt is partly a prefix
    # cache hit and its rest may take the other side of the bfloat16 threshold.
    from engine.backends import auto_gguf_mode

    across = 1e-5 if auto_gguf_mode() == "gguf" else 0.05
    for got, top in zip(named.choices[0].logprobs.content, plain.choices[0].logprobs.content,
                        strict=True):  # fmt: skip
        assert [t.token for t in got.top_logprobs] == [name for name in names]
        assert all(t.logprob <= 0.0 for t in got.top_logprobs)
        for t in got.top_logprobs:
            if t.token == got.token:
                assert t.logprob == pytest.approx(got.logprob, abs=1e-5)
            same = [u for u in top.top_logprobs if u.token == t.token]
            if same:
                assert t.logprob == pytest.approx(same[0].logprob, abs=across)
    with pytest.raises(openai.BadRequestError, match="logprob_token_ids"):
        chat(default_server, max_tokens=1, extra_body={"logprob_token_ids": ids})


def test_return_prompt_text_is_what_the_model_read(default_server: Server) -> None:
    out = chat(default_server, max_tokens=2, temperature=0, extra_body={"return_prompt_text": True})
    text = extra(out, "prompt_text")
    assert FRANCE[0]["content"] in text
    tokens = tokenize(default_server, prompt=text, add_special_tokens=False)["tokens"]
    assert len(tokens) == out.usage.prompt_tokens


def test_chat_batch_answers_each_conversation_as_alone(default_server: Server) -> None:
    """vLLM's /v1/chat/completions/batch: greedy answers equal each conversation's own
    /v1/chat/completions answer."""
    conversations = [FRANCE, CHINESE]
    r = httpx.post(
        default_server.v1 + "/chat/completions/batch",
        json={"model": MODEL, "messages": conversations, "max_tokens": 12, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    got = [c["message"]["content"] for c in r.json()["choices"]]
    alone = [
        chat(default_server, messages=m, max_tokens=12, temperature=0).choices[0].message.content
        for m in conversations
    ]
    assert got == alone


def test_generative_scoring_is_the_label_probability(default_server: Server) -> None:
    """vLLM's /generative_scoring on the real engine: the score is the first label's
    probability after query + item, renormalised over the labels: the same number as
    the probability of that label when /v1/completions may sample only the labels."""
    labels = [token_id(default_server, " yes"), token_id(default_server, " no")]
    query = "Question: is Paris in France? Answer:"
    r = httpx.post(
        default_server.url + "/generative_scoring",
        json={"model": MODEL, "query": query, "items": ["", " Think first."],
              "label_token_ids": labels},
        timeout=120,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    scores = [d["score"] for d in r.json()["data"]]
    assert all(0.0 < s < 1.0 for s in scores) and scores[0] != scores[1]
    out = complete(
        default_server, prompt=query, max_tokens=1, temperature=0, logprobs=2,
        extra_body={"allowed_token_ids": labels},
    )  # fmt: skip
    masked = out.choices[0].logprobs.top_logprobs[0]
    assert scores[0] == pytest.approx(math.exp(masked[" yes"]), rel=1e-4)
    raw = httpx.post(
        default_server.url + "/generative_scoring",
        json={"query": query, "items": [""], "label_token_ids": labels, "apply_softmax": False},
        timeout=120,
    ).json()["data"][0]["score"]
    assert 0.0 < raw < scores[0]


# -- ops routes ---------------------------------------------------------------------------------
def test_tokenize_detokenize_round_trip(default_server: Server, france: Greedy) -> None:
    text = "Hello 你好\uff0c世界 🌍🚀 world"
    out = tokenize(default_server, prompt=text, add_special_tokens=False, return_token_strs=True)
    assert out["count"] == len(out["tokens"]) == len(out["token_strs"]) > 5
    assert out["max_model_len"] == 2048
    r = httpx.post(default_server.url + "/detokenize", json={"tokens": out["tokens"]}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": text}
    assert tokenize(default_server, messages=FRANCE)["count"] == france.prompt_tokens


async def _load(server: Server) -> int:
    """/load over a fresh connection (each worker counts its own requests)."""
    async with httpx.AsyncClient(timeout=30) as fresh:
        return (await fresh.get(server.url + "/load")).json()["server_load"]


async def _streams_and_load(server: Server, n: int) -> tuple[list[int], list[int]]:
    """Open n long streams, read /load while they run, close them, then read /load until
    every worker says 0."""
    body = {
        "model": MODEL,
        "prompt": "Count from one to one thousand:",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    started = [asyncio.Event() for _ in range(n)]
    stop = asyncio.Event()

    async def one(i: int) -> None:
        async with (
            httpx.AsyncClient(timeout=300) as own,
            own.stream("POST", server.v1 + "/completions", json=body) as r,
        ):
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    started[i].set()
                if stop.is_set():
                    return  # leaving closes the connection: the server aborts the request

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    seen: list[int] = []
    try:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 240)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not seen or max(seen) < 1):
            seen.append(await _load(server))
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    after: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        after.append(await _load(server))
        if len(after) >= 10 and not any(after[-10:]):
            break
        await asyncio.sleep(0.1)
    return seen, after


def test_load_counts_in_flight_requests(default_server: Server) -> None:
    r = httpx.get(default_server.url + "/load", timeout=30)
    assert r.status_code == 200 and r.json()["server_load"] == 0
    seen, after = asyncio.run(_streams_and_load(default_server, 4))
    assert max(seen) >= 1, seen
    assert after[-10:] == [0] * 10, after
    # The workers forgot them, and the engine stopped them: nothing runs, no KV block held.
    assert wait_metric(default_server, "hearth:num_requests_running", 0) == 0
    assert wait_metric(default_server, "hearth:kv_cache_used_blocks", 0) == 0


def test_raw_stream_wire_format(default_server: Server) -> None:
    """What the SDK hides: every event is `data: <json>`, the last is `[DONE]`, the
    first chat chunk carries the role, and the finishing chunk carries `stop_reason`."""
    body = {"model": MODEL, "messages": FRANCE, "temperature": 0, "stream": True}
    r = httpx.post(default_server.v1 + "/chat/completions", json=body, timeout=300)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_data(r.content)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finishing = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert len(finishing) == 1
    assert finishing[0]["choices"][0]["finish_reason"] == "stop"
    assert "stop_reason" in finishing[0]["choices"][0]
    assert len({c["id"] for c in chunks}) == 1
