"""The stored responses of /v1/responses: bounded in entries, bytes and age, and shared
by the processes of one runtime directory (the API workers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from handlers.serving.response_store import FILE_NAME, ResponseStore

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
