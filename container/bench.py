"""The client behind `hearth bench`: `vllm bench serve`'s random-dataset method, in-process.

DESIGN.md §10 states hearth's performance as a ratio to vLLM measured with one client on one
machine, so this module copies the method of `vllm bench serve --dataset-name random
--ignore-eos --request-rate inf --max-concurrency C` (anchors/bench-serve.sh) rather than
inventing one: random token-id prompts of exactly `input_len` tokens, `output_len` tokens
generated with EOS ignored, streamed from `/v1/completions`, all requests submitted at once
behind a semaphore of C. It needs no vLLM install, so it also runs where vLLM does not.

Per request (timed with `time.perf_counter`): TTFT is the time to the first chunk carrying
text, ITL every gap between successive text chunks (pooled over requests, like vLLM), E2E the
time to the last text chunk, TPOT `(E2E - TTFT) / (output tokens - 1)`. Output tokens come
from the final usage chunk, or the number of text chunks when a server sends no usage.
Throughputs divide by the wall time of the whole level. Failed requests are counted and left
out of every figure; a run never stops on them.

Everything here is usable from tests without the CLI: `run_benchmark` returns the result as a
JSON-ready dict, and the `format_*`/`render_svg`/`write_outputs` functions turn results into
the table, Markdown and SVG plot.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import json
import math
import random
import ssl
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

import httpx
import orjson

SCHEMA = "hearth-bench/1"
LATENCIES = ("ttft", "itl", "tpot", "e2e")
PERCENTILES = (50, 90, 99)
# Figures that add up over repeats; every other number is the median over repeats.
COUNT_KEYS = frozenset(
    {
        "num_prompts",
        "completed",
        "failed",
        "total_output_tokens",
        "total_input_tokens",
        "prompt_len_mismatch",
        "output_len_mismatch",
    }
)
# The random token ids stay away from both ends of the vocabulary, where the special and
# byte tokens live, as the brief for this method asks ([1000, vocab - 1000)).
TOKEN_ID_MARGIN = 1000

Log = Callable[[str], None]
Result = dict[str, Any]


def log_stderr(message: str) -> None:
    """Progress goes to stderr so stdout carries only the final table (pipe-friendly)."""
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class BenchConfig:
    """One sweep's parameters; frozen so a repeat cannot drift from the first run."""

    base_url: str
    model: str
    concurrencies: tuple[int, ...] = (1, 16)
    num_prompts: tuple[int, ...] = ()  # empty: `default_num_prompts` for each level
    input_len: int = 128
    output_len: int = 128
    seed: int = 0
    vocab_size: int = 49152
    api_key: str | None = None
    warmup: int = 1
    timeout_s: float = 600.0
    progress_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ValueError("concurrency levels must be >= 1")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("input and output lengths must be >= 1")
        if self.vocab_size <= 2 * TOKEN_ID_MARGIN:
            raise ValueError(f"vocab size must exceed {2 * TOKEN_ID_MARGIN}")
        resolve_num_prompts(self.concurrencies, self.num_prompts)  # raises on a bad pairing

    @property
    def levels(self) -> list[tuple[int, int]]:
        """(concurrency, number of prompts) in the order they run."""
        counts = resolve_num_prompts(self.concurrencies, self.num_prompts)
        return list(zip(self.concurrencies, counts, strict=True))

    def public(self) -> dict[str, Any]:
        """The parameters recorded in results.json (never the API key)."""
        return {
            "base_url": self.base_url,
            "model": self.model,
            "levels": [{"concurrency": c, "num_prompts": n} for c, n in self.levels],
            "input_len": self.input_len,
            "output_len": self.output_len,
            "seed": self.seed,
            "vocab_size": self.vocab_size,
            "warmup": self.warmup,
        }


def default_num_prompts(concurrency: int) -> int:
    """8 requests at c=1 and 4 per slot otherwise: the anchors' RUNS="1:8 16:64"."""
    return 8 if concurrency == 1 else 4 * concurrency


