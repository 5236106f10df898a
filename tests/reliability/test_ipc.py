"""The worker <-> engine transport under load and faults (issue 8, items 1, 2, 4, 9):
real ZeroMQ sockets on an ipc:// path, the real worker client, an engine side driven by
a script. No model: these run in seconds."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import zmq

from engine.collector import OutputCollector
from engine.errors import EngineOverloadedError
from engine.ipc import (
    HEARTBEAT_NAME,
    ZmqEngineTransport,
    encoder,
    hold_engine_lock,
    socket_address,
    worker_message_decoder,
    write_ready,
)
from engine.messages import (
    AbortRequest,
    AddRequest,
    Admission,
    EngineMessage,
    Hello,
    OutputBatch,
    RequestOutput,
)
from engine.sampling_params import SamplingParams
from engine.zmq_client import ZmqEngineClient
from tests.reliability.conftest import INFO

pytestmark = pytest.mark.anyio

PARAMS = SamplingParams(max_tokens=1)


def admit_and_finish(transport: ZmqEngineTransport, client_id: bytes, msg: EngineMessage) -> None:
    if isinstance(msg, AddRequest):
        transport.send(client_id, Admission(request_id=msg.request_id, accepted=True))
        out = RequestOutput(request_id=msg.request_id, new_token_ids=[7], finish_reason="length")
        transport.send(client_id, OutputBatch([out]))


async def drain(collector: OutputCollector) -> list[RequestOutput]:
    """Every output of an admitted request, merged as the collector hands them out."""
    outputs: list[RequestOutput] = []
    while not collector.finished:
        outputs += await collector.get()
    return outputs


async def connected_client(runtime_dir: Path) -> ZmqEngineClient:
    client = ZmqEngineClient(runtime_dir)
    await client.start()
    await client.wait_ready(10)
    return client


async def test_a_burst_of_4096_requests_is_neither_dropped_nor_hung(
    runtime_dir: Path, scripted_engine
) -> None:
    """Item 1: one /v1/completions of 256 prompts x n=16 is 4096 AddRequests in one tick.
    With non-blocking sends past ZeroMQ's high-water mark, ~700 were dropped and their
    HTTP request waited forever. Now every one is admitted and finishes."""
    engine = scripted_engine(admit_and_finish)
    client = await connected_client(runtime_dir)
    try:
        async with asyncio.timeout(120):
            engine.paused.set()  # busy with a long step while the burst arrives
            await asyncio.sleep(0.1)
            burst = asyncio.gather(
                *(client.add_request(f"r{i}", [1, 2, 3], PARAMS) for i in range(4096))
            )
            await asyncio.sleep(0.5)
            engine.paused.clear()
            collectors = await burst
            outputs = [await drain(collector) for collector in collectors]
        assert [out[-1].finish_reason for out in outputs] == ["length"] * 4096
        assert client.num_in_flight == 0
    finally:
        await client.close()


def test_frames_for_a_worker_that_does_not_read_are_kept_in_order(tmp_path: Path) -> None:
    """Item 1, engine side: a stalled (SIGSTOPped, busy) worker's outputs wait in the
    engine's per-worker queue instead of being dropped at the high-water mark."""
    transport = ZmqEngineTransport(tmp_path)
    ctx = zmq.Context()
    worker = ctx.socket(zmq.DEALER)
    worker.setsockopt(zmq.IDENTITY, b"slow")
    worker.setsockopt(zmq.RCVHWM, 10)
    worker.connect(socket_address(tmp_path))
    try:
        worker.send(encoder.encode(Hello()))
        deadline = time.monotonic() + 10
        while not transport.poll(50) and time.monotonic() < deadline:
            pass
        total = 30_000  # beyond both high-water marks together
        for i in range(total):
            transport.send(b"slow", Admission(request_id=str(i), accepted=True))
        received: list[str] = []
        deadline = time.monotonic() + 60
        while len(received) < total and time.monotonic() < deadline:
            transport.poll(0)  # flushes what waits for this worker
            while worker.poll(10):
                message = worker_message_decoder.decode(worker.recv())
                assert isinstance(message, Admission)
                received.append(message.request_id)
        assert received == [str(i) for i in range(total)]
        assert transport.take_gone_clients() == set()
    finally:
        worker.close(0)
        ctx.term()
        transport.close()


async def test_admission_that_never_comes_is_a_503_and_an_abort(
    runtime_dir: Path, scripted_engine
) -> None:
    """Item 1: an admission lost or stuck behind a stalled engine ends in a clean 503
    (EngineOverloadedError) after the admission timeout, and the engine is told to drop it."""
    seen: list[EngineMessage] = []
    scripted_engine(lambda _t, _c, msg: seen.append(msg))
    client = await connected_client(runtime_dir)
    client.admission_timeout_s = 0.5
    try:
        async with asyncio.timeout(10):
            with pytest.raises(EngineOverloadedError, match="did not admit"):
                await client.add_request("lost", [1, 2], PARAMS)
            while not any(isinstance(m, AbortRequest) for m in seen):
                await asyncio.sleep(0.02)
        assert [type(m).__name__ for m in seen if not isinstance(m, Hello)] == [
            "AddRequest",
            "AbortRequest",
        ]
        assert client.num_in_flight == 0
    finally:
        await client.close()


