"""`BackgroundRuns` (handlers/serving/responses_background.py) on its own: a cancel
written to the store stops the run as `cancelled`; shutdown stops every run as
`failed` and waits for them; a run that ends by itself leaves nothing behind."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from handlers.serving import responses_background
from handlers.serving.response_store import ResponseStore
from handlers.serving.responses_background import BackgroundRuns

pytestmark = pytest.mark.anyio


def _store() -> ResponseStore:
    return ResponseStore(None, max_entries=10, max_bytes=1 << 20, ttl_s=60)


async def _put(store: ResponseStore, response_id: str, status: str) -> None:
    await store.put(response_id, orjson.dumps({"id": response_id, "status": status}), [])


async def test_a_cancel_in_the_store_stops_the_run(monkeypatch) -> None:
    monkeypatch.setattr(responses_background, "POLL_S", 0.01)
    store = _store()
    runs = BackgroundRuns(store)
    stopped: list[str] = []
    started = asyncio.Event()

    async def work() -> None:
        started.set()
        await asyncio.sleep(30)

    async def on_stop(reason: str) -> None:
        stopped.append(reason)

    await _put(store, "r1", "in_progress")
    runs.start("r1", work, on_stop)
    await started.wait()
    await _put(store, "r1", "cancelled")
    for _ in range(200):
        if stopped:
            break
        await asyncio.sleep(0.01)
    assert stopped == ["cancelled"] and len(runs) == 0


async def test_shutdown_stops_every_run_as_failed() -> None:
    store = _store()
    runs = BackgroundRuns(store)
    stopped: list[str] = []

    async def work() -> None:
        await asyncio.sleep(30)

    async def on_stop(reason: str) -> None:
        stopped.append(reason)

    for rid in ("a", "b"):
        await _put(store, rid, "in_progress")
        runs.start(rid, work, on_stop)
    await asyncio.sleep(0)
    await runs.shutdown()
    assert stopped == ["failed", "failed"] and len(runs) == 0


async def test_a_run_that_ends_leaves_nothing() -> None:
    runs = BackgroundRuns(_store())
    done = asyncio.Event()

    async def work() -> None:
        done.set()

    async def on_stop(reason: str) -> None:
        raise AssertionError("not stopped")

    runs.start("x", work, on_stop)
    await done.wait()
    await asyncio.sleep(0.01)
    assert len(runs) == 0