def resolve_num_prompts(concurrencies: Sequence[int], given: Sequence[int]) -> list[int]:
    """No value: the defaults; one value: for every level; else one value per level."""
    if not given:
        return [default_num_prompts(c) for c in concurrencies]
    if min(given) < 1:
        raise ValueError("--num-prompts values must be >= 1")
    if len(given) == 1:
        return [given[0]] * len(concurrencies)
    if len(given) == len(concurrencies):
        return list(given)
    raise ValueError(
        f"--num-prompts takes one value or one per concurrency level ({len(concurrencies)}), "
        f"got {len(given)}"
    )


def random_prompts(count: int, input_len: int, vocab_size: int, seed_key: str) -> list[list[int]]:
    """`count` prompts of exactly `input_len` token ids, uniform in [1000, vocab - 1000).

    Sending ids (not text) fixes the prompt length exactly, with no tokenizer on the client.
    The seed key differs per level and repeat so that no prompt repeats within a run: a
    server with prefix caching would otherwise serve a repeat from cache and look faster.
    Same key, same prompts, so two servers benchmarked with one seed see identical inputs.
    """
    rng = random.Random(seed_key)
    low, high = TOKEN_ID_MARGIN, vocab_size - TOKEN_ID_MARGIN
    return [[rng.randrange(low, high) for _ in range(input_len)] for _ in range(count)]


def completion_payload(config: BenchConfig, prompt: list[int]) -> bytes:
    """The request `vllm bench serve --backend openai --ignore-eos --temperature 0` sends."""
    return orjson.dumps(
        {
            "model": config.model,
            "prompt": prompt,
            "max_tokens": config.output_len,
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


# --------------------------------------------------------------------------- one request


@dataclass
class RequestResult:
    """What one streamed completion measured; times in seconds from sending the request."""

    ok: bool = False
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    error: str | None = None


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
    concurrency: int,
    prompts: list[list[int]],
    failures: FailureLog,
    log: Log = log_stderr,
) -> Result:
    """Submit every prompt at once (request rate inf) behind a semaphore of `concurrency`."""
    semaphore = asyncio.Semaphore(concurrency)
    progress = LevelProgress(total=len(prompts))

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> RequestResult:
        async with semaphore:
            result = await send_request(client, completion_payload(config, prompt))
        progress.done += 1
        progress.failed += not result.ok
        failures.note(result)
        return result

    async with make_client(config, concurrency) as client:
        ticker = asyncio.create_task(
            _tick(progress, f"c={concurrency}", config.progress_interval_s, log)
        )
        start = time.perf_counter()
        try:
            results = await asyncio.gather(*(one(client, p) for p in prompts))
        finally:
            duration = time.perf_counter() - start
            ticker.cancel()
    return summarize_level(concurrency, results, duration, config)


# --------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default, which vLLM uses); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _latency_samples(ok: list[RequestResult]) -> dict[str, list[float]]:
    """Per-figure samples in ms; ITL pools every gap of every request, as vLLM does."""
    return {
        "ttft": [r.ttft_s * 1e3 for r in ok],
        "itl": [gap * 1e3 for r in ok for gap in r.itl_s],
        "tpot": [
            (r.e2e_s - r.ttft_s) * 1e3 / (r.output_tokens - 1) for r in ok if r.output_tokens > 1
        ],
        "e2e": [r.e2e_s * 1e3 for r in ok],
    }


def summarize_level(
    concurrency: int, results: list[RequestResult], duration_s: float, config: BenchConfig
) -> Result:
    """The level's figures; failed requests only count in `failed`."""
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_tokens or config.input_len for r in ok)
    duration_s = max(duration_s, 1e-9)
    level: Result = {
        "concurrency": concurrency,
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        # Sanity checks: a server that re-tokenizes the ids or stops at EOS measures less work.
        "prompt_len_mismatch": sum(
            r.prompt_tokens is not None and r.prompt_tokens != config.input_len for r in ok
        ),
        "output_len_mismatch": sum(r.output_tokens != config.output_len for r in ok),
        "first_error": next((r.error for r in results if r.error), None),
    }
    for name, samples in _latency_samples(ok).items():
        level[f"{name}_mean_ms"] = statistics.fmean(samples) if samples else None
        for q in PERCENTILES:
            level[f"{name}_p{q}_ms"] = percentile(samples, q)
    return level


