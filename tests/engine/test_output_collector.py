"""The per-request output collector and the client's routing into it (no engine, no model)."""

from __future__ import annotations

import asyncio

import pytest

from engine.client import EngineClient
from engine.collector import OutputCollector
from engine.config import ModelInfo
from engine.errors import EngineDeadError, EngineOverloadedError
from engine.messages import (
    AbortRequest,
    AddRequest,
    Admission,
    OutputBatch,
    RequestOutput,
    TokenLogprob,
)
from engine.sampling_params import SamplingParams

INFO = ModelInfo(
    model_dir="/m",
    max_model_len=64,
    vocab_size=100,
    eos_token_ids=[2],
    num_kv_blocks=8,
    block_size=16,
)


class RecordingClient(EngineClient):
    """A client whose transport records what it sends; admission is answered by the test."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[AddRequest | AbortRequest] = []
        self._set_ready(INFO)

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def _send(self, message: AddRequest | AbortRequest) -> None:
        self.sent.append(message)

    def aborted(self) -> list[str]:
        return [rid for m in self.sent if isinstance(m, AbortRequest) for rid in m.request_ids]


def out(rid: str, ids: list[int], finish: str | None = None, **kw: object) -> RequestOutput:
    return RequestOutput(request_id=rid, new_token_ids=ids, finish_reason=finish, **kw)


async def admitted(client: RecordingClient, *rids: str) -> OutputCollector:
    collector = OutputCollector(client)
    tasks = [
        asyncio.create_task(client.add_request(rid, [1], SamplingParams(), collector=collector))
        for rid in rids
    ]
    await asyncio.sleep(0)
    for rid in rids:
        client._dispatch(Admission(request_id=rid, accepted=True))
    assert all(r is collector for r in await asyncio.gather(*tasks))
    return collector


@pytest.mark.anyio
async def test_outputs_merge_on_put_and_keep_their_order() -> None:
    client = RecordingClient()
    collector = await admitted(client, "a", "b")
    lp = [TokenLogprob(token_id=5, logprob=-1.0, rank=1, top=[])]
    client._dispatch(OutputBatch([out("a", [5], new_logprobs=lp, num_prompt_tokens=3)]))
    client._dispatch(OutputBatch([out("b", [7]), out("a", [6], new_logprobs=lp)]))
    client._dispatch(OutputBatch([out("a", [8], "length", new_logprobs=lp)]))
    first = await collector.get()
    assert [(o.request_id, o.new_token_ids) for o in first] == [("a", [5, 6, 8]), ("b", [7])]
    merged = first[0]
    assert merged.finish_reason == "length" and merged.num_prompt_tokens == 3
    assert len(merged.new_logprobs or []) == 3
    assert not collector.finished  # "b" still runs
    assert client.num_in_flight == 1  # "a" finished: the client forgot it
    client._dispatch(OutputBatch([out("b", [], "stop", stop_reason=2)]))
    assert [o.finish_reason for o in await collector.get()] == ["stop"]
    assert collector.finished and client.num_in_flight == 0
    collector.close()
    assert client.aborted() == []  # nothing left to abort


@pytest.mark.anyio
async def test_a_merged_output_still_says_it_ended_on_the_stop_token() -> None:
    """The worker hides the stop token's text on this word: outputs merged while the
    consumer was busy must keep it (the last merged token is the stop token)."""
    client = RecordingClient()
    collector = await admitted(client, "a")
    client._dispatch(OutputBatch([out("a", [5])]))
    client._dispatch(OutputBatch([out("a", [2], "stop", finished_on_stop_token=True)]))
    [merged] = await collector.get()
    assert merged.new_token_ids == [5, 2]
    assert merged.finish_reason == "stop" and merged.finished_on_stop_token


@pytest.mark.anyio
async def test_get_times_out_empty_and_wakes_on_put() -> None:
    client = RecordingClient()
    collector = await admitted(client, "a")
    assert await collector.get(timeout=0.01) == []
    waiter = asyncio.create_task(collector.get())
    await asyncio.sleep(0)
    assert not waiter.done()
    client._dispatch(OutputBatch([out("a", [9])]))
    assert [o.new_token_ids for o in await waiter] == [[9]]


@pytest.mark.anyio
async def test_abort_stops_one_choice_and_close_the_rest() -> None:
    client = RecordingClient()
    collector = await admitted(client, "a", "b", "c")
    client._dispatch(OutputBatch([out("c", [1], "stop")]))
    collector.abort(["a"])
    assert client.aborted() == ["a"]
    client._dispatch(OutputBatch([out("a", [4])]))  # already in flight: dropped
    assert [o.request_id for o in await collector.get()] == ["c"]
    collector.close()
    collector.close()
    assert client.aborted() == ["a", "b"]  # "c" had finished; each abort sent once
    assert client.num_in_flight == 0


@pytest.mark.anyio
async def test_failure_comes_after_the_outputs_before_it() -> None:
    client = RecordingClient()
    collector = await admitted(client, "a")
    client._dispatch(OutputBatch([out("a", [3])]))
    client._set_dead()
    assert [o.new_token_ids for o in await collector.get()] == [[3]]
    with pytest.raises(EngineDeadError):
        await collector.get()


@pytest.mark.anyio
async def test_refused_choice_leaves_nothing_behind() -> None:
    client = RecordingClient()
    collector = OutputCollector(client)
    task = asyncio.create_task(client.add_request("x", [1], SamplingParams(), collector=collector))
    await asyncio.sleep(0)
    client._dispatch(Admission(request_id="x", accepted=False, error_kind="overloaded"))
    with pytest.raises(EngineOverloadedError):
        await task
    assert client.num_in_flight == 0 and collector.finished
    collector.close()
    assert client.aborted() == []


@pytest.mark.anyio
async def test_cancelled_admission_is_aborted() -> None:
    client = RecordingClient()
    task = asyncio.create_task(client.add_request("x", [1], SamplingParams()))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert client.aborted() == ["x"] and client.num_in_flight == 0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
