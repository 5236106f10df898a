"""ZeroMQ transport between API workers and the engine core process.

The engine binds one ROUTER socket on an ipc:// path; every API worker connects a
DEALER with its own identity. Frames are msgspec msgpack of the tagged structs in
`engine.messages`, so one decoder reads any message. Runtime files next to the socket
tell workers about the engine without an IPC round trip (which could wait behind a
long step): `engine.lock` is held (flock) for the engine's whole life, and
`engine.ready` holds the ModelInfo once the engine is warm.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import zmq

from engine.config import ModelInfo
from engine.messages import EngineMessage, WorkerMessage

SOCKET_NAME = "engine.sock"
LOCK_NAME = "engine.lock"
READY_NAME = "engine.ready"
HEARTBEAT_NAME = "engine.heartbeat"

HEARTBEAT_PERIOD_S = 0.25
MAX_STEP_S = 600.0
"""One engine step longer than this counts as hung."""

engine_message_decoder = msgspec.msgpack.Decoder(EngineMessage)
worker_message_decoder = msgspec.msgpack.Decoder(WorkerMessage)
encoder = msgspec.msgpack.Encoder()

logger = logging.getLogger("hearth.engine")

SOCKET_HWM = 10_000
"""Frames ZeroMQ buffers per peer and direction, on both ends (the engine's ROUTER and
each worker's DEALER). Chosen on purpose: a bounded buffer with a queue of our own
behind it that waits instead of dropping (the engine's per-worker queue, retried
between steps; the worker's outbox, see engine/zmq_client.py)."""
PENDING_RETRY_MS = 10
"""Poll timeout while frames wait for a slow worker, so they go out soon after it reads."""
MAX_PENDING_FRAMES = 100_000
"""A worker that has not read this many of our frames is treated as gone: its requests are
aborted (a SIGSTOPped worker for minutes; an ordinary stall is far below this)."""


def socket_address(runtime_dir: str | Path) -> str:
    return f"ipc://{Path(runtime_dir) / SOCKET_NAME}"


class ZmqEngineTransport:
    """The engine side: a ROUTER socket that knows each worker by its identity."""

    def __init__(self, runtime_dir: str | Path) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        # Unroutable identity raises EHOSTUNREACH: that is how we learn a worker died.
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, SOCKET_HWM)
        self._sock.setsockopt(zmq.RCVHWM, SOCKET_HWM)
        self._sock.bind(socket_address(runtime_dir))
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._pending: dict[bytes, collections.deque[bytes]] = {}
        self._gone: set[bytes] = set()
        """Workers found dead; nothing more is sent to them."""
        self._newly_gone: set[bytes] = set()

    def poll(self, timeout_ms: int) -> list[tuple[bytes, EngineMessage]]:
        messages: list[tuple[bytes, EngineMessage]] = []
        if self._pending:
            self.flush()
            timeout_ms = min(timeout_ms, PENDING_RETRY_MS)
        if not self._poller.poll(timeout_ms):
            return messages
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return messages
            if len(frames) != 2:
                logger.warning("dropping a malformed %d-frame message", len(frames))
                continue
            identity, payload = frames
            self._gone.discard(identity)  # it speaks: alive (identities are per process)
            try:
                messages.append((identity, engine_message_decoder.decode(payload)))
            except msgspec.DecodeError:
                logger.warning("dropping an undecodable frame")
                continue  # not ours; never let a bad frame kill the engine

    def send(self, client_id: bytes, message: WorkerMessage) -> None:
        """Deliver in order, or keep it for this worker until it reads again."""
        if client_id in self._gone:
            return
        queue = self._pending.get(client_id)
        if queue is None:
            queue = self._pending[client_id] = collections.deque()
        queue.append(encoder.encode(message))
        self._flush_one(client_id, queue)

    def flush(self) -> None:
        for client_id, queue in list(self._pending.items()):
            self._flush_one(client_id, queue)

    def _flush_one(self, client_id: bytes, queue: collections.deque[bytes]) -> None:
        while queue:
            try:
                self._sock.send_multipart([client_id, queue[0]], zmq.NOBLOCK)
            except zmq.Again:
                if len(queue) > MAX_PENDING_FRAMES:
                    logger.warning("worker %r stopped reading; aborting its requests", client_id)
                    self._mark_gone(client_id)
                return
            except zmq.ZMQError as exc:
                if exc.errno != errno.EHOSTUNREACH:
                    raise
                self._mark_gone(client_id)
                return
            queue.popleft()
        del self._pending[client_id]

    def _mark_gone(self, client_id: bytes) -> None:
        self._gone.add(client_id)
        self._newly_gone.add(client_id)
        self._pending.pop(client_id, None)

    def take_gone_clients(self) -> set[bytes]:
        """Workers found unroutable (dead) since the last call; their requests run for
        nobody and must be aborted."""
        gone, self._newly_gone = self._newly_gone, set()
        return gone

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()


# -- runtime files -------------------------------------------------------------------
def hold_engine_lock(runtime_dir: str | Path) -> int:
    """Take the lock that tells everyone the engine is alive; the OS drops it at exit."""
    fd = os.open(Path(runtime_dir) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    for _ in range(100):  # a worker's liveness probe holds it for microseconds
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            time.sleep(0.01)
    else:
        raise RuntimeError(f"another engine holds {runtime_dir}/{LOCK_NAME}")
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def engine_is_alive(runtime_dir: str | Path) -> bool:
    """True while the engine process holds its lock (also before it is ready)."""
    path = Path(runtime_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


class Heartbeat:
    """The engine's pulse: the mtime of a runtime file, which workers read with one
    stat(), never waiting on the engine.

    A thread touches the file every HEARTBEAT_PERIOD_S while the busy loop is alive: it
    went round within the last period, or it is inside one step that started less than
    MAX_STEP_S ago (a long CPU prefill is slow, not hung). A stopped process (SIGSTOP,
    frozen container) stops the thread too; a loop stuck anywhere but in a step, or one
    step past MAX_STEP_S, stops the beats while the process runs on.
    """

    def __init__(self, runtime_dir: str | Path) -> None:
        self.path = Path(runtime_dir) / HEARTBEAT_NAME
        self.path.touch(mode=0o600)
        self._last_loop = time.monotonic()
        self._step_started: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hearth-heartbeat", daemon=True)
        self._thread.start()

    def loop(self) -> None:
        """Called by the busy loop every iteration (no system call)."""
        self._last_loop = time.monotonic()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self._step_started = time.monotonic()
        try:
            yield
        finally:
            self._step_started = None
            self._last_loop = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_PERIOD_S):
            now = time.monotonic()
            started = self._step_started
            if now - self._last_loop <= 2 * HEARTBEAT_PERIOD_S or (
                started is not None and now - started <= MAX_STEP_S
            ):
                with contextlib.suppress(OSError):
                    os.utime(self.path)

    def close(self) -> None:
        self._stop.set()


def heartbeat_age(runtime_dir: str | Path) -> float | None:
    """Seconds since the engine loop last beat; None before its first beat."""
    try:
        return max(0.0, time.time() - (Path(runtime_dir) / HEARTBEAT_NAME).stat().st_mtime)
    except FileNotFoundError:
        return None


def write_ready(runtime_dir: str | Path, info: ModelInfo) -> None:
    path = Path(runtime_dir) / READY_NAME
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.encode(info))
    tmp.replace(path)


def read_ready(runtime_dir: str | Path) -> ModelInfo | None:
    try:
        return msgspec.json.decode((Path(runtime_dir) / READY_NAME).read_bytes(), type=ModelInfo)
    except (FileNotFoundError, msgspec.DecodeError):
        return None