def test_malformed_frames_do_not_kill_the_engine(tmp_path: Path) -> None:
    """Item 9: the engine unpacked exactly two frames; a three-frame message (or any
    garbage) raised in the busy loop and took every request down."""
    transport = ZmqEngineTransport(tmp_path)
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.connect(socket_address(tmp_path))
    try:
        rogue.send_multipart([b"one", b"two"])  # the ROUTER sees three frames
        rogue.send(b"\xff\x00not msgpack")
        rogue.send(encoder.encode(Hello()))
        messages: list[EngineMessage] = []
        deadline = time.monotonic() + 10
        while not messages and time.monotonic() < deadline:
            messages += [m for _, m in transport.poll(50)]
        assert messages == [Hello()]
    finally:
        rogue.close(0)
        ctx.term()
        transport.close()


def test_a_dead_worker_is_reported_once(tmp_path: Path) -> None:
    """Item 2: a worker that died is unroutable; the transport reports it so the engine
    aborts its requests (instead of generating for nobody until max_tokens)."""
    transport = ZmqEngineTransport(tmp_path)
    ctx = zmq.Context()
    worker = ctx.socket(zmq.DEALER)
    worker.setsockopt(zmq.IDENTITY, b"w-dead")
    worker.connect(socket_address(tmp_path))
    try:
        worker.send(encoder.encode(Hello()))
        deadline = time.monotonic() + 10
        while not transport.poll(50) and time.monotonic() < deadline:
            pass
        worker.close(0)
        gone: set[bytes] = set()
        deadline = time.monotonic() + 10
        while not gone and time.monotonic() < deadline:
            transport.send(b"w-dead", OutputBatch([]))
            gone = transport.take_gone_clients()
            time.sleep(0.02)
        assert gone == {b"w-dead"}
        transport.send(b"w-dead", OutputBatch([]))
        assert transport.take_gone_clients() == set()  # reported once, then ignored
    finally:
        ctx.term()
        transport.close()


async def test_a_garbage_frame_does_not_end_the_workers_reader(
    runtime_dir: Path, scripted_engine
) -> None:
    """Item 9: one undecodable frame raised in the worker's read loop, which died
    silently; every later request of that worker then waited forever."""

    def garbage_first(transport: ZmqEngineTransport, client_id: bytes, msg: EngineMessage) -> None:
        if isinstance(msg, AddRequest):
            transport._sock.send_multipart([client_id, b"\xff\x00garbage"])
        admit_and_finish(transport, client_id, msg)

    scripted_engine(garbage_first)
    client = await connected_client(runtime_dir)
    try:
        async with asyncio.timeout(10):
            for rid in ("a", "b"):
                collector = await client.add_request(rid, [1], PARAMS)
                assert [o.finish_reason for o in await drain(collector)] == ["length"]
    finally:
        await client.close()


async def test_a_stalled_engine_is_unhealthy_and_fails_waiting_requests(
    runtime_dir: Path, scripted_engine
) -> None:
    """Item 4: liveness was only "holds the lock file", so a hung engine kept /ping 200
    while every request waited. A stale heartbeat now makes the client not ready (503
    on /ping and /health), fails waiting requests with a 503, and clears when the
    engine beats again."""
    engine = scripted_engine(admit_and_finish)
    client = await connected_client(runtime_dir)
    client.heartbeat_timeout_s = 1.0
    try:
        async with asyncio.timeout(30):
            engine.paused.set()
            await asyncio.sleep(0.1)  # let its current poll end
            pending = asyncio.create_task(client.add_request("stuck", [1], PARAMS))
            with pytest.raises(EngineOverloadedError, match="heartbeat"):
                await pending
            assert not client.is_ready() and client.is_dead()
            with pytest.raises(EngineOverloadedError):
                await client.add_request("refused", [1], PARAMS)
            engine.paused.clear()
            while not client.is_ready():
                await asyncio.sleep(0.05)
            assert not client.is_dead()
            collector = await client.add_request("after", [1], PARAMS)
            assert [o.finish_reason for o in await drain(collector)] == ["length"]
    finally:
        await client.close()


def test_every_worker_answers_from_the_runtime_files_at_once(tmp_path: Path) -> None:
    """Two API workers polled the runtime files on their own 0.25 s timers, so right
    after start-up (or an engine resuming) one answered /ping 200 and the other 503 "still
    loading" for a poll interval, and CI caught a request in that gap. The clients here
    never start their watch loops: whatever they report comes from reading the files
    when asked, so both agree the moment a file changes."""
    assert ZmqEngineClient(tmp_path).is_dead(), "no engine holds the lock"
    fd = hold_engine_lock(tmp_path)
    try:
        fresh = [ZmqEngineClient(tmp_path), ZmqEngineClient(tmp_path)]
        assert [(w.is_dead(), w.is_ready(), w.model_info) for w in fresh] == [
            (False, False, None)
        ] * 2
        write_ready(tmp_path, INFO)
        assert [w.is_ready() for w in fresh] == [True, True]
        assert [w.model_info for w in fresh] == [INFO, INFO]
        heartbeat = tmp_path / HEARTBEAT_NAME
        heartbeat.touch()
        stale = time.time() - 60
        os.utime(heartbeat, (stale, stale))
        assert [(w.is_ready(), w.is_dead()) for w in fresh] == [(False, True)] * 2
        heartbeat.touch()
        assert [(w.is_ready(), w.is_dead()) for w in fresh] == [(True, False)] * 2
    finally:
        os.close(fd)
