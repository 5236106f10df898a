"""The official `openai` SDK against the app (in-process, over httpx's ASGI transport):
our wire format must parse into its types, and our errors must raise its exceptions."""

from __future__ import annotations

import httpx
import openai
import pytest
from fake_engine import FakeEngine, Script
from handlers_testing import EOS_ID, encode

from engine.tokenizer import Tokenizer
from handlers.config import ServerConfig

pytestmark = pytest.mark.anyio

KEY = "sk-sdk"


@pytest.fixture
def sdk(make_client) -> openai.AsyncOpenAI:
    client = make_client(api_key_digests=ServerConfig.with_api_keys([KEY]).api_key_digests)
    transport = httpx.ASGITransport(app=client.app)
    return openai.AsyncOpenAI(
        api_key=KEY,
        base_url="http://hearth.test/v1",
        http_client=httpx.AsyncClient(transport=transport, base_url="http://hearth.test"),
        max_retries=0,
    )


@pytest.fixture
def scripted(engine: FakeEngine, tokenizer: Tokenizer) -> str:
    text = "Paris 😀 你好"
    engine.script = Script(token_ids=[*encode(tokenizer, text), EOS_ID])
    return text


async def test_chat_create_and_stream(sdk: openai.AsyncOpenAI, scripted: str):
    messages = [{"role": "user", "content": "capital?"}]
    response = await sdk.chat.completions.create(
        model="tiny", messages=messages, logprobs=True, top_logprobs=1
    )
    assert response.choices[0].message.content == scripted
    assert response.choices[0].finish_reason == "stop"
    assert response.usage is not None and response.usage.completion_tokens > 0
    assert response.choices[0].logprobs is not None
    stream = await sdk.chat.completions.create(
        model="tiny",
        messages=messages,
        stream=True,
        n=2,
        stream_options={"include_usage": True},
    )
    texts = {0: "", 1: ""}
    usage = None
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
        usage = chunk.usage or usage
    assert texts == {0: scripted, 1: scripted}
    assert usage is not None and usage.prompt_tokens > 0


async def test_completions_and_models(sdk: openai.AsyncOpenAI, scripted: str):
    completion = await sdk.completions.create(model="tiny", prompt="x", max_tokens=50, logprobs=2)
    assert completion.choices[0].text == scripted
    assert completion.choices[0].logprobs is not None
    stream = await sdk.completions.create(model="tiny", prompt="x", max_tokens=50, stream=True)
    assert "".join([c.choices[0].text async for c in stream]) == scripted
    models = await sdk.models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny-alias"]


async def test_errors_raise_the_sdk_exceptions(sdk: openai.AsyncOpenAI, engine: FakeEngine):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as bad:
        await sdk.chat.completions.create(model="tiny", messages=messages, temperature=3)
    assert bad.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):
        await sdk.chat.completions.create(model="gpt-x", messages=messages)
    wrong = sdk.with_options(api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        await wrong.models.list()
    engine.refuse_after = 0
    with pytest.raises(openai.InternalServerError) as unavailable:
        await sdk.chat.completions.create(model="tiny", messages=messages, stream=True)
    assert unavailable.value.status_code == 503


async def test_error_mid_stream_raises_in_the_sdk(sdk: openai.AsyncOpenAI, engine: FakeEngine):
    engine.script = Script(token_ids=[5, 6, 7], fail_at_step=1)
    stream = await sdk.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    with pytest.raises(openai.APIError):
        async for _ in stream:
            pass
