"""The default model served end to end: gunicorn + 2 uvicorn workers + one engine core
process, driven by the real `openai` SDK and raw HTTP."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.server import Server

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", timeout=120)


def _metric(server: Server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
    assert values, f"{name} missing from /metrics"
    return sum(float(v) for v in values)


def test_chat_answers_paris_and_stream_matches(default_server: Server) -> None:
    client = _client(default_server)
    reply = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0)
    text = reply.choices[0].message.content
    assert "Paris" in text
    assert reply.object == "chat.completion" and reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens > 10 and reply.usage.completion_tokens > 3

    chunks = list(
        client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, stream=True)
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_invocations_returns_chat_completion(default_server: Server) -> None:
    r = httpx.post(
        default_server.url + "/invocations",
        json={"messages": FRANCE, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert "Paris" in body["choices"][0]["message"]["content"]


def test_completions_and_models(default_server: Server) -> None:
    client = _client(default_server)
    assert [m.id for m in client.models.list()] == ["smollm2"]
    out = client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=5, temperature=0
    )
    assert out.object == "text_completion" and out.usage.completion_tokens == 5
    assert out.choices[0].finish_reason == "length"
    raw = httpx.get(default_server.url + "/v1/models", timeout=10)
    assert raw.headers["content-type"].startswith("application/json")
    card = client.models.retrieve("smollm2")  # GET /v1/models/{model}
    assert card.id == "smollm2" and card.model_dump(exclude_unset=True) == raw.json()["data"][0]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_ops_routes(default_server: Server) -> None:
    for route in ("/ping", "/health", "/version"):
        assert httpx.get(default_server.url + route, timeout=10).status_code == 200, route
    assert httpx.post(default_server.url + "/ping", timeout=10).status_code == 200
    version = httpx.get(default_server.url + "/version", timeout=10).json()
    # The default model is a GGUF: on an AVX2 host the fast path runs (its bfloat16-tile
    # mode where a bfloat16 kernel runs), and says so.
    from engine.backends import auto_gguf_mode
    from kernels.cpu.build import host_isa

    expected = auto_gguf_mode() if host_isa().variant else "none"
    assert version["quantization"] == expected, version
    assert (host_isa().variant or "torch") in version["kernels"], version
    assert "hearth:num_requests_running" in httpx.get(default_server.url + "/metrics").text
    missing = httpx.get(default_server.url + "/v1/nothing-here", timeout=10)
    assert missing.status_code == 404 and "error" in missing.json()


async def _stream_all(server: Server, n: int, max_tokens: int) -> list[str]:
    client = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", timeout=300)

    async def one(i: int) -> str:
        stream = await client.chat.completions.create(
            model="smollm2",
            temperature=0.7,
            seed=i,
            max_tokens=max_tokens,
            stream=True,
            messages=[{"role": "user", "content": f"Tell me fact number {i} about rivers."}],
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        return "".join(parts)

    try:
        return await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await client.close()


def test_32_concurrent_streams_all_succeed(default_server: Server) -> None:
    texts = asyncio.run(_stream_all(default_server, 32, max_tokens=24))
    assert len(texts) == 32 and all(t.strip() for t in texts)
    assert len(set(texts)) > 16  # different seeds, different text


async def _cut_streams(server: Server, n: int) -> None:
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(i: int) -> None:
            body = {
                "model": "smollm2",
                "prompt": f"Count slowly from {i} to one thousand:",
                "max_tokens": 400,
                "ignore_eos": True,
                "stream": True,
            }
            async with client.stream("POST", server.v1 + "/completions", json=body) as r:
                assert r.status_code == 200
                seen = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        seen += 1
                    if seen >= 5:
                        return  # leaving the block closes the connection mid-stream

        await asyncio.gather(*(one(i) for i in range(n)))


def test_cut_streams_free_their_kv_blocks(default_server: Server) -> None:
    generated_before = _metric(default_server, "hearth:generation_tokens_total")
    asyncio.run(_cut_streams(default_server, 8))
    deadline = time.monotonic() + 20
    used = _metric(default_server, "hearth:kv_cache_used_blocks")
    while used > 0 and time.monotonic() < deadline:
        time.sleep(0.25)
        used = _metric(default_server, "hearth:kv_cache_used_blocks")
    assert used == 0
    assert _metric(default_server, "hearth:num_requests_running") == 0
    # The engine would otherwise still be generating 8 x 400 tokens.
    generated = _metric(default_server, "hearth:generation_tokens_total") - generated_before
    assert generated < 8 * 400


def _process_table(root_pid: int, with_compilers: bool = False) -> list[tuple[int, int, str]]:
    """(pid, rss_kib, cmdline) of root_pid and all its descendants, but (unless
    `with_compilers`) the engine's grammar-compile children (`engine.structured.isolated`,
    killable compile slots): they are the engine's helpers, neither API workers nor holders
    of weights, and tests that tell the engine from the workers by their process tree would
    count them as workers."""
    import os

    children: dict[int, list[int]] = {}
    info: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/status") as f:
                rss = next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
        info[int(entry)] = (rss, cmd)
    out, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        if pid in info and (with_compilers or "engine.structured.isolated" not in info[pid][1]):
            out.append((pid, *info[pid]))
        todo.extend(children.get(pid, []))
    return out


def test_the_workers_run_below_the_engines_priority(default_server: Server) -> None:
    """--worker-niceness (default 7): a worker busy with one client's bodies gets the CPU
    the engine's step leaves; the engine (and the master) keep the priority they had."""
    import os

    from container.flags import WORKER_NICENESS

    master = default_server.process.pid
    table = _process_table(master)
    engines = [pid for pid, _, cmd in table if "engine.process" in cmd]
    workers = [pid for pid, _, _ in table if pid != master and pid not in engines]
    base = os.getpriority(os.PRIO_PROCESS, master)
    assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in engines] == [base]
    assert len(workers) == 2
    assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in workers] == [
        min(19, base + WORKER_NICENESS)
    ] * 2


