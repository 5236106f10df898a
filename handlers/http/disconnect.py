"""Cancel a request's handling the moment its client goes away (ASGI `http.disconnect`).

Falcon reads `receive` only for the body (and, for `resp.sse`, between events), so
without help a client that leaves during a long prefill, a queue wait or a
non-streaming generation is noticed only when the next write happens, which for a
non-streaming request is the very end. This wrapper owns `receive`: one watcher task
reads it for the whole request and hands the body messages on to the app, and when
`http.disconnect` arrives before the response is complete it cancels the app's task.
The cancellation lands in whatever the serving code awaits (normally the output
collector), and its `finally` aborts the engine requests, which frees their KV blocks
within one engine step (docs/architecture.md, "Disconnects").

This replaces SSE keep-alive comments as the way to notice a gone client, so streams
carry no comment lines unless `--sse-keep-alive-interval` asks for them (some clients,
`vllm bench serve` among them, mis-parse comments).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class _Watch:
    """The state shared by the watcher, the app's receive/send and the caller."""

    __slots__ = ("complete", "disconnected", "inbox")

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.complete = False
        """The app sent the last body message: a disconnect now is the normal end."""
        self.disconnected = False


class CancelOnDisconnect:
    """ASGI middleware: HTTP requests run in a task that a client disconnect cancels."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    def __getattr__(self, name: str) -> Any:
        # The wrapped Falcon app's attributes (add_route, ...) stay reachable.
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        watch = _Watch()

        async def app_send(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                watch.complete = True
            await send(message)

        app_task = asyncio.create_task(self.app(scope, watch.inbox.get, app_send))
        watcher = asyncio.create_task(_watch(receive, watch, app_task))
        try:
            await app_task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not watch.disconnected or (current is not None and current.cancelling()):
                raise  # cancelled from outside (server shutdown), not by the client
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher


async def _watch(receive: Receive, watch: _Watch, app_task: asyncio.Task[None]) -> None:
    while True:
        message = await receive()
        watch.inbox.put_nowait(message)
        if message["type"] == "http.disconnect":
            if not watch.complete:
                watch.disconnected = True
                app_task.cancel()
            return
