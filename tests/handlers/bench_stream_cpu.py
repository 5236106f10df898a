"""Micro-benchmark: the API worker's CPU time per streamed token (prints µs/token).

Not a test (nothing is asserted; pytest does not collect it). It drives the production
Falcon app (`create_app`) straight through ASGI with concurrent streaming chat requests,
over a paced in-process engine that speaks the real `EngineClient` contract: it answers
`AddRequest` with an `Admission` and pushes one `OutputBatch` per step through
`EngineClient._dispatch`, as the ZeroMQ reader does. The tokenizer is the tiny real one
of the handler tests, so detokenization, chunk encoding and SSE framing are all counted.

The engine steps every `--step-ms` (like a real engine, the consumer keeps up, so each
token becomes one chunk); CPU time (`time.process_time`) is measured, not wall time, so
the idle time between steps does not count. The emulated engine's own work is included
(a few µs per step, the same before and after any change of the serving path).

    nice -n 15 .venv/bin/python tests/handlers/bench_stream_cpu.py
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import falcon.testing
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from handlers_testing import CORPUS, EOS_ID, MAX_MODEL_LEN, build_tiny_model

from engine.client import EngineClient
from engine.config import ModelInfo
from engine.messages import AbortRequest, AddRequest, Admission, OutputBatch, RequestOutput
from engine.tokenizer import Tokenizer
from handlers.config import ServerConfig
from handlers.http.app import create_app
from handlers.serving.stats import NullStatsSink


class PacedEngine(EngineClient):
    """One token per live request every `step_s`, delivered as one batch per step."""

    def __init__(self, info: ModelInfo, token_ids: list[int], step_s: float) -> None:
        super().__init__()
        self._set_ready(info)
        self._token_ids = token_ids
        self._step_s = step_s
        self._live: dict[str, list[int]] = {}  # request id -> [tokens left, tokens sent]
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._steps())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _send(self, message: Any) -> None:
        loop = asyncio.get_running_loop()
        if isinstance(message, AddRequest):
            self._live[message.request_id] = [message.params.max_tokens, 0]
            loop.call_soon(self._dispatch, Admission(request_id=message.request_id, accepted=True))
            self._wake.set()
        elif isinstance(message, AbortRequest):
            for request_id in message.request_ids:
                self._live.pop(request_id, None)

    async def _steps(self) -> None:
        while True:
            if not self._live:
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(self._step_s)
            outputs = []
            for request_id, state in list(self._live.items()):
                left, sent = state
                token = self._token_ids[sent % len(self._token_ids)]
                state[0], state[1] = left - 1, sent + 1
                finish = "length" if left <= 1 else None
                if finish is not None:
                    del self._live[request_id]
                outputs.append(
                    RequestOutput(
                        request_id=request_id,
                        new_token_ids=[token],
                        finish_reason=finish,
                        num_prompt_tokens=10 if sent == 0 else 0,
                    )
                )
            if outputs:
                self._dispatch(OutputBatch(outputs))


async def one_stream(app: Any, body: bytes) -> tuple[int, int]:
    """One streaming request through ASGI: (data events, [DONE] seen)."""
    scope = falcon.testing.create_scope(
        path="/v1/chat/completions",
        method="POST",
        headers={"content-type": "application/json"},
        content_length=len(body),
    )
    done = asyncio.get_running_loop().create_future()
    sent_body = False
    events = 0
    finished = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.shield(done)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal events, finished
        if message["type"] == "http.response.body":
            chunk = message.get("body", b"")
            events += chunk.count(b"data: ")
            finished += chunk.count(b"data: [DONE]")
            if not message.get("more_body", False) and not done.done():
                done.set_result(None)

    await app(scope, receive, send)
    return events, finished


async def run(args: argparse.Namespace, model_dir: Path) -> list[float]:
    tokenizer = Tokenizer(model_dir)
    token_ids = [t for text in CORPUS for t in tokenizer.encode(text, add_special_tokens=False)]
    info = ModelInfo(
        model_dir=str(model_dir),
        max_model_len=MAX_MODEL_LEN * 4,
        vocab_size=tokenizer.vocab_size,
        eos_token_ids=[EOS_ID],
        num_kv_blocks=64,
        block_size=16,
    )
    engine = PacedEngine(info, token_ids, args.step_ms / 1000)
    config = ServerConfig(model_dir=str(model_dir), served_model_names=("tiny",))
    app = create_app(config, engine, tokenizer, stats=NullStatsSink())
    await engine.start()
    body = orjson.dumps(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": args.tokens,
            "stream": True,
        }
    )
    results = []
    for round_index in range(args.rounds + 1):
        cpu = time.process_time()
        outcomes = await asyncio.gather(*(one_stream(app, body) for _ in range(args.concurrency)))
        cpu = time.process_time() - cpu
        tokens = args.concurrency * args.tokens
        events = sum(e for e, _ in outcomes)
        assert all(f == 1 for _, f in outcomes), "a stream did not end with [DONE]"
        per_token = cpu / tokens * 1e6
        label = "warm-up" if round_index == 0 else f"round {round_index}"
        print(
            f"{label:>8}: {per_token:7.1f} µs/token  "
            f"({tokens} tokens, {events} data events, {cpu * 1000:.0f} ms CPU)"
        )
        if round_index:
            results.append(per_token)
    await engine.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--step-ms", type=float, default=4.0, help="engine step interval")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny")
        results = asyncio.run(run(args, model_dir))
    print(
        f"worker CPU per streamed token: median {statistics.median(results):.1f} µs "
        f"(c={args.concurrency}, {args.tokens} tokens/stream, {args.rounds} rounds)"
    )


if __name__ == "__main__":
    main()
