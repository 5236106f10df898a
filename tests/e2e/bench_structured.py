"""Benchmark (not a test): the cost of structured outputs.

1. Grammar compile time for the acceptance schemas, cold (first compile) and cached, in
   this process against the default model's tokenizer (p50 / p99).
2. Output tokens/s at concurrency 16 against a real server: unconstrained requests vs
   requests constrained by a JSON schema, both exactly MAX_TOKENS long (the schema
   forces a long string, EOS is ignored for the unconstrained ones).

    nice -n 15 .venv/bin/python -m tests.e2e.bench_structured [--url http://127.0.0.1:8000]

Without --url it starts its own `hearth serve` with the default model. Figures from a
shared machine only mean something as ratios measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import openai

MAX_TOKENS = 64
CONCURRENCY = 16
ROUNDS = 2
LONG_TEXT = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 1000}},
    "required": ["text"],
}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def bench_compile() -> None:
    from openai.lib._pydantic import to_strict_json_schema

    from engine.model_resolver import resolve_model_dir
    from engine.sampling_params import StructuredOutputSpec
    from engine.structured.manager import StructuredOutputManager
    from tests.e2e.structured_schemas import SCHEMAS

    model_dir = resolve_model_dir(None, os.environ.get("HEARTH_CACHE_DIR") or None)
    manager = StructuredOutputManager(model_dir, 49152, [2])
    manager.compile(StructuredOutputSpec(kind="json_object"))  # loads the vocabulary
    cold: list[float] = []
    cached: list[float] = []
    for model, _ in SCHEMAS:
        spec = StructuredOutputSpec(kind="json", value=json.dumps(to_strict_json_schema(model)))
        start = time.perf_counter()
        manager.compile(spec)
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        manager.compile(spec)
        cached.append(time.perf_counter() - start)
    print(f"compile, {len(SCHEMAS)} schemas (ms):")
    for name, values in (("cold", cold), ("cached", cached)):
        ms = [v * 1e3 for v in values]
        print(f"  {name:6s} p50 {statistics.median(ms):8.3f}  p99 {_pct(ms, 0.99):8.3f}")


async def _round(sdk: openai.AsyncOpenAI, constrained: bool) -> tuple[int, float]:
    async def one(i: int) -> int:
        extra = {"structured_outputs": {"json": LONG_TEXT}} if constrained else {"ignore_eos": True}
        reply = await sdk.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": f"Write a long story, part {i}."}],
            max_tokens=MAX_TOKENS,
            temperature=0.8,
            seed=i,
            extra_body=extra,
        )
        return reply.usage.completion_tokens

    start = time.perf_counter()
    tokens = await asyncio.gather(*[one(i) for i in range(CONCURRENCY)])
    return sum(tokens), time.perf_counter() - start


async def bench_throughput(url: str) -> None:
    sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=600, max_retries=0)
    await _round(sdk, True)  # warm-up: compiles the grammar once, as a cache would
    rates: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(ROUNDS):
        for constrained in (False, True):  # interleaved: load drifts on a shared host
            tokens, seconds = await _round(sdk, constrained)
            rates[constrained].append(tokens / seconds)
    plain, json_ = statistics.mean(rates[False]), statistics.mean(rates[True])
    print(f"c={CONCURRENCY}, {MAX_TOKENS} output tokens each, {ROUNDS} rounds:")
    print(f"  unconstrained {plain:8.1f} tok/s")
    print(f"  json schema   {json_:8.1f} tok/s  ({100 * json_ / plain:.0f} % of unconstrained)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server; default: start one")
    args = parser.parse_args()
    bench_compile()
    if args.url:
        asyncio.run(bench_throughput(args.url))
        return
    from tests.e2e.server import start_server

    server = start_server(Path(tempfile.mkdtemp()), "--max-model-len", "2048")
    try:
        asyncio.run(bench_throughput(server.url))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
