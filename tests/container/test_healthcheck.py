"""The image's HEALTHCHECK probe against a real HTTP server on loopback."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from container.healthcheck import candidate_ports, main, ping

ROOT = Path(__file__).resolve().parents[2]


class PingServer:
    def __init__(self, status: int) -> None:
        self.status = status
        self.paths: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.paths.append(self.path)
                self.send_response(outer.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_args: object) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def server() -> Iterator[PingServer]:
    srv = PingServer(200)
    yield srv
    srv.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_candidate_ports_order_and_filtering() -> None:
    assert candidate_ports({}) == [8080, 8000]
    env = {"SAGEMAKER_BIND_TO_PORT": "9000", "HEARTH_PORT": "8000", "HEARTH_HEALTHCHECK_PORT": "x"}
    assert candidate_ports(env) == [9000, 8000, 8080]


def test_ping_is_healthy_only_on_200(server: PingServer) -> None:
    assert ping(server.port)
    assert server.paths == ["/ping"]
    server.status = 503  # engine still loading
    assert not ping(server.port)
    assert not ping(free_port())  # nothing listening


def test_main_tries_every_port(server: PingServer) -> None:
    dead = free_port()
    assert main([str(dead), str(server.port)]) == 0
    server.status = 503
    assert main([str(dead), str(server.port)]) == 1


def test_module_runs_as_the_docker_healthcheck_does(server: PingServer) -> None:
    env = {"SAGEMAKER_BIND_TO_PORT": str(server.port), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "container.healthcheck"]
    assert subprocess.run(cmd, env=env, cwd=ROOT, timeout=20).returncode == 0
    server.status = 500
    # Explicit port: a real server on 8080/8000 of this machine must not make it pass.
    failing = subprocess.run([*cmd, str(server.port)], env=env, cwd=ROOT, timeout=20)
    assert failing.returncode == 1
