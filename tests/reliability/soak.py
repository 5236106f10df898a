"""Soak: many mixed requests against one server, a share of clients disconnecting at
random points, then checks that nothing leaked (issue 8). Not part of `make test`:
run it with `make soak` (or `python tests/reliability/soak.py --help`).

Kinds: chat and completion, streamed or not, n=1 or 2, with and without stop strings,
and TGI through /invocations. All greedy, so every request that was not cut must equal
the first complete answer to the same request. Every minute (and at the start and the
end) it samples the server's processes: RSS and open file descriptors per process,
and the engine's running/waiting/KV figures.

Exit status: 0 when no KV block, running or waiting request, or /load remains, and no
non-cut request failed or differed; 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
    "The capital of France is",
    "List three colours:",
    "Once upon a time",
    "Write a haiku about rain.",
    "What is 2 + 2?",
    "Name a large animal.",
]


@dataclass
class Totals:
    sent: int = 0
    ok: int = 0
    cut: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    mismatches: int = 0
    failures: list[str] = field(default_factory=list)


def build_request(rng: random.Random) -> tuple[str, str, dict[str, Any], bool]:
    """(kind, path, body, stream)."""
    prompt = rng.choice(PROMPTS)
    max_tokens = rng.choice([4, 8, 16])
    stream = rng.random() < 0.5
    kind = rng.choice(["chat", "completion", "completion-n2", "stop", "tgi"])
    if kind == "tgi":
        body = {"inputs": prompt, "parameters": {"max_new_tokens": max_tokens}, "stream": stream}
        return kind, "/invocations", body, stream
    body: dict[str, Any] = {"model": "smollm2", "temperature": 0, "max_tokens": max_tokens}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
        if kind == "completion-n2":
            body["n"] = 2
        if kind == "stop":
            body["stop"] = [" the", "\n"]
    body["stream"] = stream
    return kind, path, body, stream


def answer_of(path: str, stream: bool, raw: bytes) -> str:
    """What the client got, in a form comparable between identical requests."""
    if not stream:
        data = json.loads(raw)
        if isinstance(data, list):  # TGI: [{"generated_text": ...}]
            return json.dumps([[0, data[0]["generated_text"]]])
        # An empty completion is "" (not None), as the streamed form rebuilds it.
        texts = [
            c["text"] if "text" in c else c["message"]["content"] or "" for c in data["choices"]
        ]
        return json.dumps(sorted(zip([c["index"] for c in data["choices"]], texts, strict=True)))
    pieces: dict[int, str] = {}
    for line in raw.decode().splitlines():
        if not line.startswith("data:") or line.strip() == "data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        if "error" in chunk:
            raise RuntimeError(f"error event: {chunk['error']}")
        if "token" in chunk:  # TGI
            pieces[0] = pieces.get(0, "") + chunk["token"]["text"]
            continue
        for c in chunk.get("choices", []):
            delta = c.get("text") or (c.get("delta") or {}).get("content") or ""
            pieces[c["index"]] = pieces.get(c["index"], "") + delta
    return json.dumps(sorted(pieces.items()))


async def one(
    client: httpx.AsyncClient,
    rng: random.Random,
    args: argparse.Namespace,
    totals: Totals,
    answers: dict[str, str],
) -> None:
    kind, path, body, stream = build_request(rng)
    cut = rng.random() < args.disconnect_rate
    totals.sent += 1
    try:
        if stream:
            async with client.stream("POST", path, json=body) as response:
                chunks = []
                stop_after = rng.randint(0, 3) if cut else None
                async for chunk in response.aiter_raw():
                    chunks.append(chunk)
                    if stop_after is not None and len(chunks) > stop_after:
                        totals.cut += 1
                        return  # leaving the block closes the connection mid-stream
                status, raw = response.status_code, b"".join(chunks)
        else:
            request = client.post(path, json=body)
            if cut:
                try:
                    await asyncio.wait_for(request, rng.uniform(0.0, 1.0))
                except TimeoutError:
                    totals.cut += 1
                    return
                totals.cut += 1  # finished before the client gave up: still counted as cut
                return
            response = await request
            status, raw = response.status_code, response.content
    except httpx.HTTPError as exc:
        totals.statuses[type(exc).__name__] += 1
        totals.failures.append(f"{kind}: {exc!r}")
        return
    totals.statuses[str(status)] += 1
    if status != 200:
        if status != 503:  # 503 is a clean refusal under load
            totals.failures.append(f"{kind}: {status} {raw[:200]!r}")
        return
    try:
        got = answer_of(path, stream, raw)
    except Exception as exc:  # anything unparsable is a failure to report
        totals.failures.append(f"{kind}: {exc!r}")
        return
    totals.ok += 1
    # Streamed and buffered answers of one body must agree, so the key ignores "stream".
    same = json.dumps([path, {**body, "stream": None}], sort_keys=True)
    first = answers.setdefault(same, got)
    if got != first:
        totals.mismatches += 1
        totals.failures.append(
            f"{kind}: differs from the first answer to the same request "
            f"(stream={stream}): {got[:160]!r} vs first {first[:160]!r}"
        )


# -- the server's side ---------------------------------------------------------------------
def process_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def process_figures(root: int | None) -> dict[str, tuple[int, int]]:
    """name -> (RSS MiB, open fds) of every process of the server (summed per role)."""
    if root is None:
        return {}
    figures: dict[str, list[int]] = {}
    for pid in process_tree(root):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            rss = next(
                int(line.split()[1])
                for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("VmRSS:")
            )
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, StopIteration):
            continue
        role = "engine" if "engine.process" in cmd else ("master" if pid == root else "workers")
        acc = figures.setdefault(role, [0, 0])
        acc[0] += rss // 1024
        acc[1] += fds
    return {k: (v[0], v[1]) for k, v in sorted(figures.items())}


def engine_figures(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=60).text
    out = {}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_used_blocks"):
        values = re.findall(rf"^hearth:{name}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
        out[name] = sum(float(v) for v in values)
    out["load"] = httpx.get(url + "/load", timeout=60).json().get("server_load", -1)
    return out


def spawn_server(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = ["--workers", "2", "--max-model-len", "512", "--kv-cache-memory", "256MiB"]
    flags += ["--enable-server-load-tracking", "--disable-log-requests"]
    cmd = [sys.executable, "-m", "container.cli", "serve", "--port", str(port), *flags]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/ping", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit("server not ready in 600 s")


async def soak(args: argparse.Namespace, url: str, root: int | None) -> int:
    rng = random.Random(args.seed)
    totals, answers = Totals(), {}
    samples: list[tuple[float, dict[str, tuple[int, int]], dict[str, float]]] = []
    start = time.monotonic()

    def sample() -> None:
        figures = engine_figures(url)
        samples.append((time.monotonic() - start, process_figures(root), figures))
        print(
            f"[{samples[-1][0]:7.0f} s] sent {totals.sent} ok {totals.ok} cut {totals.cut} "
            f"statuses {dict(totals.statuses)} processes {samples[-1][1]} engine {figures}",
            flush=True,
        )

    sample()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(args.requests):
        queue.put_nowait(i)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(
        base_url=url, timeout=args.request_timeout, limits=limits
    ) as client:

        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                await one(client, rng, args, totals, answers)

        async def sampler() -> None:
            while True:
                await asyncio.sleep(60)
                await asyncio.to_thread(sample)

        ticker = asyncio.create_task(sampler())
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        ticker.cancel()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # cut requests are aborted within a step or two
        figures = engine_figures(url)
        if not any(
            figures[k]
            for k in (
                "num_requests_running",
                "num_requests_waiting",
                "kv_cache_used_blocks",
                "load",
            )
        ):
            break
        time.sleep(1)
    sample()
    first, last = samples[0], samples[-1]
    leaked = {k: v for k, v in last[2].items() if v}
    print("\n== soak summary ==")
    print(
        f"requests {totals.sent} in {last[0]:.0f} s at concurrency {args.concurrency}; "
        f"completed {totals.ok}, cut by the client {totals.cut}"
    )
    print(
        f"statuses {dict(totals.statuses)}; non-cut failures {len(totals.failures)}; "
        f"answers differing from the first identical request {totals.mismatches}"
    )
    print(f"at the end: {last[2]} (leaks: {leaked or 'none'})")
    print(f"processes (RSS MiB, open fds) first {first[1]} -> last {last[1]}")
    for line in totals.failures[:10]:
        print("  failure:", line)
    return 0 if not leaked and not totals.failures else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--disconnect-rate", type=float, default=0.2)
    parser.add_argument("--request-timeout", type=float, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="an already running server (default: start one)")
    parser.add_argument("--server-pid", type=int, help="its gunicorn master, for RSS/fd figures")
    parser.add_argument("--log", type=Path, default=Path("/tmp/hearth-soak-server.log"))
    args = parser.parse_args()
    if args.url:
        return asyncio.run(soak(args, args.url.rstrip("/"), args.server_pid))
    proc, url = spawn_server(args.log)
    try:
        return asyncio.run(soak(args, url, proc.pid))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
