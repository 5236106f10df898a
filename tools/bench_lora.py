"""The LoRA overhead of a whole server: output tok/s at concurrency C with every request
on the base model, then with the same requests spread round-robin over N adapters.

    python -m tools.bench_lora [--model DIR] [--concurrency 16] [--requests 32]
        [--max-tokens 32] [--adapters 4] [--rank 16] [-- extra hearth serve flags]

Starts `hearth serve --enable-lora --max-loras N` with N random rank-R adapters on every
projection (tests/lora_adapters.py `write_random_adapter`), warms both paths up, runs
each phase once and prints one line per phase plus the ratio. Every request ignores EOS,
so both phases generate the same number of tokens. On CPU the adapter steps run op by op
(the CPU step program holds the base kernels only), which is part of what is measured.
Figures on a shared host are only comparable within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import tempfile
import time
from pathlib import Path

import openai

from engine.model_resolver import resolve_model_dir
from tests.e2e.server import start_server
from tests.lora_adapters import write_random_adapter

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


async def _phase(
    base_url: str, models: list[str], requests: int, concurrency: int, max_tokens: int
) -> tuple[float, int]:
    api = openai.AsyncOpenAI(base_url=base_url, api_key="unused", timeout=600, max_retries=0)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> int:
        async with gate:
            done = await api.completions.create(
                model=models[i % len(models)], prompt=PROMPT, max_tokens=max_tokens,
                temperature=0.0, extra_body={"ignore_eos": True},
            )  # fmt: skip
            return done.usage.completion_tokens

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(requests))))
    return time.perf_counter() - start, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="HF model directory (default: the embedded one)"
    )
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("serve_flags", nargs="*", help="extra `hearth serve` flags (after --)")
    args = parser.parse_args(argv)
    # `timeout` and Ctrl-C alike must reach the `finally` that stops the server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    model_dir = args.model or resolve_model_dir(None, None)
    tmp = Path(tempfile.mkdtemp(prefix="hearth-bench-lora-"))
    names = [f"bench{i}" for i in range(args.adapters)]
    modules = [
        f"{n}={write_random_adapter(model_dir, tmp / n, seed=i, r=args.rank)}"
        for i, n in enumerate(names)
    ]
    model_flag = [args.model] if args.model else []
    server = start_server(
        tmp, *model_flag, "--served-model-name", "base", "--enable-lora",
        "--max-loras", str(args.adapters), "--max-lora-rank", str(args.rank),
        "--max-num-seqs", str(max(args.concurrency, 16)), *args.serve_flags,
        "--lora-modules", *modules,
    )  # fmt: skip
    try:
        url = server.v1
        warm = min(args.concurrency, 4)
        asyncio.run(_phase(url, ["base", *names], warm * 2, warm, 4))
        results = {}
        for label, models in (("all base", ["base"]), (f"{args.adapters} adapters", names)):
            seconds, tokens = asyncio.run(
                _phase(url, models, args.requests, args.concurrency, args.max_tokens)
            )
            results[label] = tokens / seconds
            line = (
                f"{label:>12}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} "
                f"tok/s (c={args.concurrency}, {args.requests} requests, rank {args.rank})"
            )
            print(line, flush=True)  # per phase: a slow host may cut the run after one
        base, lora = results.values()
        print(f"LoRA throughput / base throughput: {lora / base:.2f}")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
