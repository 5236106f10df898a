"""Raw HTTP connections pinned to one API worker of a real server.

A keep-alive connection is accepted by exactly one gunicorn worker and all its requests
go there. Which worker holds it is read from /proc: the server-side socket whose peer
is our local port (`/proc/net/tcp`) and the worker whose file descriptors include it.
That turns "both workers see the session" into a fact a test can check, instead of
hoping that enough requests spread over both.
"""

from __future__ import annotations

import http.client
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.e2e.server import Server
from tests.e2e.test_default_model import _process_table


def worker_pids(server: Server) -> list[int]:
    """The API worker processes (the master's descendants but the engine)."""
    table = _process_table(server.process.pid)
    return [
        pid for pid, _, cmd in table if pid != server.process.pid and "engine.process" not in cmd
    ]


def _socket_inode(server_port: int, client_port: int) -> str | None:
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = fields[1], fields[2]
        if int(local.rsplit(":", 1)[1], 16) == server_port and (
            int(remote.rsplit(":", 1)[1], 16) == client_port
        ):
            return fields[9]
    return None


def _owner(inode: str, pids: list[int]) -> int | None:
    target = f"socket:[{inode}]"
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd) == target:
                    return pid
            except OSError:
                continue
    return None


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class WorkerConnection:
    """Requests to one worker. Each goes over a fresh connection that worker accepted:
    the server closes keep-alive connections idle for 5 s, and a reconnect could land
    on the other worker."""

    def __init__(self, server: Server, pid: int) -> None:
        self.server = server
        self.pid = pid

    def request(
        self, method: str, path: str, body: bytes | dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> Answer:  # fmt: skip
        conn = _connect_to(self.server, self.pid)
        try:
            data = json.dumps(body).encode() if isinstance(body, dict) else body
            sent = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=data, headers=sent)
            resp = conn.getresponse()
            payload = resp.read()
            return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, payload)
        finally:
            conn.close()


def _connect_to(server: Server, pid: int, attempts: int = 200) -> http.client.HTTPConnection:
    """A fresh keep-alive connection that worker `pid` accepted."""
    pids = worker_pids(server)
    for _ in range(attempts):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
        conn.request("GET", "/health")
        conn.getresponse().read()
        inode = _socket_inode(server.port, conn.sock.getsockname()[1])
        owner = _owner(inode, pids) if inode is not None else None
        if owner == pid:
            return conn
        conn.close()
    raise AssertionError(f"no connection reached worker {pid} in {attempts} attempts")
