"""Background responses (`background: true`): the POST answers `queued` at once and the
response runs on in this worker; `GET /v1/responses/{id}` reads it from the shared store,
`POST /v1/responses/{id}/cancel` stops it.

Why in the API worker: the run is an ordinary chat run whose caller does not wait; only
its bookkeeping is new. The store is the only state the workers share (a GET or a cancel
may reach another worker), so a cancel is written there (the stored response turns
`cancelled`) and the worker that runs the response polls for it every `POLL_S` and
cancels its task, which aborts the engine requests as a client disconnect does. At
shutdown, runs still going are stopped and stored as `failed`, so no response stays
`in_progress` forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from handlers.serving.response_store import ResponseStore

logger = logging.getLogger(__name__)

POLL_S = 0.25
"""How often a running background response looks for a cancel in the store."""


class BackgroundRuns:
    """The background responses this worker runs: id -> task."""

    def __init__(self, store: ResponseStore) -> None:
        self._store = store
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def __len__(self) -> int:
        return len(self._tasks)

    def start(
        self,
        response_id: str,
        work: Callable[[], Awaitable[None]],
        on_stop: Callable[[str], Awaitable[None]],
    ) -> None:
        """Run `work` detached from the request. When it is cancelled (a cancel in the
        store, or shutdown), `on_stop(reason)` stores the final state: 'cancelled' or
        'failed'."""

        async def run() -> None:
            watcher = asyncio.create_task(self._watch(response_id, task))
            try:
                await work()
            except asyncio.CancelledError:
                reason = "cancelled" if watcher.done() and not watcher.cancelled() else "failed"
                await on_stop(reason)
            except Exception:  # stored as failed by `work` itself; never lost silently
                logger.exception("background response %s failed", response_id)
            finally:
                watcher.cancel()
                self._tasks.pop(response_id, None)

        task = asyncio.create_task(run())
        self._tasks[response_id] = task

    async def _watch(self, response_id: str, task: asyncio.Task[None]) -> None:
        """Cancel `task` once the stored response says `cancelled`; returns then."""
        while True:
            await asyncio.sleep(POLL_S)
            stored = await self._store.get(response_id)
            if stored is not None and stored.response.get("status") == "cancelled":
                task.cancel()
                return

    async def shutdown(self) -> None:
        """Stop every run (each stores itself as failed) and wait for them."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