def test_weights_live_in_one_engine_process(default_server: Server) -> None:
    table = _process_table(default_server.process.pid)
    for pid, rss, cmd in table:
        print(f"{pid:>7} {rss / 1024:8.0f} MiB  {cmd[:100]}")
    engines = [row for row in table if "engine.process" in row[2]]
    workers = [row for row in table if row[0] != default_server.process.pid and row not in engines]
    assert len(engines) == 1
    assert len(workers) == 2
    # Workers never import torch or hold weights; the engine holds ~540 MB of fp32 weights.
    assert engines[0][1] > 500 * 1024
    assert all(rss < 250 * 1024 for _, rss, _ in workers)


def _prompt_logprobs(server: Server, prompt: str) -> list[float]:
    done = _client(server).completions.create(
        model="smollm2", prompt=prompt, echo=True, logprobs=0, max_tokens=0, temperature=0
    )
    return [lp for lp in done.choices[0].logprobs.token_logprobs if lp is not None]


def test_a_forced_lower_kernel_variant_scores_a_long_prompt_like_the_default(
    default_server: Server, server_logs: Path
) -> None:
    """`--cpu-isa avx512_vnni` (forced down on an AMX host; the default on Zen 4) serves
    with the AVX512-BF16 linears and prefill attention, and a 361-token prompt, which runs
    both on the bfloat16 kernels, gets its tokens' log-probabilities within bfloat16
    rounding of the default server's (the two agree to rounding, not bitwise)."""
    from kernels.cpu.build import host_isa

    if "avx512_vnni" not in host_isa().supported:
        pytest.skip(f"this host cannot run the avx512_vnni build ({host_isa().describe()})")
    from tests.e2e.server import start_server

    lower = start_server(server_logs, "--cpu-isa", "avx512_vnni", "--max-model-len", "2048")
    try:
        kernels = httpx.get(lower.url + "/version", timeout=10).json()["kernels"]
        assert "C kernels avx512_vnni" in kernels
        assert "prefill attention (16+ tokens) avx512-bf16" in kernels
        prompt = "The history of the city of London is long and varied. " * 30
        got, want = _prompt_logprobs(lower, prompt), _prompt_logprobs(default_server, prompt)
    finally:
        lower.stop()
    assert len(got) == len(want) == 360
    diffs = [abs(a - b) for a, b in zip(got, want, strict=True)]
    # The two bfloat16 paths differ in summation order only: mean 0.0013, max 0.049 nat on
    # a Sapphire Rapids host; a kernel that computed something else moves them by nats.
    assert sum(diffs) / len(diffs) < 0.02 and max(diffs) < 0.5
