"""The gunicorn worker class: uvicorn-worker plus the graceful-shutdown window.

uvicorn-worker does not pass gunicorn's graceful_timeout to uvicorn, whose
`timeout_graceful_shutdown` then stays None. On SIGTERM uvicorn 0.54 closes its
listening socket, closes idle keep-alive connections, marks busy ones `keep_alive =
False` so that the response in progress (an SSE stream included) runs to its end, and
waits for them; with a window set, it cancels what is still running once the window is
over. We set the window 2 s short of gunicorn's graceful_timeout, so uvicorn ends the
leftovers itself (and runs the app's lifespan shutdown) before gunicorn's SIGKILL at
graceful_timeout; `hearth serve --timeout-graceful-shutdown` (default 20 s, inside
SageMaker's 30 s between SIGTERM and SIGKILL) sets both.

A stream still running when the window closes would be cut mid-response. Shortly
before that, the worker ends every in-flight engine stream with a "shutting down"
error, so the client gets an error chunk and `data: [DONE]` instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from typing import Any

from gunicorn.arbiter import Arbiter
from uvicorn.server import Server
from uvicorn_worker import UvicornWorker

from engine.client import live_clients
from engine.errors import EngineShuttingDownError

SIGKILL_MARGIN_S = 2
STREAM_END_MARGIN_S = 1.5
"""Seconds before uvicorn's deadline at which in-flight streams are ended cleanly."""

logger = logging.getLogger("hearth")


class HearthUvicornWorker(UvicornWorker):
    CONFIG_KWARGS: dict[str, Any] = {"loop": "auto", "http": "auto", "lifespan": "on"}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Leave gunicorn's own SIGKILL a margin after uvicorn's deadline.
        self.config.timeout_graceful_shutdown = max(self.cfg.graceful_timeout - SIGKILL_MARGIN_S, 1)

    async def _serve(self) -> None:
        # uvicorn-worker's own _serve, plus the watcher that ends streams at the deadline.
        self.config.app = self.wsgi
        server = Server(config=self.config)
        self._install_sigquit_handler()
        watcher = asyncio.create_task(self._end_streams_before_deadline(server))
        try:
            await server.serve(sockets=self.sockets)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        if not server.started:
            sys.exit(Arbiter.WORKER_BOOT_ERROR)

    async def _end_streams_before_deadline(self, server: Server) -> None:
        while not server.should_exit:
            await asyncio.sleep(0.1)
        window = self.config.timeout_graceful_shutdown or 0
        await asyncio.sleep(max(window - STREAM_END_MARGIN_S, 0))
        error = EngineShuttingDownError(
            "The server is shutting down and its drain deadline has come; retry the request."
        )
        ended = sum(client.fail_in_flight(error) for client in live_clients())
        if ended:
            logger.warning("drain deadline: ended %d in-flight stream(s) with an error", ended)
