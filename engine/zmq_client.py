"""EngineClient for an API worker: talks to the engine core process over ZeroMQ."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
from pathlib import Path

import zmq
import zmq.asyncio

from engine.client import EngineClient
from engine.config import DEFAULT_HEARTBEAT_TIMEOUT_S
from engine.ipc import (
    SOCKET_HWM,
    encoder,
    engine_is_alive,
    heartbeat_age,
    read_ready,
    socket_address,
    worker_message_decoder,
)
from engine.messages import AbortRequest, AddRequest, Hello, SessionCommand

logger = logging.getLogger("hearth.worker")

WATCH_INTERVAL_S = 0.25
OUTBOX_LIMIT = 8_192
"""Frames this worker may have queued for the engine before `add_request` waits for room
(backpressure); aborts never wait, so the queue can briefly exceed it."""


class ZmqEngineClient(EngineClient):
    def __init__(
        self, runtime_dir: str | Path, heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    ) -> None:
        """`heartbeat_timeout_s`: --engine-heartbeat-timeout, from the worker's config."""
        super().__init__()
        self.runtime_dir = Path(runtime_dir)
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.heartbeat_timeout_s = heartbeat_timeout_s
        # NOTE(hardening): every frame goes through this outbox and one sender task that
        # awaits each send, so a full ZeroMQ pipe makes us wait, never drop a frame.
        self._outbox: collections.deque[bytes] = collections.deque()
        self._outbox_ready: asyncio.Event | None = None
        self._outbox_room: asyncio.Event | None = None

    async def start(self) -> None:
        # A context per process, created after gunicorn forked this worker.
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, f"w{os.getpid()}-{id(self):x}".encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, SOCKET_HWM)
        self._sock.setsockopt(zmq.RCVHWM, SOCKET_HWM)
        self._sock.connect(socket_address(self.runtime_dir))
        self._outbox_ready = asyncio.Event()
        self._outbox_room = asyncio.Event()
        self._outbox_room.set()
        self._outbox.append(encoder.encode(Hello()))
        self._outbox_ready.set()
        self._tasks = [
            asyncio.create_task(self._send_loop(), name="hearth-engine-sender"),
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

    def _send(self, message: AddRequest | AbortRequest | SessionCommand) -> None:
        assert self._outbox_ready is not None, "start() first"
        self._outbox.append(encoder.encode(message))
        self._outbox_ready.set()
        if len(self._outbox) >= OUTBOX_LIMIT and self._outbox_room is not None:
            self._outbox_room.clear()

    async def _wait_for_send_room(self) -> None:
        if self._outbox_room is not None:
            await self._outbox_room.wait()

    async def _send_loop(self) -> None:
        """The only sender on the socket: in order, each send awaited (it waits while the
        pipe is at its high-water mark, e.g. during a burst or a stalled engine)."""
        assert self._sock is not None and self._outbox_ready is not None
        assert self._outbox_room is not None
        while True:
            await self._outbox_ready.wait()
            while self._outbox:
                await self._sock.send(self._outbox[0])
                self._outbox.popleft()
                if len(self._outbox) < OUTBOX_LIMIT // 2:
                    self._outbox_room.set()
            self._outbox_ready.clear()

    async def _read_loop(self) -> None:
        assert self._sock is not None
        while True:
            payload = await self._sock.recv()
            try:
                message = worker_message_decoder.decode(payload)
            except Exception:  # a bad frame must not end this loop (and every request)
                logger.exception("dropping an undecodable frame from the engine")
                continue
            try:
                self._dispatch(message)
            except Exception:
                logger.exception("error while dispatching an engine message")

    async def _watch_loop(self) -> None:
        """Readiness, liveness and the heartbeat from the runtime files: cheap, and never
        stuck behind a long engine step. Also checked on demand (`_refresh_state`)."""
        while not self._dead:
            self._refresh_state()
            await asyncio.sleep(WATCH_INTERVAL_S)

    def _refresh_state(self) -> None:
        """A few stat()/flock() calls on the runtime files (microseconds)."""
        if self._dead:
            return
        if self._model_info is None:
            info = read_ready(self.runtime_dir)
            if info is not None:
                self._set_ready(info)
        if not engine_is_alive(self.runtime_dir):
            self._set_dead()
            return
        if self._model_info is not None:
            age = heartbeat_age(self.runtime_dir)
            self._set_stalled(age is not None and age > self.heartbeat_timeout_s)