def merge_repeats(runs: list[list[Result]]) -> list[Result]:
    """One level list from N sweeps: counts add up, every other figure is the median."""
    merged = []
    for levels in zip(*runs, strict=True):
        level: Result = {"repeats": len(levels)}
        for key, first in levels[0].items():
            values = [lv[key] for lv in levels if lv.get(key) is not None]
            if key == "concurrency":
                level[key] = first
            elif key in COUNT_KEYS:
                level[key] = sum(values)
            elif values and all(isinstance(v, int | float) for v in values):
                level[key] = statistics.median(values)
            else:
                level[key] = values[0] if values else None
        merged.append(level)
    return merged


def level_line(level: Result) -> str:
    """The one-line summary printed when a level finishes."""
    ttft = _fmt(level.get("ttft_p50_ms"))
    itl = _fmt(level.get("itl_p50_ms"))
    return (
        f"c={level['concurrency']}: {level['completed']}/{level['num_prompts']} ok in "
        f"{level['duration_s']:.1f} s, {level['output_throughput']:.1f} out tok/s, "
        f"TTFT p50 {ttft} ms, ITL p50 {itl} ms"
    )


def level_warnings(level: Result, config: BenchConfig) -> list[str]:
    """Say when the server did less work than asked, which would flatter its figures."""
    warnings = []
    if level.get("prompt_len_mismatch"):
        warnings.append(
            f"{level['prompt_len_mismatch']} response(s) reported prompt_tokens != "
            f"{config.input_len} (token-id prompts not taken as sent?)"
        )
    if level.get("output_len_mismatch"):
        warnings.append(
            f"{level['output_len_mismatch']} response(s) had output tokens != "
            f"{config.output_len} (ignore_eos not honoured, or usage missing with multi-token chunks?)"
        )
    return warnings


# --------------------------------------------------------------------------- whole run


async def _warm_up(config: BenchConfig, failures: FailureLog, log: Log) -> None:
    """vLLM's initial test request: first-request costs (compilation, caches) stay out of
    the figures, and a misconfiguration shows before a long sweep starts."""
    prompts = random_prompts(config.warmup, config.input_len, config.vocab_size, f"{config.seed}:w")
    log(f"warm-up: {config.warmup} request(s) at c=1")
    async with make_client(config, 1) as client:
        for prompt in prompts:
            result = await send_request(client, completion_payload(config, prompt))
            failures.note(result)


async def _run_async(config: BenchConfig, repeat: int, log: Log) -> list[list[Result]]:
    failures = FailureLog(log)
    if config.warmup > 0:
        await _warm_up(config, failures, log)
    runs = []
    for index in range(repeat):
        if repeat > 1:
            log(f"repeat {index + 1}/{repeat}")
        levels = []
        for concurrency, count in config.levels:
            key = f"{config.seed}:{index}:{concurrency}"
            prompts = random_prompts(count, config.input_len, config.vocab_size, key)
            log(
                f"c={concurrency}: {count} requests, {config.input_len} in / "
                f"{config.output_len} out"
            )
            level = await run_level(config, concurrency, prompts, failures, log)
            log("  " + level_line(level))
            for warning in level_warnings(level, config):
                log(f"  warning: {warning}")
            levels.append(level)
        runs.append(levels)
    return runs


