"""The stored Responses (`store: true`), shared by every API worker of one server.

`GET /v1/responses/{id}` and `previous_response_id` may reach any of the uvicorn worker
processes, so a per-process dict would answer 404 half of the time. The store is one
SQLite file in the server's runtime directory (`ServerConfig.runtime_dir`, made per run
by `hearth serve` and removed when it exits):

- SQLite does the cross-process locking and atomic writes (stdlib, no new dependency);
- the engine process stays what it is, tokens in and tokens out: holding conversations
  there would add message types to the IPC and Python work to the loop that runs the
  model, for data the engine never reads;
- a worker that restarts finds the store as it was.

It is bounded three ways, each checked on every write: entries (`--responses-store-
max-entries`, 0 turns storing off), total bytes (`--responses-store-max-bytes`) and age
(`--responses-store-ttl`); the oldest entries go first. Without a runtime directory
(the Lambda entry, tests) the database lives in this process's memory. Calls run in a
thread: a large conversation is a few ms of SQLite work that the event loop should not
wait on.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

logger = logging.getLogger(__name__)

FILE_NAME = "responses.sqlite3"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    stored_at REAL NOT NULL,
    size INTEGER NOT NULL,
    response BLOB NOT NULL,
    messages BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS response_events (
    response_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    name TEXT NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (response_id, seq)
);
"""
_DROP_EVENTS = "DELETE FROM response_events WHERE response_id = ?"
"""An entry's stream events go with it (expired, evicted or deleted): by its id, on the
table's (response_id, seq) key, never a scan of every stored event."""


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """One event of a background response's stream, as it was sent."""

    seq: int
    """Its `sequence_number`."""
    name: str
    data: bytes


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]
    """The response object as it was sent."""
    messages: list[dict[str, Any]]
    """The conversation up to and including this response's output, as chat messages
    (without `instructions`, which OpenAI does not carry over to the next response)."""


class ResponseStore:
    """A bounded, expiring map of response id -> StoredResponse over SQLite."""

    def __init__(
        self,
        runtime_dir: str | None,
        *,
        max_entries: int,
        max_bytes: int,
        ttl_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._path = str(Path(runtime_dir) / FILE_NAME) if runtime_dir else ":memory:"
        self._clock = clock
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    # -- async API --------------------------------------------------------------------
    async def put(self, response_id: str, response: bytes, messages: list[dict[str, Any]]) -> None:
        if self.enabled:
            await asyncio.to_thread(self._put, response_id, response, orjson.dumps(messages))

    async def get(self, response_id: str) -> StoredResponse | None:
        if not self.enabled:
            return None
        return await asyncio.to_thread(self._get, response_id)

    async def delete(self, response_id: str) -> bool:
        if not self.enabled:
            return False
        return await asyncio.to_thread(self._delete, response_id)

    async def append_events(self, response_id: str, events: list[StoredEvent]) -> None:
        """Add stream events of a stored response (a background one streamed); their bytes
        count in its entry's size, so the store's bounds hold the log too. Nothing is
        kept for an entry that is gone."""
        if self.enabled and events:
            await asyncio.to_thread(self._append_events, response_id, events)

    async def has_events(self, response_id: str) -> bool:
        """Whether `response_id` keeps a stream (a background response created streamed)."""
        return self.enabled and await asyncio.to_thread(self._has_events, response_id)

    async def events_after(self, response_id: str, after: int) -> list[StoredEvent]:
        """The stored events of `response_id` with a sequence number above `after`, in order."""
        if not self.enabled:
            return []
        return await asyncio.to_thread(self._events_after, response_id, after)

    # -- SQLite, in a worker thread ---------------------------------------------------
    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            db = sqlite3.connect(
                self._path, timeout=10.0, isolation_level=None, check_same_thread=False
            )
            if self._path != ":memory:":
                db.execute("PRAGMA journal_mode=WAL")
            db.executescript(_SCHEMA)
            self._db = db
        return self._db

    def _put(self, response_id: str, response: bytes, messages: bytes) -> None:
        size = len(response) + len(messages)
        if size > self.max_bytes:
            logger.warning(
                "response %s not stored: %d bytes is more than --responses-store-max-bytes",
                response_id,
                size,
            )
            return
        now = self._clock()
        with self._lock:
            db = self._connection()
            db.execute("BEGIN IMMEDIATE")
            try:
                expired = db.execute(
                    "SELECT id FROM responses WHERE stored_at < ?", (now - self.ttl_s,)
                ).fetchall()
                db.executemany(_DROP_EVENTS, expired)
                db.execute("DELETE FROM responses WHERE stored_at < ?", (now - self.ttl_s,))
                (logged,) = db.execute(
                    "SELECT COALESCE(SUM(LENGTH(name) + LENGTH(data)), 0) FROM response_events "
                    "WHERE response_id = ?",
                    (response_id,),
                ).fetchone()  # a background response's stream so far: still counted
                db.execute(
                    "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                    (response_id, now, size + logged, response, messages),
                )
                self._evict(db)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def _append_events(self, response_id: str, events: list[StoredEvent]) -> None:
        size = sum(len(e.name) + len(e.data) for e in events)
        with self._lock:
            db = self._connection()
            db.execute("BEGIN IMMEDIATE")
            try:
                cursor = db.execute(
                    "UPDATE responses SET size = size + ? WHERE id = ?", (size, response_id)
                )
                if cursor.rowcount:
                    db.executemany(
                        "INSERT OR REPLACE INTO response_events VALUES (?, ?, ?, ?)",
                        [(response_id, e.seq, e.name, e.data) for e in events],
                    )
                    self._evict(db)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def _has_events(self, response_id: str) -> bool:
        with self._lock:
            row = (
                self._connection()
                .execute(
                    "SELECT 1 FROM response_events WHERE response_id = ? LIMIT 1", (response_id,)
                )
                .fetchone()
            )
        return row is not None

    def _events_after(self, response_id: str, after: int) -> list[StoredEvent]:
        with self._lock:
            rows = (
                self._connection()
                .execute(
                    "SELECT seq, name, data FROM response_events WHERE response_id = ? AND "
                    "seq > ? ORDER BY seq",
                    (response_id, after),
                )
                .fetchall()
            )
        return [StoredEvent(seq, name, bytes(data)) for seq, name, data in rows]

    def _evict(self, db: sqlite3.Connection) -> None:
        """Oldest first, until both the entry and the byte bounds hold."""
        count, total = db.execute(
            "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses"
        ).fetchone()
        while count > self.max_entries or total > self.max_bytes:
            row = db.execute(
                "SELECT id, size FROM responses ORDER BY stored_at, rowid LIMIT 1"
            ).fetchone()
            db.execute("DELETE FROM responses WHERE id = ?", (row[0],))
            db.execute(_DROP_EVENTS, (row[0],))
            count, total = count - 1, total - row[1]

    def _get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = (
                self._connection()
                .execute(
                    "SELECT response, messages FROM responses WHERE id = ? AND stored_at >= ?",
                    (response_id, self._clock() - self.ttl_s),
                )
                .fetchone()
            )
        if row is None:
            return None
        return StoredResponse(orjson.loads(row[0]), orjson.loads(row[1]))

    def _delete(self, response_id: str) -> bool:
        with self._lock:
            db = self._connection()
            cursor = db.execute(
                "DELETE FROM responses WHERE id = ? AND stored_at >= ?",
                (response_id, self._clock() - self.ttl_s),
            )
            db.execute(_DROP_EVENTS, (response_id,))
        return cursor.rowcount > 0
