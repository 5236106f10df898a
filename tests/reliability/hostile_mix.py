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

The hostile clients run in a child process of their own (`--attack`), so their GIL is not
the measuring client's; HOSTILE_ONLY=schemas or HOSTILE_ONLY=prompts runs one of them.
HOSTILE_NICE=19 runs that process at nice 19: a model of attackers on other machines (on a
2-vCPU host their own CPU, building and sending 6 MB bodies, is otherwise taken from the
server and the measuring client alike); quote which.

Every loop is bounded (samples, a wall-clock cap per phase); everything stays on loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
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


def attack(url: str, stop_file: Path, out_file: Path) -> int:
    """The hostile clients, in a process of their own (`--attack`): building and sending
    6 MB bodies holds this interpreter's GIL for tens of milliseconds at a time, and in
    the measuring process that stalled the pinger and the chat client themselves (a /ping
    p50 of ~700 ms that was the client's, not the server's). Runs until `stop_file`
    exists, then writes each attacker's statuses and median answer time to `out_file`."""
    niceness = int(os.environ.get("HOSTILE_NICE", "0"))
    if niceness:
        os.nice(niceness)
    stop = threading.Event()
    attackers = [
        Hostile("schemas", url, stop, schema_bodies),
        Hostile("prompts", url, stop, prompt_bodies),
    ]
    only = os.environ.get("HOSTILE_ONLY")  # "schemas" or "prompts": one attacker, to split the cost
    attackers = [a for a in attackers if not only or a.name_ == only]
    for thread in attackers:
        thread.start()
    deadline = time.monotonic() + PHASE_CAP_S
    while not stop_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    for thread in attackers:
        thread.join(150)
    out_file.write_text(
        json.dumps(
            {
                a.name_: [
                    {str(k): v for k, v in a.statuses.items()},
                    statistics.median(a.latencies) if a.latencies else None,
                ]
                for a in attackers
            }
        )
    )
    return 0


def phase(url: str, samples: int, hostile: bool) -> dict:
    stop = threading.Event()
    pinger = Pinger(url, stop)
    pinger.start()
    attackers: dict = {}
    child = None
    work = Path(tempfile.mkdtemp(prefix="hostile-attack-"))
    if hostile:
        cmd = [sys.executable, __file__, "--attack", url, str(work / "stop"), str(work / "out")]
        child = subprocess.Popen(cmd)
        time.sleep(2.0)  # let the mix get going before measuring
    latencies, statuses = unconstrained(url, samples)
    stop.set()
    pinger.join(150)
    if child is not None:
        (work / "stop").touch()
        child.wait(300)
        attackers = {k: (v[0], v[1]) for k, v in json.loads((work / "out").read_text()).items()}
    return {
        "chat": latencies,
        "chat_statuses": statuses,
        "ping": pinger.samples,
        "ping_failures": pinger.failures,
        "attackers": attackers,
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
    parser.add_argument(
        "--attack", nargs=3, metavar=("URL", "STOP_FILE", "OUT_FILE"), help=argparse.SUPPRESS
    )  # the hostile clients' own process
    args = parser.parse_args()
    if args.attack:
        return attack(args.attack[0], Path(args.attack[1]), Path(args.attack[2]))
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
