"""A fake OpenAI-compatible streaming server: the test double of the benchmark *client*.

It streams one text chunk per requested token with short sleeps (a longer one before the
first chunk, like a prefill), so requests of one level overlap as they would on a real
server, and records what it was sent and how many streams were in flight when each
arrived. It runs in a thread for most tests, and as a process (`python fake_openai.py
--port P`) for the tests that spawn servers.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL = "fake-model"
FIRST_CHUNK_S = 0.03  # the fake's "prefill": sleep before the first chunk
CHUNK_S = 0.01  # sleep before every later chunk


# --------------------------------------------------------------------------- the fake server


@dataclass
class FakeBehaviour:
    """How the fake answers; tests flip these to simulate overload or missing usage."""

    status: int = 200
    fail_every: int = 0  # with status 200: every n-th completion answers 503
    send_usage: bool = True
    ready_after_s: float = 0.0
    requests: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    # Streams in flight when each request arrived (itself included), in arrival order.
    in_flight_at_arrival: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    ready_at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.ready_at = time.monotonic() + self.ready_after_s


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int = 0, behaviour: FakeBehaviour | None = None) -> None:
        super().__init__(("127.0.0.1", port), FakeOpenAIHandler)
        self.behaviour = behaviour or FakeBehaviour()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class FakeOpenAIHandler(BaseHTTPRequestHandler):
    """/v1/models, /ping (/health, as vLLM names it) and a streaming /v1/completions."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # as uvicorn does: else small chunks bunch up (delayed ACK)
    server: FakeServer

    def log_message(self, format: str, *args: Any) -> None:
        """Silent: the test output should show the bench's lines only."""

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        elif self.path in ("/ping", "/health"):
            ready = time.monotonic() >= self.server.behaviour.ready_at
            self._json(200 if ready else 503, {})
        else:
            self._json(404, {"error": "not found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        behaviour = self.server.behaviour
        with behaviour.lock:
            behaviour.requests.append(body)
            behaviour.in_flight += 1
            behaviour.in_flight_at_arrival.append(behaviour.in_flight)
            number = len(behaviour.requests)
        failing = behaviour.fail_every and number % behaviour.fail_every == 0
        if behaviour.status != 200 or failing:
            self._done()
            self._json(503, {"error": {"message": "fake overload", "code": 503}})
            return
        self._stream(body, behaviour.send_usage)

    def _done(self) -> None:
        """Counted out before the last bytes go: a client cannot start its next request
        before this one is off the count, so a sequential client always sees 1."""
        with self.server.behaviour.lock:
            self.server.behaviour.in_flight -= 1

    def _stream(self, body: dict[str, Any], send_usage: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        tokens = body["max_tokens"]
        for i in range(tokens):
            time.sleep(FIRST_CHUNK_S if i == 0 else CHUNK_S)
            choice = {"index": 0, "text": f" t{i}", "finish_reason": None}
            self._event({"id": "cmpl-1", "object": "text_completion", "choices": [choice]})
        if send_usage:
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": tokens}
            self._event({"id": "cmpl-1", "choices": [], "usage": usage})
        self._chunk(b"data: [DONE]\n\n")
        self._done()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _event(self, payload: dict[str, Any]) -> None:
        self._chunk(b"data: " + json.dumps(payload).encode() + b"\n\n")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _note(path: str | None, line: str) -> None:
    if path:
        with open(path, "a") as events:
            events.write(line + "\n")


def main() -> None:
    """`python fake_openai.py --port P`: the fake as a process, for the spawn tests.

    Unknown arguments are ignored, so it can stand in for `vllm serve MODEL --port P ...`.
    With `--events FILE` it appends `start NAME ARGS` when it starts and `stop NAME` when
    SIGTERM ends it: a test reads from that file which servers ran, in what order, and
    whether two ever overlapped.
    """
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ready-after", type=float, default=0.0)
    parser.add_argument("--events", default=None)
    parser.add_argument("--name", default="fake")
    args, unknown = parser.parse_known_args()
    server = FakeServer(args.port, FakeBehaviour(ready_after_s=args.ready_after))

    def stop(signum: int, frame: object) -> None:
        _note(args.events, f"stop {args.name}")
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    _note(args.events, f"start {args.name} {' '.join(unknown)}".rstrip())
    server.serve_forever()


if __name__ == "__main__":
    main()
