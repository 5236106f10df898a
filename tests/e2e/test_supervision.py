"""Process supervision and the key guard on a real server: an engine that dies takes
the server down with a non-zero exit (so the platform restarts it), after /health and
/ping have said so; with --api-key every inference route needs the key."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.e2e.server import start_server
from tests.e2e.test_default_model import _process_table

pytestmark = pytest.mark.slow


def test_api_key_guards_inference_but_not_health(server_logs: Path, model_smollm2_dir: str) -> None:
    server = start_server(
        server_logs, "--api-key", "s3cret", "--max-model-len", "1024", "--kv-cache-memory", "256MiB"
    )
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for route in ("/v1/chat/completions", "/invocations"):
            r = httpx.post(server.url + route, json=body, timeout=60)
            assert r.status_code == 401, (route, r.text)
            assert r.json()["error"]["code"] == 401
            wrong = httpx.post(
                server.url + route, json=body, timeout=60, headers={"Authorization": "Bearer nope"}
            )
            assert wrong.status_code == 401
        assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
        for route in ("/ping", "/health", "/version"):
            assert httpx.get(server.url + route, timeout=10).status_code == 200, route
        assert httpx.get(server.url + "/metrics", timeout=10).status_code == 401
        client = openai.OpenAI(base_url=server.v1, api_key="s3cret", timeout=60)
        reply = client.chat.completions.create(
            model="smollm2", max_tokens=2, messages=body["messages"]
        )
        assert reply.usage.completion_tokens == 2
        # The anthropic SDK sends its key as `x-api-key`; a missing one is its 401.
        question = {"model": "smollm2", "max_tokens": 2, "messages": body["messages"]}
        with pytest.raises(anthropic.AuthenticationError) as refused:
            anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0).messages.create(
                **question
            )
        assert refused.value.body["error"]["type"] == "authentication_error"
        claude = anthropic.Anthropic(base_url=server.url, api_key="s3cret", timeout=60)
        assert claude.messages.create(**question).usage.output_tokens == 2
    finally:
        server.stop()


def test_engine_death_fails_health_and_exits_nonzero(
    server_logs: Path, model_smollm2_dir: str
) -> None:
    server = start_server(server_logs, "--max-model-len", "1024", "--kv-cache-memory", "256MiB")
    try:
        engine = [
            pid for pid, _, cmd in _process_table(server.process.pid) if "engine.process" in cmd
        ]
        assert len(engine) == 1
        os.kill(engine[0], signal.SIGKILL)
        deadline = time.monotonic() + 5
        statuses: set[int] = set()
        while time.monotonic() < deadline and 503 not in statuses:
            try:
                statuses.add(httpx.get(server.url + "/health", timeout=2).status_code)
            except httpx.HTTPError:
                break
            time.sleep(0.05)
        assert 503 in statuses, statuses
        code = server.process.wait(60)
        assert code != 0
        assert "engine core exited unexpectedly" in server.log()
    finally:
        server.stop()
