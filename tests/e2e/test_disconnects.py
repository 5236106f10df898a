"""A real server notices clients that leave, and writes streams any SSE client can parse.

Against `hearth serve` (gunicorn + uvicorn workers + engine process) on the default
model: a non-streaming request whose client hangs up is aborted in the engine (its KV
blocks return, generation stops), and a stream that waits behind a long prefill carries
no SSE comment line (`vllm bench serve` loses every event after one).
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.e2e.clients import metric, wait_metric
from tests.e2e.server import Server

pytestmark = pytest.mark.slow

RUNNING = "hearth:num_requests_running"
USED_BLOCKS = "hearth:kv_cache_used_blocks"
GENERATED = "hearth:generation_tokens_total"


def _post(server: Server, path: str, body: dict[str, object]) -> socket.socket:
    """Send one HTTP/1.1 POST over a raw socket and return the open connection."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=300)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    ).encode()
    sock.sendall(head + data)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    sock.close()
    return b"".join(chunks)


def _dechunk(body: bytes) -> bytes:
    """The payload of a `Transfer-Encoding: chunked` body."""
    out = []
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out.append(rest[:size])
        body = rest[size + 2 :]
    return b"".join(out)


def test_non_stream_client_that_leaves_is_aborted(default_server: Server) -> None:
    assert wait_metric(default_server, RUNNING, 0) == 0
    generated_before = metric(default_server, GENERATED)
    max_tokens = 1500
    sock = _post(
        default_server,
        "/v1/completions",
        {
            "model": "smollm2",
            "prompt": "Count from one to one thousand:",
            "max_tokens": max_tokens,
            "ignore_eos": True,
        },
    )
    # The engine runs it (and holds KV blocks for it) ...
    assert wait_metric(default_server, RUNNING, 1, timeout=120) == 1
    assert metric(default_server, USED_BLOCKS) > 0
    sock.close()  # ... until the client hangs up without waiting for the answer.
    assert wait_metric(default_server, RUNNING, 0, timeout=60) == 0
    assert wait_metric(default_server, USED_BLOCKS, 0, timeout=60) == 0
    # Aborted, not run to the end: nothing generated it to its max_tokens.
    assert metric(default_server, GENERATED) - generated_before < max_tokens


def test_stream_behind_a_long_prefill_has_no_comment_lines(default_server: Server) -> None:
    # ~1,000 prompt tokens: seconds of CPU prefill before the first token, long
    # enough for a keep-alive comment if the server sent them by default.
    prompt = "one two three four five six seven eight nine ten " * 100
    started = time.monotonic()
    sock = _post(
        default_server,
        "/v1/completions",
        {"model": "smollm2", "prompt": prompt, "max_tokens": 4, "stream": True},
    )
    raw = _read_all(sock)
    waited = time.monotonic() - started
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"text/event-stream" in head
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    lines = [line for line in body.decode().split("\n") if line]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert [line for line in lines if line.startswith(":")] == []
    assert all(line.startswith("data: ") for line in lines)
    print(f"stream took {waited:.1f} s, {len(lines)} SSE lines, none a comment")
