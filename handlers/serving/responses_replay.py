"""The event stream of a background response, kept in the response store so that any
worker can send it, from any point.

A background response created with ``stream: true`` runs detached from the request that
started it (`BackgroundRuns`), so a client that disconnects stops nothing. Its events go
to the store (`EventLog`, in batches of at most `FLUSH_S`), and every reader reads them
back from there (`follow`): the POST that created it, and ``GET /v1/responses/{id}?stream=
true&starting_after=N`` on any worker, which resumes after event N (OpenAI's way back into
a dropped stream). The store is the only state the API workers share; a per-process queue
would leave a GET on the other worker with nothing to read.

A stream ends with its terminal event (``response.completed`` / ``.incomplete`` /
``.failed``, the last after a failure's ``error``), or, for a response cancelled or gone
from the store, when its stored state says so.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

import orjson

from handlers.serving.response_store import ResponseStore, StoredEvent
from handlers.serving.sse import SSEEvent

FLUSH_S = 0.05
"""Longest a produced event waits before it is written to the store."""
FOLLOW_S = 0.05
"""How often a reader looks for new events."""
SETTLE_S = 2.0
"""How long a reader waits for the last events of a response already stored as final
(they are written just after it)."""
TERMINAL_EVENTS = frozenset(("response.completed", "response.incomplete", "response.failed"))
"""A stream's last event (a failure's `error` is followed by `response.failed`)."""
FINAL_STATUSES = frozenset(("completed", "incomplete", "failed", "cancelled"))


class EventLog:
    """The producer's side: a background response's events, written to the store."""

    def __init__(self, store: ResponseStore, response_id: str) -> None:
        self._store = store
        self._response_id = response_id
        self._pending: list[StoredEvent] = []
        self._since = time.monotonic()

    async def add(self, event: SSEEvent) -> None:
        """Queue `event` (numbered by its own `sequence_number`); write the queue when its
        oldest event has waited `FLUSH_S`."""
        seq = orjson.loads(event.data)["sequence_number"]
        if not self._pending:
            self._since = time.monotonic()
        self._pending.append(StoredEvent(seq, event.name, event.data))
        if event.name in TERMINAL_EVENTS or time.monotonic() - self._since >= FLUSH_S:
            await self.flush()

    async def flush(self) -> None:
        events, self._pending = self._pending, []
        await self._store.append_events(self._response_id, events)


async def follow(
    store: ResponseStore, response_id: str, after: int = -1
) -> AsyncGenerator[SSEEvent, None]:
    """The events of `response_id` after sequence number `after`, as they are written,
    until its terminal event (or its stored state says no more will come)."""
    settle_until: float | None = None
    while True:
        events = await store.events_after(response_id, after)
        for event in events:
            yield SSEEvent(event.name, event.data)
            after = event.seq
            if event.name in TERMINAL_EVENTS:
                return
        if events:
            continue
        stored = await store.get(response_id)
        status = None if stored is None else stored.response.get("status")
        if stored is None or status == "cancelled":
            return
        if status in FINAL_STATUSES:
            last = await store.events_after(response_id, after - 1)
            if last and last[0].name in TERMINAL_EVENTS:
                return  # read from after the end
            settle_until = settle_until or time.monotonic() + SETTLE_S
            if time.monotonic() >= settle_until:
                return
        await asyncio.sleep(FOLLOW_S)
