"""The stored responses of /v1/responses: bounded in entries, bytes and age, and shared
by the processes of one runtime directory (the API workers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from handlers.serving.response_store import FILE_NAME, ResponseStore, StoredEvent

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_put_get_delete() -> None:
    store = ResponseStore(None, max_entries=100, max_bytes=1 << 20, ttl_s=60.0)
    await store.put("resp_1", b'{"id": "resp_1"}', [{"role": "user", "content": "hi"}])
    stored = await store.get("resp_1")
    assert stored is not None
    assert stored.response == {"id": "resp_1"}
    assert stored.messages == [{"role": "user", "content": "hi"}]
    assert await store.get("resp_2") is None
    assert await store.delete("resp_1") is True
    assert await store.delete("resp_1") is False
    assert await store.get("resp_1") is None


async def test_the_oldest_entries_go_beyond_the_entry_bound() -> None:
    clock = Clock()
    store = ResponseStore(None, max_entries=3, max_bytes=1 << 20, ttl_s=60.0, clock=clock)
    for i in range(5):
        clock.now += 1
        await store.put(f"resp_{i}", b"{}", [])
    kept = [i for i in range(5) if await store.get(f"resp_{i}") is not None]
    assert kept == [2, 3, 4]


async def test_the_oldest_entries_go_beyond_the_byte_bound() -> None:
    clock = Clock()
    store = ResponseStore(None, max_entries=100, max_bytes=250, ttl_s=60.0, clock=clock)
    for i in range(4):
        clock.now += 1
        await store.put(f"resp_{i}", b'"' + b"x" * 98 + b'"', [])  # 100 + 2 bytes each
    kept = [i for i in range(4) if await store.get(f"resp_{i}") is not None]
    assert kept == [2, 3]
    await store.put("resp_big", b'"' + b"x" * 300 + b'"', [])
    assert await store.get("resp_big") is None, "an entry over the whole bound is not stored"
    assert await store.get("resp_3") is not None, "and evicts nothing"


async def test_entries_expire() -> None:
    clock = Clock()
    store = ResponseStore(None, max_entries=100, max_bytes=1 << 20, ttl_s=60.0, clock=clock)
    await store.put("resp_old", b"{}", [])
    clock.now += 30
    await store.put("resp_new", b"{}", [])
    clock.now += 31
    assert await store.get("resp_old") is None
    assert await store.delete("resp_old") is False
    assert await store.get("resp_new") is not None


async def test_zero_entries_stores_nothing() -> None:
    store = ResponseStore(None, max_entries=0, max_bytes=1 << 20, ttl_s=60.0)
    assert not store.enabled
    await store.put("resp_1", b"{}", [])
    assert await store.get("resp_1") is None


async def test_processes_of_one_runtime_dir_share_the_store(tmp_path: Path) -> None:
    """What one worker process stores another one reads and deletes."""
    writer = (
        "import asyncio\n"
        "from handlers.serving.response_store import ResponseStore\n"
        f"store = ResponseStore({str(tmp_path)!r}, max_entries=10, max_bytes=1 << 20,"
        " ttl_s=60.0)\n"
        "asyncio.run(store.put('resp_other', b'{\"id\": \"resp_other\"}',"
        " [{'role': 'user', 'content': 'from another process'}]))\n"
    )
    subprocess.run(
        [sys.executable, "-c", writer], check=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT)}
    )
    assert (tmp_path / FILE_NAME).exists()
    store = ResponseStore(str(tmp_path), max_entries=10, max_bytes=1 << 20, ttl_s=60.0)
    stored = await store.get("resp_other")
    assert stored is not None and stored.messages[0]["content"] == "from another process"
    await store.put("resp_mine", b"{}", [])
    reader = (
        "import asyncio\n"
        "from handlers.serving.response_store import ResponseStore\n"
        f"store = ResponseStore({str(tmp_path)!r}, max_entries=10, max_bytes=1 << 20,"
        " ttl_s=60.0)\n"
        "print(asyncio.run(store.delete('resp_mine')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", reader],
        check=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    assert out.stdout.strip() == "True"
    assert await store.get("resp_mine") is None


def _events(seqs: range, size: int = 10) -> list[StoredEvent]:
    return [StoredEvent(i, "response.output_text.delta", b"x" * size) for i in seqs]


async def test_a_responses_stream_events_are_kept_in_order_and_go_with_it() -> None:
    store = ResponseStore(None, max_entries=100, max_bytes=1 << 20, ttl_s=60.0)
    await store.append_events("resp_0", _events(range(3)))
    assert await store.events_after("resp_0", -1) == [], "no entry: nothing kept"
    await store.put("resp_0", b"{}", [])
    await store.append_events("resp_0", _events(range(3, 6)))
    await store.append_events("resp_0", _events(range(0, 3)))
    assert [e.seq for e in await store.events_after("resp_0", -1)] == [0, 1, 2, 3, 4, 5]
    assert [e.seq for e in await store.events_after("resp_0", 3)] == [4, 5]
    await store.put("resp_0", b'{"status": "completed"}', [])  # the final state: events stay
    assert len(await store.events_after("resp_0", -1)) == 6
    assert await store.delete("resp_0")
    assert await store.events_after("resp_0", -1) == []


async def test_stream_events_count_in_the_byte_bound() -> None:
    """A streamed response's events grow its entry: past the bound the oldest entry goes,
    events and all; its later `put`s keep counting them."""
    clock = Clock()
    store = ResponseStore(None, max_entries=100, max_bytes=600, ttl_s=60.0, clock=clock)
    await store.put("resp_old", b"{}", [])  # 4 bytes (response + messages)
    clock.now += 1
    await store.put("resp_new", b"{}", [])
    await store.append_events("resp_old", _events(range(2), size=100))
    await store.append_events("resp_new", _events(range(2), size=100))  # 2 x (4 + 2 x 126)
    assert await store.get("resp_old") is not None
    await store.put("resp_new", b"{}", [])  # still 256 bytes with its events
    await store.append_events("resp_new", _events(range(2, 4), size=100))
    assert await store.get("resp_old") is None, "the oldest entry went"
    assert await store.events_after("resp_old", -1) == [], "with its events"
    assert [e.seq for e in await store.events_after("resp_new", -1)] == [0, 1, 2, 3]


async def test_an_expired_entrys_events_go_with_it() -> None:
    clock = Clock()
    store = ResponseStore(None, max_entries=100, max_bytes=1 << 20, ttl_s=60.0, clock=clock)
    await store.put("resp_old", b"{}", [])
    await store.append_events("resp_old", _events(range(3)))
    assert await store.has_events("resp_old")
    clock.now += 61
    await store.put("resp_new", b"{}", [])  # a write purges what expired
    assert not await store.has_events("resp_old")
    assert await store.events_after("resp_old", -1) == []
