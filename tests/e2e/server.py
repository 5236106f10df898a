"""Start a real `hearth serve` (gunicorn + uvicorn workers + engine core process) on a
free loopback port, for tests that talk to it over HTTP like any client would."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

READY_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    flags: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"hearth serve exited with {self.process.returncode}:\n{self.log()[-4000:]}"
                )
            try:
                if httpx.get(self.url + "/ping", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"hearth serve not ready after {timeout} s:\n{self.log()[-4000:]}")

    def stop(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.process.returncode


def start_server(
    tmp_dir: Path, *flags: str, env: dict[str, str] | None = None, wait: bool = True
) -> Server:
    port = free_port()
    log_path = tmp_dir / f"hearth-{port}.log"
    cmd = [sys.executable, "-m", "container.cli", "serve", "--port", str(port), *flags]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
            cwd=Path(__file__).resolve().parents[2],
        )
    server = Server(process, port, log_path, list(flags))
    if wait:
        try:
            server.wait_ready()
        except BaseException:
            server.stop()
            raise
    return server
