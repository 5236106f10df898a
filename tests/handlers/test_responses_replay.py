"""`EventLog` and `follow` (handlers/serving/responses_replay.py) on a real store: a
reader gets every event written, in order, from any point, while the producer is still
writing; it stops at the terminal event, or when the stored response says no more come."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from handlers.serving import responses_replay
from handlers.serving.response_store import ResponseStore
from handlers.serving.responses_replay import EventLog, follow
from handlers.serving.sse import SSEEvent

pytestmark = pytest.mark.anyio


def _store() -> ResponseStore:
    return ResponseStore(None, max_entries=10, max_bytes=1 << 20, ttl_s=60)


def _event(seq: int, name: str = "response.output_text.delta") -> SSEEvent:
    return SSEEvent(name, orjson.dumps({"type": name, "sequence_number": seq}))


async def _put(store: ResponseStore, status: str) -> None:
    await store.put("r", orjson.dumps({"id": "r", "status": status}), [])


async def _read(reader) -> list[int]:
    return [orjson.loads(e.data)["sequence_number"] async for e in reader]


async def test_a_reader_follows_the_writer_to_the_terminal_event(monkeypatch) -> None:
    monkeypatch.setattr(responses_replay, "FOLLOW_S", 0.005)
    store = _store()
    await _put(store, "in_progress")
    log = EventLog(store, "r")

    async def produce() -> None:
        for seq in range(20):
            await log.add(_event(seq))
            if seq % 5 == 4:
                await log.flush()
                await asyncio.sleep(0.02)
        await log.add(_event(20, "response.completed"))  # written at once, no flush needed

    reader = asyncio.create_task(_read(follow(store, "r")))
    resumed = asyncio.create_task(_read(follow(store, "r", after=7)))
    await produce()
    assert await asyncio.wait_for(reader, 5) == list(range(21))
    assert await asyncio.wait_for(resumed, 5) == list(range(8, 21))
    await _put(store, "completed")
    monkeypatch.setattr(responses_replay, "SETTLE_S", 30.0)
    after_the_end = _read(follow(store, "r", after=20))
    assert await asyncio.wait_for(after_the_end, 1) == [], "after the end: nothing, at once"


async def test_a_cancelled_or_deleted_response_ends_its_readers(monkeypatch) -> None:
    monkeypatch.setattr(responses_replay, "FOLLOW_S", 0.005)
    store = _store()
    await _put(store, "in_progress")
    log = EventLog(store, "r")
    await log.add(_event(0))
    await log.flush()
    reader = asyncio.create_task(_read(follow(store, "r")))
    await asyncio.sleep(0.05)
    assert not reader.done()
    await _put(store, "cancelled")
    assert await asyncio.wait_for(reader, 5) == [0]
    await _put(store, "in_progress")
    reader = asyncio.create_task(_read(follow(store, "r", after=0)))
    await asyncio.sleep(0.05)
    await store.delete("r")
    assert await asyncio.wait_for(reader, 5) == []


async def test_a_final_response_without_its_last_event_ends_after_settling(monkeypatch) -> None:
    """Stored as final (the producer writes the response before its last events): the
    reader waits `SETTLE_S` for them, then stops rather than hang."""
    monkeypatch.setattr(responses_replay, "FOLLOW_S", 0.005)
    monkeypatch.setattr(responses_replay, "SETTLE_S", 0.1)
    store = _store()
    await _put(store, "completed")
    assert await asyncio.wait_for(_read(follow(store, "r")), 5) == []
