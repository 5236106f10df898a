"""TTFT of a multi-turn conversation with and without a SageMaker stateful session, under
other load, on a real server (gunicorn + 2 API workers + the engine, the default model).

    python -m tools.bench_sessions [--turns 10] [--kv-cache-memory 32MiB] [--load 1]

The KV cache is kept small on purpose, so that the other load (random prompts that share
nothing) evicts whatever is not protected. Without a session, a conversation's earlier
turns compete with that load for the cache and each new turn often prefills the whole
history again; with a session, the engine pins the conversation's blocks (evicted last)
and each turn prefills only what is new. Prints, per mode, the median and p90 TTFT of
turns 2..N and the prompt tokens served from the cache. One run on a shared host: only
the ratio within the run means anything.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from tests.e2e.server import start_server

SESSION = "X-Amzn-SageMaker-Session-Id"
WORDS = [
    "river",
    "stone",
    "cloud",
    "amber",
    "forest",
    "copper",
    "lantern",
    "meadow",
    "harbor",
    "violet",
    "candle",
    "orbit",
]


def _stream_turn(
    client: httpx.Client, messages: list[dict[str, str]], session_id: str | None
) -> tuple[float, str, int]:
    """(TTFT s, reply text, cached prompt tokens) of one streamed chat turn."""
    body = {
        "messages": messages,
        "max_tokens": 4,  # TTFT is the figure; a short reply keeps the run brief
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {SESSION: session_id} if session_id else {}
    start = time.perf_counter()
    ttft = None
    text, cached = "", 0
    with client.stream("POST", "/invocations", json=body, headers=headers) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {}).get("content")
                if delta:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text += delta
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return (ttft if ttft is not None else time.perf_counter() - start), text, cached


def _other_load(url: str, stop: threading.Event, seed: int) -> None:
    """Unrelated requests back to back: long random prompts that share no prefix."""
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=300) as client:
        while not stop.is_set():
            # ~220 tokens: two streams and the conversation fit the cache together, so what
            # the load evicts is the cache's free blocks, not blocks anyone is using.
            prompt = " ".join(rng.choice(WORDS) + str(rng.randrange(10_000)) for _ in range(50))
            client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})


def _conversation(url: str, turns: int, use_session: bool, seed: int) -> list[tuple[float, int]]:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=300) as client:
        session_id = None
        if use_session:
            opened = client.post("/invocations", json={"requestType": "NEW_SESSION"})
            session_id = opened.headers["X-Amzn-SageMaker-New-Session-Id"].split(";")[0]
        history = [{"role": "system", "content": " ".join(rng.choice(WORDS) for _ in range(40))}]
        results = []
        for turn in range(turns):
            question = f"Turn {turn}: say something about " + " ".join(rng.sample(WORDS, 6))
            history.append({"role": "user", "content": question})
            ttft, reply, cached = _stream_turn(client, history, session_id)
            history.append({"role": "assistant", "content": reply})
            results.append((ttft, cached))
            mode = "session" if session_id else "no session"
            print(
                f"  {mode} turn {turn + 1}: TTFT {ttft * 1000:.0f} ms, cached {cached}", flush=True
            )
        if session_id:
            client.post(
                "/invocations", json={"requestType": "CLOSE"}, headers={SESSION: session_id}
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--load", type=int, default=1, help="concurrent streams of other load")
    parser.add_argument("--kv-cache-memory", default="32MiB")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="bench-sessions-"))
    server = start_server(
        logs,
        "--workers", "2",
        "--max-model-len", "1024",
        "--kv-cache-memory", args.kv_cache_memory,
        "--enable-stateful-sessions",
        "--enable-prompt-tokens-details",
        "--engine-heartbeat-timeout", "300",  # a loaded shared host has slow steps
        "--disable-log-requests",
    )  # fmt: skip
    try:
        stop = threading.Event()
        load = [
            threading.Thread(target=_other_load, args=(server.url, stop, i), daemon=True)
            for i in range(args.load)
        ]
        for thread in load:
            thread.start()
        time.sleep(2)
        figures = {}
        # Different words (seeds), the same shape: the second conversation must not hit
        # the first one's blocks.
        for seed, (mode, use_session) in enumerate(
            (("without session", False), ("with session", True))
        ):
            figures[mode] = _conversation(server.url, args.turns, use_session, seed=7 + seed)
        stop.set()
        for thread in load:
            thread.join(60)
    finally:
        server.stop()
    print(f"{args.turns}-turn conversation, {args.load} streams of other load, "
          f"KV cache {args.kv_cache_memory}; turns 2..{args.turns}:")  # fmt: skip
    for mode, results in figures.items():
        later = results[1:]
        ttfts = sorted(t for t, _ in later)
        p90 = ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]
        cached = sum(c for _, c in later)
        print(
            f"  {mode:16s} TTFT median {statistics.median(ttfts) * 1000:7.0f} ms, "
            f"p90 {p90 * 1000:7.0f} ms, cached prompt tokens {cached}"
        )


if __name__ == "__main__":
    main()