def run_benchmark(
    config: BenchConfig, label: str, repeat: int = 1, log: Log = log_stderr
) -> Result:
    """Run the sweep `repeat` times; the result is what results.json holds."""
    if repeat < 1:
        raise ValueError("repeat must be >= 1")
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    runs = asyncio.run(_run_async(config, repeat, log))
    result: Result = {
        "schema": SCHEMA,
        "label": label,
        "created": started,
        "config": config.public(),
        "repeat": repeat,
        "levels": merge_repeats(runs),
    }
    if repeat > 1:
        result["runs"] = runs
    return result


def total_failed(result: Result) -> int:
    """Failed requests over every level (and repeat) of a result."""
    return sum(level.get("failed", 0) for level in result["levels"])


# --------------------------------------------------------------------------- loading results


def load_results(path: str | Path) -> Result:
    """A results.json from an earlier `hearth bench`, or a `vllm bench serve --save-result`
    file (one level each; same-label files are merged by `merge_results`)."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and isinstance(data.get("levels"), list):
        return {k: v for k, v in data.items() if k not in ("compare", "runs")}
    if isinstance(data, dict) and "output_throughput" in data:
        return _from_vllm(data, Path(path))
    raise ValueError(f"{path}: neither a hearth bench results.json nor a vLLM result file")


_VLLM_KEYS = {"ttft": "ttft", "itl": "itl", "tpot": "tpot", "e2e": "e2el"}


def _from_vllm(data: dict[str, Any], path: Path) -> Result:
    """Map vLLM's `median_ttft_ms`-style keys onto ours."""
    level: Result = {
        "concurrency": data.get("max_concurrency") or 0,
        "num_prompts": data.get("num_prompts", data.get("completed", 0)),
        "completed": data.get("completed", 0),
        "failed": data.get("failed", 0),
        "duration_s": data.get("duration", 0.0),
        "total_output_tokens": data.get("total_output_tokens", 0),
        "request_throughput": data.get("request_throughput"),
        "output_throughput": data.get("output_throughput"),
        "total_token_throughput": data.get("total_token_throughput"),
    }
    for ours, theirs in _VLLM_KEYS.items():
        level[f"{ours}_mean_ms"] = data.get(f"mean_{theirs}_ms")
        level[f"{ours}_p50_ms"] = data.get(f"median_{theirs}_ms")
        for q in (90, 99):
            level[f"{ours}_p{q}_ms"] = data.get(f"p{q}_{theirs}_ms")
    label = data.get("label") or data.get("backend") or path.stem
    return {"schema": "vllm-bench-serve", "label": str(label), "levels": [level]}


def merge_results(results: list[Result]) -> list[Result]:
    """Join results with one label (e.g. one vLLM file per concurrency) into one entry."""
    by_label: dict[str, Result] = {}
    for result in results:
        entry = by_label.setdefault(result["label"], {**result, "levels": []})
        entry["levels"] = entry["levels"] + list(result["levels"])
    for entry in by_label.values():
        entry["levels"].sort(key=lambda level: level["concurrency"])
    return list(by_label.values())


# --------------------------------------------------------------------------- reporting

# (header, key, format) of the stdout and Markdown tables; latencies in ms.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("out tok/s", "output_throughput", "{:.1f}"),
    ("req/s", "request_throughput", "{:.2f}"),
    ("TTFT p50", "ttft_p50_ms", "{:.1f}"),
    ("TTFT p99", "ttft_p99_ms", "{:.1f}"),
    ("ITL p50", "itl_p50_ms", "{:.1f}"),
    ("ITL p99", "itl_p99_ms", "{:.1f}"),
    ("TPOT p50", "tpot_p50_ms", "{:.1f}"),
    ("E2E p50", "e2e_p50_ms", "{:.1f}"),
)


def _fmt(value: Any, spec: str = "{:.1f}") -> str:
    return "-" if value is None else spec.format(value)


