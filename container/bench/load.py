"""The load generator: `vllm bench serve`'s random-dataset method, in-process.

DESIGN.md §10 states hearth's performance as a ratio to vLLM measured with one client on one
machine, so this copies the method of `vllm bench serve --dataset-name random --ignore-eos
--request-rate inf --max-concurrency C` (anchors/bench-serve.sh) rather than inventing one:
random token-id prompts of exactly `input_len` tokens, `output_len` tokens generated with EOS
ignored, streamed from `/v1/completions`, all of a level's requests submitted at once behind
a semaphore of C. It needs no vLLM install, so it also runs where vLLM does not. Every
request is timed with `time.perf_counter`; `stats` turns the timings into figures.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import random
import ssl
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from container.bench.config import TOKEN_ID_MARGIN, BenchConfig, LevelSpec
from container.bench.report import level_line
from container.bench.stats import (
    RequestResult,
    Result,
    level_warnings,
    merge_repeats,
    summarize_level,
    sweep_verdicts,
)

SCHEMA = "hearth-bench/2"

Log = Callable[[str], None]


def log_stderr(message: str) -> None:
    """Progress goes to stderr so stdout carries only the final table (pipe-friendly)."""
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- requests


def random_prompts(count: int, input_len: int, vocab_size: int, seed_key: str) -> list[list[int]]:
    """`count` prompts of exactly `input_len` token ids, uniform in [1000, vocab - 1000).

    Sending ids (not text) fixes the prompt length exactly, with no tokenizer on the client.
    The seed key differs per server pass, sweep, level and repeat so that no prompt repeats
    within a run: a server with prefix caching would otherwise serve a repeat from cache and
    look faster. Same key, same prompts, so a run is reproducible from its seed.
    """
    rng = random.Random(seed_key)
    low, high = TOKEN_ID_MARGIN, vocab_size - TOKEN_ID_MARGIN
    return [[rng.randrange(low, high) for _ in range(input_len)] for _ in range(count)]


def completion_payload(model: str, output_len: int, prompt: list[int]) -> bytes:
    """The request `vllm bench serve --backend openai --ignore-eos --temperature 0` sends."""
    return orjson.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": output_len,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


def auth_headers(api_key: str | None) -> dict[str, str]:
    """Bearer auth as the OpenAI clients send it; none when no key is set."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """Built once: httpx would load the CA bundle again for every client (~0.1 s each)."""
    return httpx.create_ssl_context()


def make_client(config: BenchConfig, connections: int) -> httpx.AsyncClient:
    """An HTTP/1.1 client with a connection per concurrent request.

    `trust_env=False`: a proxy from the environment must never sit between the benchmark and
    a loopback server. One client per level: idle keep-alive connections from the previous
    level may be closed by the server (gunicorn keepalive is 5 s) right as they are reused.
    """
    return httpx.AsyncClient(
        base_url=config.base_url.rstrip("/"),
        headers={"Content-Type": "application/json", **auth_headers(config.api_key)},
        timeout=httpx.Timeout(config.timeout_s),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        http1=True,
        http2=False,
        verify=_ssl_context(),
        trust_env=False,
    )


class StreamError(Exception):
    """The server reported an error inside an otherwise successful (200) stream."""


async def send_request(client: httpx.AsyncClient, body: bytes) -> RequestResult:
    """Stream one completion and time it; any failure becomes `error`, never an exception."""
    result = RequestResult()
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", content=body) as response:
            if response.status_code != 200:
                excerpt = (await response.aread())[:300].decode("utf-8", "replace")
                result.error = f"HTTP {response.status_code}: {excerpt.strip()}"
                return result
            await _read_stream(response, start, result)
    except (httpx.HTTPError, StreamError, ValueError, OSError) as exc:
        result.ok = False
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return result


async def _read_stream(response: httpx.Response, start: float, result: RequestResult) -> None:
    """Parse the SSE stream, stamping each text chunk as its line arrives."""
    last = start
    text_chunks = 0
    usage_tokens: int | None = None
    async for line in response.aiter_lines():
        if not line.startswith("data:"):  # blank separators, ": keep-alive" comments
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            # No `break`: reading on to the end of the body lets httpx reuse the connection
            # (an unread body makes it close the socket, and the next request reconnect).
            continue
        now = time.perf_counter()
        event = orjson.loads(data)
        if not isinstance(event, dict):
            raise StreamError(f"unexpected event {data[:100]!r}")
        if event.get("error") and not event.get("choices"):
            raise StreamError(str(event["error"])[:300])
        if _chunk_text(event):
            if text_chunks == 0:
                result.ttft_s = now - start
            else:
                result.itl_s.append(now - last)
            last = now
            text_chunks += 1
        usage = event.get("usage")
        if isinstance(usage, dict):
            usage_tokens = usage.get("completion_tokens", usage_tokens)
            result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
    if text_chunks == 0:
        raise StreamError("the stream ended without any text chunk")
    result.ok = True
    result.e2e_s = last - start  # vLLM's latency: up to the last text chunk
    result.output_tokens = usage_tokens if isinstance(usage_tokens, int) else text_chunks


def _chunk_text(event: dict[str, Any]) -> str:
    """The text of a completion chunk; '' for usage-only chunks and empty deltas."""
    choices = event.get("choices")
    if not choices or not isinstance(choices[0], dict):
        return ""
    text = choices[0].get("text")
    return text if isinstance(text, str) else ""


# --------------------------------------------------------------------------- one level


class FailureLog:
    """Prints the first failure of the run once, so a dead server is one line, not hundreds."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.first: str | None = None

    def note(self, result: RequestResult) -> None:
        if result.error and self.first is None:
            self.first = result.error
            self.log(f"  first failed request: {result.error}")


