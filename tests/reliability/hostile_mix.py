"""Latency of ordinary clients while hostile ones send the inputs of issue 17 (a script,
not a test: it prints figures and asserts nothing about time).

Starts a real `hearth serve` on a free loopback port, then measures, first on a quiet
server and then under the hostile mix:

* an unconstrained client: sequential chat completions (greedy, a few tokens);
* `/ping`, polled every 100 ms;

while the hostile mix runs, from its own threads:

* schemas: distinct 900-deep nested schemas as text (`guided_json` strings) and distinct
  schemas within every cap that xgrammar takes long over (a string of maxLength 10^9),
  which go to the compile children and are stopped at the compile time limit;
* prompts: a 6 MB `/v1/completions` prompt, a 6 MB `/tokenize` prompt, and a
  200,000-message chat body.

    PYTHONPATH=$PWD python tests/reliability/hostile_mix.py [--samples 40] [--url URL]

Every loop is bounded (samples, a wall-clock cap per phase); everything stays on loopback.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.e2e.server import Server, start_server  # noqa: E402

CHAT = {
    "model": "smollm2",
    "messages": [{"role": "user", "content": "Name a colour."}],
    "max_tokens": 8,
    "temperature": 0,
}
PHASE_CAP_S = 600.0


def nested_schema_text(levels: int, tag: int) -> str:
    inner = f'{{"type":"string","title":"t{tag}"}}'
    return '{"type":"array","items":' * levels + inner + "}" * levels


def slow_schema(tag: int) -> dict:
    return {"type": "string", "maxLength": 10**9, "title": f"slow-{tag}"}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


class Pinger(threading.Thread):
    def __init__(self, url: str, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.samples, self.failures = url, stop, [], 0

    def run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self.stop.is_set():
                start = time.monotonic()
                try:
                    ok = client.get(self.url + "/ping").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.samples.append(time.monotonic() - start)
                self.failures += not ok
                self.stop.wait(0.1)


def unconstrained(url: str, samples: int) -> tuple[list[float], Counter]:
    latencies: list[float] = []
    statuses: Counter = Counter()
    deadline = time.monotonic() + PHASE_CAP_S
    with httpx.Client(timeout=120) as client:
        for _ in range(samples):
            if time.monotonic() > deadline:
                break
            start = time.monotonic()
            try:
                status = client.post(url + "/v1/chat/completions", json=CHAT).status_code
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            latencies.append(time.monotonic() - start)
            statuses[status] += 1
    return latencies, statuses


class Hostile(threading.Thread):
    """One hostile client: sends its bodies in turn until told to stop."""

    def __init__(self, name: str, url: str, stop: threading.Event, bodies) -> None:
        super().__init__(daemon=True)
        self.name_, self.url, self.stop, self.bodies = name, url, stop, bodies
        self.statuses: Counter = Counter()
        self.latencies: list[float] = []

    def run(self) -> None:
        deadline = time.monotonic() + PHASE_CAP_S
        with httpx.Client(timeout=120) as client:
            for path, body in self.bodies():
                if self.stop.is_set() or time.monotonic() > deadline:
                    return
                start = time.monotonic()
                try:
                    status = client.post(self.url + path, content=body).status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                self.latencies.append(time.monotonic() - start)
                self.statuses[status] += 1


def schema_bodies():
    """30 distinct 900-deep schemas as text, then distinct slow-but-legal schemas."""
    for i in range(30):
        body = {**CHAT, "guided_json": nested_schema_text(900, i)}
        yield "/v1/chat/completions", json.dumps(body).encode()
    for i in range(10_000):
        body = {**CHAT, "guided_json": slow_schema(i)}
        yield "/v1/chat/completions", json.dumps(body).encode()


def prompt_bodies():
    big = "hello world " * 500_000  # 6,000,000 characters
    many = {"model": "smollm2", "messages": [{"role": "user", "content": "x"}] * 200_000}
    payloads = [
        ("/v1/completions", json.dumps({"model": "smollm2", "prompt": big, "max_tokens": 1})),
        ("/tokenize", json.dumps({"model": "smollm2", "prompt": big})),
        ("/v1/chat/completions", json.dumps(many)),
    ]
    # Compact JSON: 200,000 messages stay under the 6 MiB body cap (else a 413).
    payloads[2] = ("/v1/chat/completions", json.dumps(many, separators=(",", ":")))
    payloads = [(path, body.encode()) for path, body in payloads]
    for i in range(10_000):
        yield payloads[i % len(payloads)]


def phase(url: str, samples: int, hostile: bool) -> dict:
    stop = threading.Event()
    pinger = Pinger(url, stop)
    attackers = []
    if hostile:
        attackers = [
            Hostile("schemas", url, stop, schema_bodies),
            Hostile("prompts", url, stop, prompt_bodies),
        ]
    for thread in [pinger, *attackers]:
        thread.start()
    if hostile:
        time.sleep(2.0)  # let the mix get going before measuring
    latencies, statuses = unconstrained(url, samples)
    stop.set()
    for thread in [pinger, *attackers]:
        thread.join(150)
    return {
        "chat": latencies,
        "chat_statuses": statuses,
        "ping": pinger.samples,
        "ping_failures": pinger.failures,
        "attackers": {
            a.name_: (a.statuses, statistics.median(a.latencies) if a.latencies else None)
            for a in attackers
        },
    }


def report(name: str, result: dict) -> None:
    chat, ping = result["chat"], result["ping"]
    print(
        f"{name:8s} chat  n={len(chat):3d} p50 {percentile(chat, 50) * 1000:7.1f} ms  "
        f"p99 {percentile(chat, 99) * 1000:7.1f} ms  statuses {dict(result['chat_statuses'])}"
    )
    print(
        f"{name:8s} /ping n={len(ping):3d} p50 {percentile(ping, 50) * 1000:7.1f} ms  "
        f"p99 {percentile(ping, 99) * 1000:7.1f} ms  max {max(ping, default=0) * 1000:7.1f} ms"
        f"  not-200 {result['ping_failures']}"
    )
    for attacker, (statuses, median) in result["attackers"].items():
        shown = "-" if median is None else f"{median * 1000:.0f} ms"
        print(f"{name:8s} hostile {attacker}: statuses {dict(statuses)}, median answer {shown}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=40, help="chat requests per phase")
    parser.add_argument("--url", help="a running server (default: start one on loopback)")
    args = parser.parse_args()
    server: Server | None = None
    url = args.url
    if url is None:
        logs = Path(tempfile.mkdtemp(prefix="hostile-mix-"))
        server = start_server(
            logs, "--workers", "2", "--max-model-len", "2048", "--kv-cache-memory", "256MiB"
        )
        url = server.url
        print(f"server on {url}, log {server.log_path}")
    try:
        httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=120)  # warm up
        quiet = phase(url, args.samples, hostile=False)
        loud = phase(url, args.samples, hostile=True)
    finally:
        if server is not None:
            server.stop()
    report("quiet", quiet)
    report("hostile", loud)
    q50, h50 = percentile(quiet["chat"], 50), percentile(loud["chat"], 50)
    print(
        f"chat p50 hostile/quiet: {h50 / q50:.2f}x; /ping max under the mix: "
        f"{max(loud['ping'], default=0) * 1000:.0f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
