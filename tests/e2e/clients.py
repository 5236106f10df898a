"""Client-side helpers of the end-to-end tests: SDK clients, raw SSE parsing, /metrics
and OpenAI error-shape checks. Everything here talks to a real server over HTTP."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import openai

from tests.e2e.server import Server

TIMEOUT = 300.0
"""Per-request timeout: other test sessions may share the two cores."""


def client(server: Server, **kwargs: Any) -> openai.OpenAI:
    kwargs.setdefault("max_retries", 0)
    return openai.OpenAI(base_url=server.v1, api_key="unused", timeout=TIMEOUT, **kwargs)


def async_client(server: Server, **kwargs: Any) -> openai.AsyncOpenAI:
    kwargs.setdefault("max_retries", 0)
    return openai.AsyncOpenAI(base_url=server.v1, api_key="unused", timeout=TIMEOUT, **kwargs)


def metric(server: Server, name: str) -> float:
    """Sum of every sample of `name` on /metrics (all label sets, all processes)."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
    assert values, f"{name} missing from /metrics"
    return sum(float(v) for v in values)


def wait_metric(server: Server, name: str, want: float, timeout: float = 30.0) -> float:
    """Poll /metrics until `name` equals `want` (or the deadline); the last value."""
    deadline = time.monotonic() + timeout
    value = metric(server, name)
    while value != want and time.monotonic() < deadline:
        time.sleep(0.2)
        value = metric(server, name)
    return value


def sse_lines(raw: bytes) -> list[str]:
    """Non-empty lines of an SSE body."""
    return [line for line in raw.decode("utf-8").split("\n") if line.strip()]


def sse_data(raw: bytes) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded (`[DONE]` kept as the string)."""
    out: list[Any] = []
    for line in sse_lines(raw):
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def assert_openai_error(response: httpx.Response, status: int, param: Any = ...) -> dict[str, Any]:
    """The status, a JSON content type and `{"error": {"message", "type", "param", "code"}}`;
    `param` is checked when given (None included)."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"].endswith("Error"), error
    assert error["code"] == status, error
    assert "Traceback" not in error["message"], error
    if param is not ...:
        assert error["param"] == param, error
    return error


ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
}


def assert_anthropic_error(response: httpx.Response, status: int) -> dict[str, Any]:
    """The status, a JSON content type and Anthropic's error shape
    `{"type": "error", "error": {"type", "message"}}` with its type name for the status."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert body.keys() == {"type", "error"} and body["type"] == "error", body
    error = body["error"]
    assert error.keys() == {"type", "message"}, error
    assert error["type"] == ANTHROPIC_ERROR_TYPES[status], error
    assert isinstance(error["message"], str) and error["message"], error
    assert "Traceback" not in error["message"], error
    return error
