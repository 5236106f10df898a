"""EngineClient that runs the engine core in a thread of this process.

Used by the Lambda handler (one process, no gunicorn) and by tests. The core thread
loads the model, warms up and then runs the same busy loop as the core process;
messages cross the thread boundary through a queue one way and
`loop.call_soon_threadsafe` the other.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading

from engine.client import EngineClient, EngineCommand
from engine.config import EngineConfig
from engine.messages import EngineMessage, WorkerMessage

logger = logging.getLogger("hearth.engine")

_CLIENT_ID = b"inproc"


class _QueueTransport:
    def __init__(self, client: InprocEngineClient, loop: asyncio.AbstractEventLoop) -> None:
        self.inbox: queue.SimpleQueue[EngineMessage] = queue.SimpleQueue()
        self._client = client
        self._loop = loop

    def poll(self, timeout_ms: int) -> list[tuple[bytes, EngineMessage]]:
        messages: list[tuple[bytes, EngineMessage]] = []
        try:
            first = (
                self.inbox.get(timeout=timeout_ms / 1000) if timeout_ms else self.inbox.get_nowait()
            )
        except queue.Empty:
            return messages
        messages.append((_CLIENT_ID, first))
        while True:
            try:
                messages.append((_CLIENT_ID, self.inbox.get_nowait()))
            except queue.Empty:
                return messages

    def send(self, client_id: bytes, message: WorkerMessage) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._client._dispatch, message)

    def take_gone_clients(self) -> set[bytes]:
        return set()  # the one client lives as long as this process


class InprocEngineClient(EngineClient):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self.config = config
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._transport: _QueueTransport | None = None
        self.error: BaseException | None = None
        self.core = None  # the EngineCore, for tests that inspect the block pool

    async def start(self) -> None:
        if self._thread is not None:
            return
        loop = asyncio.get_running_loop()
        self._transport = _QueueTransport(self, loop)
        self._thread = threading.Thread(
            target=self._run, args=(loop,), name="hearth-engine-core", daemon=True
        )
        self._thread.start()

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        from engine.core import EngineCore
        from engine.core_loop import run_engine_loop

        try:
            core = EngineCore(self.config)
            core.structured.start()  # the grammar compile children load during warm-up
            core.warm_up()
            self.core = core
            loop.call_soon_threadsafe(self._set_ready, core.model_info)
            assert self._transport is not None
            run_engine_loop(
                core, self._transport, self._stop, log_stats=not self.config.disable_log_stats
            )
        except BaseException as exc:  # the thread is the engine: report, never vanish
            logger.exception("in-process engine core failed")
            self.error = exc
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._set_dead)

    def _send(self, message: EngineCommand) -> None:
        assert self._transport is not None, "start() first"
        self._transport.inbox.put(message)

    async def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
