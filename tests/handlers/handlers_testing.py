"""Helpers of the handler tests: a tiny real model directory, SSE parsing, error checks.

The model directory is built offline in a few ms: a byte-level BPE tokenizer trained on a handful of sentences (with emoji and CJK, so
multi-byte characters split across tokens happen), ChatML special tokens and template,
and a config.json. Nothing is downloaded; nothing depends on a real checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import falcon.testing
import orjson
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.config import ModelInfo
from engine.tokenizer import Tokenizer as HearthTokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_ID = 2
MAX_MODEL_LEN = 256
EMBEDDING_SIZE = 8
"""The fake engine's embedding length (its `ModelInfo.pooling.hidden_size`)."""

CORPUS = [
    "The capital of France is Paris.",
    "Hello world! How are you today?",
    "Stop here. STOP now. The end is near, the END.",
    "Emoji are fun 😀🎉 and so is 你好世界 in Chinese.",
    "Numbers like 12345 and words like banana, apple, cherry.",
    "You are a helpful assistant. Answer briefly and politely.",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_model(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "unk_token": "<|endoftext|>",
                "pad_token": "<|im_end|>",
            }
        )
    )
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (directory / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "max_position_embeddings": MAX_MODEL_LEN,
                "vocab_size": tokenizer.get_vocab_size(),
                "eos_token_id": EOS_ID,
            }
        )
    )
    return directory


def long_context_info(model_dir: Path, tokenizer: HearthTokenizer) -> ModelInfo:
    """The engine info of tests whose prompts carry tool definitions: those make long
    prompts for the stand-in tokenizer, so the context (and KV pool) is larger."""
    return ModelInfo(
        model_dir=str(model_dir),
        max_model_len=4096,
        vocab_size=tokenizer.vocab_size,
        eos_token_ids=[EOS_ID],
        num_kv_blocks=512,
        block_size=16,
    )


def encode(tokenizer: HearthTokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def sse_events(body: bytes) -> list[Any]:
    """The data payloads of an SSE body, JSON-decoded except `[DONE]`; comments dropped."""
    events: list[Any] = []
    for block in body.decode().split("\n\n"):
        data = [line[6:] for line in block.split("\n") if line.startswith("data: ")]
        if not data:
            continue
        payload = "\n".join(data)
        events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


def sse_named_events(body: bytes) -> list[tuple[str | None, Any]]:
    """(event name, JSON data) of each event of an SSE body (Anthropic's streams name
    every event); comments dropped."""
    events: list[tuple[str | None, Any]] = []
    for block in body.decode().split("\n\n"):
        lines = block.split("\n")
        names = [line[7:] for line in lines if line.startswith("event: ")]
        data = [line[6:] for line in lines if line.startswith("data: ")]
        if data:
            events.append((names[0] if names else None, orjson.loads("\n".join(data))))
    return events


ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    503: "overloaded_error",
}


def assert_anthropic_error(result: Any, status: int) -> dict[str, Any]:
    """Status and Anthropic's error shape `{"type": "error", "error": {"type", "message"}}`
    with the type Anthropic names for the status (a falcon.testing Result or a
    StreamResult)."""
    code = result.status_code if hasattr(result, "status_code") else result.status
    body = result.json
    assert code == status, (code, body)
    assert body.keys() == {"type", "error"} and body["type"] == "error", body
    error = body["error"]
    assert error.keys() == {"type", "message"}, error
    assert error["type"] == ANTHROPIC_ERROR_TYPES[status], error
    assert isinstance(error["message"], str) and error["message"]
    return error


def assert_openai_error(result: Any, status: int, param: str | None = ...) -> dict[str, Any]:
    """Status, the OpenAI error shape, and (when given) the param naming the field."""
    assert result.status_code == status, (result.status_code, result.text)
    body = result.json
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == status
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"].endswith("Error")
    if param is not ...:
        assert error["param"] == param, error
    return error


class StayConnected:
    """An ASGI app as falcon.testing's `simulate_*` clients should see it.

    Those clients mark the connection closed as soon as the request is sent (they assume
    an app never watches for disconnects), so the production app, which cancels a
    request whose client is gone (`CancelOnDisconnect`), would answer nothing. This
    shim turns that artificial `http.disconnect` into a client that waits for its
    answer. Disconnect tests use `call_asgi`, which disconnects when a test says so.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def connected_receive() -> Any:
            message = await receive()
            if scope["type"] == "http" and message["type"] == "http.disconnect":
                await asyncio.Event().wait()  # until the app is done and cancels us
            return message

        await self.app(scope, connected_receive, send)


def connected_client(app: Any) -> falcon.testing.TestClient:
    """falcon.testing.TestClient over the app, for requests whose client stays."""
    return falcon.testing.TestClient(StayConnected(app))


@dataclass
class StreamResult:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def events(self) -> list[Any]:
        return sse_events(self.body)

    @property
    def json(self) -> Any:
        return orjson.loads(self.body)


async def call_asgi(
    app: Any,
    path: str,
    body: Any = None,
    *,
    method: str = "POST",
    headers: dict[str, str] | None = None,
    disconnect_when: Callable[[bytes], bool] | None = None,
    timeout: float = 5.0,
    content_length: bool = True,
) -> StreamResult:
    """One request straight through the ASGI app, reading the response as it streams.

    falcon.testing's plain simulate_* calls mark the client disconnected as soon as
    the request is sent, which ends an SSE response after its first event; this keeps
    the client connected until the response ends or `disconnect_when(body so far)`.
    """
    if isinstance(app, StayConnected):
        app = app.app  # this client disconnects only when the test says so
    raw = body if isinstance(body, bytes) else (b"" if body is None else orjson.dumps(body))
    all_headers = {"content-type": "application/json"} if body is not None else {}
    all_headers.update(headers or {})
    path, _, query = path.partition("?")
    scope = falcon.testing.create_scope(
        path=path,
        query_string=query or None,
        method=method,
        headers=all_headers,
        content_length=len(raw) if content_length else None,
    )
    emitter = falcon.testing.ASGIRequestEventEmitter(
        raw, disconnect_at=time.time() + 3600, chunk_size=65536
    )
    collector = falcon.testing.ASGIResponseEventCollector()
    task = asyncio.create_task(app(scope, emitter, collector))
    deadline = time.monotonic() + timeout
    disconnected = False
    while not task.done():
        if time.monotonic() > deadline:
            task.cancel()
            raise TimeoutError(f"{method} {path} did not finish in {timeout}s")
        if (
            not disconnected
            and disconnect_when is not None
            and disconnect_when(b"".join(collector.body_chunks))
        ):
            emitter.disconnect()
            disconnected = True
        await asyncio.sleep(0.001)
    await task
    headers_out = {
        (k.decode() if isinstance(k, bytes) else k).lower(): (
            v.decode() if isinstance(v, bytes) else v
        )
        for k, v in collector.headers
    }
    return StreamResult(collector.status, headers_out, b"".join(collector.body_chunks))
