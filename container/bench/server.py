"""Servers the benchmark starts itself: `hearth serve` (or vLLM) on a free loopback port.

A spawned server runs for the length of a `with` block: started in its own session, awaited
on its readiness route, stopped the way a platform stops it (SIGTERM, then wait), and then
every process it left (its group, and children that moved to a session of their own, such
as an engine core) is killed, so the next server of a run never shares the two cores with
a straggler of the last.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

import httpx

Log = Callable[[str], None]


class ServerStartError(RuntimeError):
    """The spawned server exited or never answered its readiness route."""


def free_port() -> int:
    """A loopback port nobody listens on now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve_command(
    port: int, server_args: Sequence[str], max_model_len: int | None = None
) -> list[str]:
    """`hearth serve` through this interpreter, so the venv and the code are the ones running.

    `max_model_len` goes before the extra arguments, so one given there wins.
    """
    extra = [token for value in server_args for token in shlex.split(value)]
    context = ["--max-model-len", str(max_model_len)] if max_model_len else []
    return [
        sys.executable,
        "-m",
        "container.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *context,
        *extra,
    ]


def hearth_env() -> dict[str, str]:
    """Our environment, with this checkout first on PYTHONPATH: `-m container.cli` must
    import the same code as the bench, even when hearth is not pip-installed."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (Linux /proc), found before it is signalled: once the
    parent is gone its children are re-parented and can no longer be traced to it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = stat.rpartition(")")[2].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class SpawnedServer:
    """A server process for the length of a `with` block; yields its base URL.

    Its output goes to a log file: the bench's own output stays readable, and the tail is
    shown if it fails to start. `ready_s` is the time from start to its first 200.
    """

    def __init__(
        self,
        command: Sequence[str],
        port: int,
        log_path: Path,
        ready_timeout_s: float = 900.0,
        log: Log | None = None,
        poll_interval_s: float = 0.5,
        progress_interval_s: float = 5.0,
        stop_timeout_s: float = 60.0,
        ready_path: str = "/ping",
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.command = list(command)
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.log: Log = log or (lambda message: print(message, file=sys.stderr, flush=True))
        self.poll_interval_s = poll_interval_s
        self.progress_interval_s = progress_interval_s
        self.stop_timeout_s = stop_timeout_s
        self.ready_path = ready_path
        self.env = dict(env) if env is not None else hearth_env()
        self.process: subprocess.Popen[bytes] | None = None
        self.ready_s: float | None = None

    def __enter__(self) -> str:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log(f"starting: {shlex.join(self.command)} (log: {self.log_path})")
        with self.log_path.open("wb") as log_file:
            self.process = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.base_url

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        """Poll the readiness route until 200; loading can take minutes on 2 cores."""
        assert self.process is not None
        start = last_note = time.monotonic()
        url = self.base_url + self.ready_path
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while True:
                if self.process.poll() is not None:
                    raise ServerStartError(
                        f"the server exited with code {self.process.returncode} before it "
                        f"was ready; last lines of {self.log_path}:\n{self.log_tail()}"
                    )
                if _is_ready(client, url):
                    self.ready_s = time.monotonic() - start
                    self.log(f"server ready at {self.base_url} after {self.ready_s:.0f} s")
                    return
                now = time.monotonic()
                if now - start > self.ready_timeout_s:
                    raise ServerStartError(
                        f"no 200 from {url} in {self.ready_timeout_s:.0f} s; "
                        f"last lines of {self.log_path}:\n{self.log_tail()}"
                    )
                if now - last_note >= self.progress_interval_s:
                    self.log(f"  waiting for the server (loading the model?): {now - start:.0f} s")
                    last_note = now
                time.sleep(self.poll_interval_s)

    def stop(self) -> None:
        """SIGTERM and wait, as a platform stops it; then SIGKILL whatever it left behind."""
        process, self.process = self.process, None
        if process is None:
            return
        leftovers = [(pid, _start_time(pid)) for pid in descendants(process.pid)]
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.log(f"the server ignored SIGTERM for {self.stop_timeout_s:.0f} s; killing it")
                _signal_group(process.pid, signal.SIGKILL)
                process.wait()
        stragglers = _signal_group(process.pid, signal.SIGKILL)
        killed = []
        for pid, started in leftovers:
            # The same process only: a pid freed meanwhile may belong to someone else now.
            same = started is not None and _start_time(pid) == started
            if same and _signal_pid(pid, signal.SIGKILL):
                killed.append((pid, started))
        if stragglers or killed:
            self.log("the server left processes behind; killed them")
        # The next server of a run must not start while these still hold cores or memory.
        deadline = time.monotonic() + self.stop_timeout_s
        while any(_start_time(pid) == started for pid, started in killed):
            if time.monotonic() > deadline:
                self.log("processes of the server are still dying; going on")
                break
            time.sleep(0.05)

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


def _is_ready(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url).status_code == 200
    except httpx.HTTPError:
        return False


def _signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Signal the process group we started; False when it has no process left."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat); None when it
    is gone or a zombie (dead, only not yet reaped by whoever adopted it)."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    if len(fields) <= 19 or fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _signal_pid(pid: int, sig: signal.Signals) -> bool:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True
