"""Fixtures of the reliability tests: an engine-side ZeroMQ endpoint driven by a script
(for the IPC tests), and the runtime files a worker's client reads."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine.config import ModelInfo
from engine.ipc import Heartbeat, ZmqEngineTransport, hold_engine_lock, write_ready
from engine.messages import EngineMessage, WorkerMessage

INFO = ModelInfo(
    model_dir="/nonexistent",
    max_model_len=1024,
    vocab_size=1000,
    eos_token_ids=[2],
    num_kv_blocks=64,
    block_size=16,
)

Handler = Callable[[ZmqEngineTransport, bytes, EngineMessage], None]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class ScriptedEngine:
    """The engine side of the real transport, in a thread: every message goes to
    `handler`; `paused` stops reading (a stalled engine) without closing anything."""

    def __init__(self, runtime_dir: Path, handler: Handler) -> None:
        self.runtime_dir = runtime_dir
        self.handler = handler
        self.transport = ZmqEngineTransport(runtime_dir)
        self.heartbeat = Heartbeat(runtime_dir)
        self.paused = threading.Event()
        self.gone: set[bytes] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.paused.is_set():
                self._stop.wait(0.01)
                continue
            self.heartbeat.loop()
            for client_id, message in self.transport.poll(10):
                self.handler(self.transport, client_id, message)
            self.gone |= self.transport.take_gone_clients()

    def start(self) -> ScriptedEngine:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.heartbeat.close()
        self.transport.close()


@pytest.fixture
def runtime_dir(tmp_path: Path) -> Iterator[Path]:
    """A runtime dir whose engine looks alive (lock held) and ready."""
    fd = hold_engine_lock(tmp_path)
    write_ready(tmp_path, INFO)
    yield tmp_path
    os.close(fd)


@pytest.fixture
def scripted_engine(runtime_dir: Path) -> Iterator[Callable[[Handler], ScriptedEngine]]:
    engines: list[ScriptedEngine] = []

    def make(handler: Handler) -> ScriptedEngine:
        engine = ScriptedEngine(runtime_dir, handler).start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def reply(transport: ZmqEngineTransport, client_id: bytes, message: WorkerMessage) -> None:
    transport.send(client_id, message)
