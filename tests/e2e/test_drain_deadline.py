"""A stream still running when the SIGTERM drain window closes ends with an error chunk
and `data: [DONE]`, never a cut connection, and the server still exits 0."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import start_server

pytestmark = pytest.mark.slow


def test_stream_past_the_drain_window_ends_cleanly(
    server_logs: Path, model_smollm2_dir: str
) -> None:
    server = start_server(
        server_logs,
        "--timeout-graceful-shutdown",
        "5",
        "--max-model-len",
        "4096",
        "--kv-cache-memory",
        "256MiB",
    )
    lines: list[str] = []
    try:
        body = {
            "model": "smollm2",
            "prompt": "Count forever:",
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 6:
                    sigterm_at = time.monotonic()
                    server.process.send_signal(signal.SIGTERM)
        print(f"stream ended {time.monotonic() - sigterm_at:.2f} s after SIGTERM")
        data = [x.removeprefix("data: ") for x in lines if x.startswith("data: ")]
        assert data[-1] == "[DONE]"
        error = json.loads(data[-2])
        assert "error" in error and error["error"]["code"] == 503
        assert "shutting down" in error["error"]["message"]
        # Not cut at SIGTERM: tokens kept coming during the drain window ...
        after_sigterm = [x for x in lines[6:] if x.startswith("data: {") and '"error"' not in x]
        assert after_sigterm
        assert server.process.wait(30) == 0
        log = server.log()
        # ... until the worker ended it with the error event before uvicorn's own deadline
        # (uvicorn never had to cancel the response).
        assert "ended 1 in-flight stream" in log
        assert "timeout graceful shutdown exceeded" not in log
    finally:
        server.stop()