@dataclass
class LevelProgress:
    """Live counters for the progress line of a long level."""

    total: int
    done: int = 0
    failed: int = 0
    start: float = field(default_factory=time.perf_counter)


async def _tick(progress: LevelProgress, label: str, interval_s: float, log: Log) -> None:
    """Every `interval_s`, one line with the count so far (c=64 on two cores takes minutes)."""
    while True:
        await asyncio.sleep(interval_s)
        elapsed = time.perf_counter() - progress.start
        log(
            f"  {label}: {progress.done}/{progress.total} done, {progress.failed} failed, "
            f"{elapsed:.0f} s"
        )


async def run_level(
    config: BenchConfig,
    spec: LevelSpec,
    prompts: list[list[int]],
    failures: FailureLog,
    log: Log = log_stderr,
) -> Result:
    """Submit every prompt at once (request rate inf) behind a semaphore of the concurrency."""
    semaphore = asyncio.Semaphore(spec.concurrency)
    progress = LevelProgress(total=len(prompts))

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> RequestResult:
        async with semaphore:
            body = completion_payload(config.model, spec.output_len, prompt)
            result = await send_request(client, body)
        progress.done += 1
        progress.failed += not result.ok
        failures.note(result)
        return result

    async with make_client(config, spec.concurrency) as client:
        label = f"c={spec.concurrency} in={spec.input_len}"
        ticker = asyncio.create_task(_tick(progress, label, config.progress_interval_s, log))
        start = time.perf_counter()
        try:
            results = await asyncio.gather(*(one(client, p) for p in prompts))
        finally:
            duration = time.perf_counter() - start
            ticker.cancel()
    return summarize_level(spec, results, duration)


# --------------------------------------------------------------------------- one pass


async def _warm_up(config: BenchConfig, pass_key: str, failures: FailureLog, log: Log) -> None:
    """vLLM's initial test request: first-request costs (compilation, caches) stay out of
    the figures, and a misconfiguration shows before a long sweep starts."""
    first = config.levels[0]
    key = f"{config.seed}:{pass_key}:w"
    prompts = random_prompts(config.warmup, first.input_len, config.vocab_size, key)
    log(f"warm-up: {config.warmup} request(s) at c=1")
    async with make_client(config, 1) as client:
        for prompt in prompts:
            body = completion_payload(config.model, first.output_len, prompt)
            failures.note(await send_request(client, body))


async def _run_async(
    config: BenchConfig, repeat: int, pass_key: str, log: Log
) -> list[list[Result]]:
    failures = FailureLog(log)
    if config.warmup > 0:
        await _warm_up(config, pass_key, failures, log)
    runs = []
    for index in range(repeat):
        if repeat > 1:
            log(f"repeat {index + 1}/{repeat}")
        levels = []
        for spec in config.levels:
            key = (
                f"{config.seed}:{pass_key}:{index}:{spec.sweep}:{spec.concurrency}:{spec.input_len}"
            )
            prompts = random_prompts(spec.num_prompts, spec.input_len, config.vocab_size, key)
            log(
                f"{spec.sweep} sweep, c={spec.concurrency}: {spec.num_prompts} requests, "
                f"{spec.input_len} in / {spec.output_len} out"
            )
            level = await run_level(config, spec, prompts, failures, log)
            log("  " + level_line(level))
            for warning in level_warnings(level):
                log(f"  warning: {warning}")
            levels.append(level)
        runs.append(levels)
    return runs


def run_benchmark(
    config: BenchConfig,
    label: str,
    repeat: int = 1,
    log: Log = log_stderr,
    pass_key: str = "0",
) -> Result:
    """Run every level `repeat` times against one server; the result is one results.json entry.

    `pass_key` names this server's pass within a session (hearth, vLLM, hearth again): each
    pass draws its own prompts, as anchors/sandwich.sh does with a seed per sweep.
    """
    if repeat < 1:
        raise ValueError("repeat must be >= 1")
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    runs = asyncio.run(_run_async(config, repeat, pass_key, log))
    result: Result = {
        "schema": SCHEMA,
        "label": label,
        "created": started,
        "config": config.public(),
        "repeat": repeat,
        "levels": merge_repeats(runs),
    }
    # A sweep with any failed request does not count as a whole, as in vLLM's client.
    result["sweeps"] = sweep_verdicts(result["levels"])
    if repeat > 1:
        result["runs"] = runs
    return result
