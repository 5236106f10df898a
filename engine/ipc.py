"""ZeroMQ transport between API workers and the engine core process.

The engine binds one ROUTER socket on an ipc:// path; every API worker connects a
DEALER with its own identity. Frames are msgspec msgpack of the tagged structs in
`engine.messages`, so one decoder reads any message. Runtime files next to the socket
tell workers about the engine without an IPC round trip (which could wait behind a
long step): `engine.lock` is held (flock) for the engine's whole life, and
`engine.ready` holds the ModelInfo once the engine is warm.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

import msgspec
import zmq

from engine.config import ModelInfo
from engine.messages import EngineMessage, WorkerMessage

SOCKET_NAME = "engine.sock"
LOCK_NAME = "engine.lock"
READY_NAME = "engine.ready"

ENV_RUNTIME_DIR = "HEARTH_RUNTIME_DIR"
ENV_ENGINE_CONFIG = "HEARTH_ENGINE_CONFIG"

engine_message_decoder = msgspec.msgpack.Decoder(EngineMessage)
worker_message_decoder = msgspec.msgpack.Decoder(WorkerMessage)
encoder = msgspec.msgpack.Encoder()


def socket_address(runtime_dir: str | Path) -> str:
    return f"ipc://{Path(runtime_dir) / SOCKET_NAME}"


class ZmqEngineTransport:
    """The engine side: a ROUTER socket that knows each worker by its identity."""

    def __init__(self, runtime_dir: str | Path) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(socket_address(runtime_dir))
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)

    def poll(self, timeout_ms: int) -> list[tuple[bytes, EngineMessage]]:
        messages: list[tuple[bytes, EngineMessage]] = []
        if not self._poller.poll(timeout_ms):
            return messages
        while True:
            try:
                identity, payload = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return messages
            try:
                messages.append((identity, engine_message_decoder.decode(payload)))
            except msgspec.DecodeError:
                continue  # not ours; never let a bad frame kill the engine

    def send(self, client_id: bytes, message: WorkerMessage) -> None:
        # A worker that is gone is unroutable (ROUTER_MANDATORY); dropping its outputs is right.
        with contextlib.suppress(zmq.Again, zmq.ZMQError):
            self._sock.send_multipart([client_id, encoder.encode(message)], zmq.NOBLOCK)

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