def table_rows(results: Sequence[Result]) -> list[list[str]]:
    """Header and one row per (concurrency, label): labels side by side per level."""
    rows = [["label", "conc", "ok/n", *(header for header, _, _ in COLUMNS)]]
    entries = [
        (lv["concurrency"], i, r["label"], lv) for i, r in enumerate(results) for lv in r["levels"]
    ]
    for concurrency, _, label, level in sorted(entries, key=lambda e: (e[0], e[1])):
        ok_n = f"{level.get('completed', 0)}/{level.get('num_prompts', 0)}"
        cells = [_fmt(level.get(key), spec) for _, key, spec in COLUMNS]
        rows.append([label, str(concurrency), ok_n, *cells])
    return rows


def format_table(results: Sequence[Result]) -> str:
    """Aligned plain-text table for stdout; latencies (TTFT, ITL, TPOT, E2E) in ms."""
    rows = table_rows(results)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    return "\n".join([*lines, "(latencies in ms)"])


def compare_ratios(ours: Result, other: Result) -> list[Result]:
    """Per shared concurrency: our output tok/s and TTFT p50 over the other's."""
    theirs = {level["concurrency"]: level for level in other["levels"]}
    ratios = []
    for level in ours["levels"]:
        base = theirs.get(level["concurrency"])
        if base is None:
            continue
        ratios.append(
            {
                "concurrency": level["concurrency"],
                "output_throughput": _ratio(
                    level.get("output_throughput"), base.get("output_throughput")
                ),
                "ttft_p50": _ratio(level.get("ttft_p50_ms"), base.get("ttft_p50_ms")),
            }
        )
    return ratios


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def format_ratios(ours: Result, other: Result) -> str:
    """Lines like `c=16: out tok/s hearth/vllm 1.23x, TTFT p50 0.80x`."""
    ratios = compare_ratios(ours, other)
    name = f"{ours['label']}/{other['label']}"
    if not ratios:
        return f"{name}: no concurrency level in common"
    return "\n".join(
        f"c={r['concurrency']}: out tok/s {name} {_fmt(r['output_throughput'], '{:.2f}')}x, "
        f"TTFT p50 {name} {_fmt(r['ttft_p50'], '{:.2f}')}x"
        for r in ratios
    )


def format_markdown(result: Result, compare: Sequence[Result] = ()) -> str:
    """results.md: parameters, the table, and the ratios against each compared run."""
    cfg = result.get("config", {})
    rows = table_rows([result, *compare])
    lines = [
        f"# hearth bench: {result['label']}",
        "",
        f"- server: {cfg.get('base_url')}, model `{cfg.get('model')}`",
        f"- random prompts: {cfg.get('input_len')} in / {cfg.get('output_len')} out, "
        f"EOS ignored, seed {cfg.get('seed')}, request rate inf",
        f"- run {result.get('created')}, repeat {result.get('repeat', 1)} (median of repeats)",
        "- latencies in ms; output tok/s = output tokens / wall time of the level",
        "",
        "| " + " | ".join(rows[0]) + " |",
        "|" + "|".join("---" for _ in rows[0]) + "|",
        *("| " + " | ".join(row) + " |" for row in rows[1:]),
    ]
    for other in compare:
        lines += ["", f"Ratios {result['label']} / {other['label']}:", ""]
        lines += [f"- {line}" for line in format_ratios(result, other).splitlines()]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- SVG plot

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#b07aa1")
PANEL_W, PANEL_H, MARGIN_L, MARGIN_T, MARGIN_B = 400, 300, 60, 70, 45


def _axis(value: float, max_ticks: int = 5) -> tuple[float, int]:
    """Tick step (1, 2, 2.5 or 5 x 10^k) and tick count so the axis ends just above `value`."""
    if value <= 0:
        return 1.0, 1
    rough = value / max_ticks
    exponent = 10 ** math.floor(math.log10(rough))
    step = next(m * exponent for m in (1, 2, 2.5, 5, 10) if m * exponent >= rough)
    return step, max(1, math.ceil(value / step - 1e-9))


