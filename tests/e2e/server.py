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


def _launch(
    cmd: list[str],
    port: int,
    tmp_dir: Path,
    env: dict[str, str],
    flags: list[str],
    wait: bool,
    drop: tuple[str, ...] = (),
) -> Server:
    log_path = tmp_dir / f"hearth-{port}.log"
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    full_env = {**inherited, "PYTHONUNBUFFERED": "1", **env}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
            cwd=Path(__file__).resolve().parents[2],
        )
    server = Server(process, port, log_path, flags)
    if wait:
        try:
            server.wait_ready()
        except BaseException:
            server.stop()
            raise
    return server


def start_server(
    tmp_dir: Path, *flags: str, env: dict[str, str] | None = None, wait: bool = True
) -> Server:
    """`hearth serve --port <free port> FLAGS` (binds 127.0.0.1)."""
    port = free_port()
    cmd = [sys.executable, "-m", "container.cli", "serve", "--port", str(port), *flags]
    return _launch(cmd, port, tmp_dir, env or {}, list(flags), wait)


def start_sagemaker_serve(tmp_dir: Path, env: dict[str, str], wait: bool = True) -> Server:
    """The `serve` console entry as SageMaker starts it: no arguments, its configuration
    in the environment only, `SAGEMAKER_BIND_TO_PORT` set to a free port. It binds
    0.0.0.0; `Server.url` talks to it on 127.0.0.1. Variables of this process that would
    change what or where it serves are not passed on: `env` alone decides."""
    port = free_port()
    cmd = [sys.executable, "-m", "container.sagemaker_serve"]
    drop = ("SM_HEARTH_", "SAGEMAKER_", "HEARTH_MODEL", "HEARTH_HOST", "HEARTH_PORT")
    env = {**env, "SAGEMAKER_BIND_TO_PORT": str(port)}
    return _launch(cmd, port, tmp_dir, env, [], wait, drop)
