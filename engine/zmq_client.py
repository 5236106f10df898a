"""EngineClient for an API worker: talks to the engine core process over ZeroMQ."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import zmq
import zmq.asyncio

from engine.client import EngineClient
from engine.ipc import (
    ENV_RUNTIME_DIR,
    encoder,
    engine_is_alive,
    read_ready,
    socket_address,
    worker_message_decoder,
)
from engine.messages import AbortRequest, AddRequest, Hello

WATCH_INTERVAL_S = 0.25


class ZmqEngineClient(EngineClient):
    def __init__(self, runtime_dir: str | Path) -> None:
        super().__init__()
        self.runtime_dir = Path(runtime_dir)
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    def from_env(cls) -> ZmqEngineClient:
        runtime_dir = os.environ.get(ENV_RUNTIME_DIR)
        if not runtime_dir:
            raise RuntimeError(
                f"{ENV_RUNTIME_DIR} is not set: start the server with `hearth serve`"
            )
        return cls(runtime_dir)

    async def start(self) -> None:
        # A context per process, created after gunicorn forked this worker.
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, f"w{os.getpid()}-{id(self):x}".encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(socket_address(self.runtime_dir))
        self._sock.send(encoder.encode(Hello()))
        self._tasks = [
            asyncio.create_task(self._read_loop(), name="hearth-engine-reader"),
            asyncio.create_task(self._watch_loop(), name="hearth-engine-watchdog"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._sock is not None:
            self._sock.close(0)
        if self._ctx is not None:
            self._ctx.term()

    def _send(self, message: AddRequest | AbortRequest) -> None:
        assert self._sock is not None, "start() first"
        # DEALER send never blocks for long: the engine drains between steps.
        self._sock.send(encoder.encode(message), zmq.NOBLOCK)

    async def _read_loop(self) -> None:
        assert self._sock is not None
        while True:
            payload = await self._sock.recv()
            self._dispatch(worker_message_decoder.decode(payload))

    async def _watch_loop(self) -> None:
        """Readiness and liveness from the runtime files: cheap, and never stuck
        behind a long engine step."""
        while True:
            if self._model_info is None:
                info = read_ready(self.runtime_dir)
                if info is not None:
                    self._set_ready(info)
            if not engine_is_alive(self.runtime_dir):
                self._set_dead()
                return
            await asyncio.sleep(WATCH_INTERVAL_S)