def _panel(results: Sequence[Result], key: str, title: str, x0: float) -> list[str]:
    """One grouped bar chart: a group per concurrency, a bar per label."""
    concs = sorted({lv["concurrency"] for r in results for lv in r["levels"]})
    values = {
        (i, lv["concurrency"]): lv.get(key) for i, r in enumerate(results) for lv in r["levels"]
    }
    step, ticks = _axis(max((v for v in values.values() if v), default=0.0))
    top = step * ticks
    plot_w, plot_h = PANEL_W - MARGIN_L - 10, PANEL_H - MARGIN_T - MARGIN_B
    left, base = x0 + MARGIN_L, MARGIN_T + plot_h
    out = [f'<text x="{x0 + PANEL_W / 2}" y="{MARGIN_T - 30}" class="title">{escape(title)}</text>']
    for tick in range(ticks + 1):
        y = base - plot_h * tick / ticks
        out.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" class="grid"/>'
        )
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" class="ytick">{step * tick:g}</text>')
    group_w = plot_w / max(len(concs), 1)
    bar_w = group_w * 0.8 / max(len(results), 1)
    for g, conc in enumerate(concs):
        gx = left + g * group_w + group_w * 0.1
        out.append(
            f'<text x="{gx + group_w * 0.4:.1f}" y="{base + 18}" class="xtick">c={conc}</text>'
        )
        for i in range(len(results)):
            value = values.get((i, conc))
            if value is None:
                continue
            h = plot_h * value / top
            x = gx + i * bar_w
            out.append(
                f'<rect x="{x:.1f}" y="{base - h:.1f}" width="{bar_w - 2:.1f}" '
                f'height="{h:.1f}" fill="{PALETTE[i % len(PALETTE)]}"/>'
            )
            out.append(
                f'<text x="{x + bar_w / 2 - 1:.1f}" y="{base - h - 4:.1f}" '
                f'class="value">{value:.3g}</text>'
            )
    out.append(f'<line x1="{left}" y1="{base}" x2="{left + plot_w}" y2="{base}" class="axis"/>')
    return out


def render_svg(results: Sequence[Result]) -> str:
    """results.svg: output tok/s and TTFT p50 per concurrency, a colour per label.

    Hand-written SVG because matplotlib is not a dependency; bars rather than lines since
    the concurrency levels are few and categorical.
    """
    width, height = 2 * PANEL_W + 20, PANEL_H
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
        "<style>.title{font-size:14px;font-weight:bold;text-anchor:middle}"
        ".ytick{font-size:10px;text-anchor:end}.xtick{font-size:11px;text-anchor:middle}"
        ".value{font-size:9px;text-anchor:middle}.legend{font-size:11px}"
        ".grid{stroke:#ddd}.axis{stroke:#333}</style>",
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    parts += _panel(results, "output_throughput", "output tokens/s (higher is better)", 0)
    parts += _panel(results, "ttft_p50_ms", "TTFT p50, ms (lower is better)", PANEL_W + 20)
    for i, result in enumerate(results):
        x = MARGIN_L + i * 150
        parts.append(
            f'<rect x="{x}" y="8" width="12" height="12" fill="{PALETTE[i % len(PALETTE)]}"/>'
        )
        parts.append(
            f'<text x="{x + 16}" y="18" class="legend">{escape(str(result["label"]))}</text>'
        )
    cfg = results[0].get("config", {}) if results else {}
    if cfg:
        caption = f"{cfg.get('model')}: {cfg.get('input_len')} in / {cfg.get('output_len')} out"
        parts.append(f'<text x="{width - 10}" y="18" class="ytick">{escape(caption)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def write_outputs(result: Result, compare: Sequence[Result], out_dir: str | Path) -> list[Path]:
    """Write results.json (ours, with the compared runs under "compare"), .md and .svg."""
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    record = {**result, "compare": list(compare)} if compare else result
    files = {
        "results.json": json.dumps(record, indent=2) + "\n",
        "results.md": format_markdown(result, compare),
        "results.svg": render_svg([result, *compare]),
    }
    paths = []
    for name, text in files.items():
        path = directory / name
        path.write_text(text)
        paths.append(path)
    return paths
