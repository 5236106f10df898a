"""Faults inside the engine core (issue 8, items 2, 5, 6), on the real default model in
this process: a failing step, a dead worker's requests, queue operations under bursts."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest

from engine import waiting_queue
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.messages import AddRequest
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def core(model_smollm2_dir: str) -> Any:
    from engine.core import EngineCore

    # One sequence at a time: a second request waits while the first one runs.
    return EngineCore(
        EngineConfig(
            model=model_smollm2_dir, max_model_len=256, max_num_seqs=1, kv_cache_memory=32 << 20
        )
    )


def _add(core: Any, rid: str, client_id: bytes = b"w") -> None:
    msg = AddRequest(request_id=rid, prompt_token_ids=[1, 2, 3, 4, 5], params=GREEDY)
    assert core.add_request(msg, client_id).accepted


def _drain(core: Any) -> dict[str, list[Any]]:
    outputs: dict[str, list[Any]] = {}
    while core.has_work():
        for _, out in core.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


@pytest.mark.slow
def test_a_failing_step_fails_only_its_own_requests(core: Any, monkeypatch) -> None:
    """Item 5: an exception in one step (an OOM on a big prefill, a sampler bug) ended
    the engine and every request. Now only that step's requests end with 'error', their
    blocks are freed, and the waiting request runs to its end."""
    real_execute = core.runner.execute
    calls = {"n": 0}

    def flaky(scheduled: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real_execute(scheduled)

    monkeypatch.setattr(core.runner, "execute", flaky)
    _add(core, "first")
    _add(core, "second")
    failed = core.step()
    assert [(cid, out.request_id, out.finish_reason) for cid, out in failed] == [
        (b"w", "first", "error")
    ]
    assert "RuntimeError" in (failed[0][1].error or "")
    assert "out of memory" not in (failed[0][1].error or "")  # no internals to clients
    rest = _drain(core)
    assert list(rest) == ["second"]
    assert rest["second"][-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in rest["second"]) == 4
    assert core.block_manager.num_used_blocks == 0
    assert core.num_consecutive_step_failures == 0


@pytest.mark.slow
def test_failures_in_a_row_stop_the_engine(core: Any, monkeypatch) -> None:
    """Item 5, crash-loop protection: a step that always fails is a broken engine; after
    MAX_CONSECUTIVE_STEP_FAILURES it raises (the process exits, the platform restarts it)."""
    from engine.core import MAX_CONSECUTIVE_STEP_FAILURES

    def broken(scheduled: Any) -> Any:
        raise RuntimeError("broken")

    monkeypatch.setattr(core.runner, "execute", broken)
    for i in range(MAX_CONSECUTIVE_STEP_FAILURES + 1):
        _add(core, f"doomed-{i}")
    for _ in range(MAX_CONSECUTIVE_STEP_FAILURES - 1):
        assert [out.finish_reason for _, out in core.step()] == ["error"]
    with pytest.raises(RuntimeError, match="broken"):
        core.step()
    monkeypatch.undo()
    core.abort([f"doomed-{i}" for i in range(MAX_CONSECUTIVE_STEP_FAILURES + 1)])
    core.num_consecutive_step_failures = 0
    assert not core.has_work() and core.block_manager.num_used_blocks == 0


@pytest.mark.slow
def test_a_dead_workers_requests_are_aborted(core: Any) -> None:
    """Item 2: the engine kept generating a dead worker's requests to max_tokens. Aborting
    by worker frees exactly that worker's requests and blocks."""
    _add(core, "mine-1", b"alive")
    _add(core, "theirs-1", b"dead")
    _add(core, "theirs-2", b"dead")
    core.step()  # mine-1 runs and holds blocks
    assert core.abort_client(b"dead") == 2
    assert core.abort_client(b"dead") == 0
    assert list(_drain(core)) == ["mine-1"]
    assert core.block_manager.num_used_blocks == 0


@pytest.mark.slow
def test_stop_token_ids_stop_with_a_set(core: Any) -> None:
    """Item 6: stop ids are a set per request (checked every token); a 1024-id list
    (the cap) still stops at the right token."""
    probe = AddRequest(request_id="probe", prompt_token_ids=[1, 2, 3, 4, 5], params=GREEDY)
    assert core.add_request(probe).accepted
    first = _drain(core)["probe"][0].new_token_ids[0]
    stops = [*[t for t in range(1024) if t != first][:1023], first]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, stop_token_ids=stops)
    msg = AddRequest(request_id="stopped", prompt_token_ids=[1, 2, 3, 4, 5], params=params)
    assert core.add_request(msg).accepted
    out = _drain(core)["stopped"]
    assert [(o.finish_reason, o.stop_reason) for o in out] == [("stop", first)]


class _NoScanDeque(deque):
    """A waiting queue that fails the test on any O(n) removal."""

    def remove(self, value: Any) -> None:
        raise AssertionError("O(queue) removal from the waiting queue")


def test_aborting_a_queued_burst_never_scans_the_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 6: every abort of a waiting request was `deque.remove` (O(queue)); a burst of
    4096 queued then aborted was quadratic. Removal is now lazy: O(1) per abort, and the
    counts and the next admission stay right."""
    s = Scheduler(
        BlockManager(num_blocks=64, block_size=16), max_num_seqs=4, max_num_batched_tokens=64
    )
    monkeypatch.setattr(waiting_queue, "deque", _NoScanDeque)
    s.waiting = waiting_queue.FcfsQueue()
    # One API request's 4096 inputs (one group) and as many requests of their own.
    requests = [
        Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=2), group="g" if i % 2 else None)
        for i in range(4096)
    ]
    for request in requests:
        s.add(request)
    for request in requests[:-1][::-1]:  # from the back: the worst case for remove()
        assert s.abort(request.request_id) is request
    assert s.num_waiting == 1 and s.num_waiting_tokens == 3 and s.has_work()
    out = s.schedule()
    assert [item.request.request_id for item in out.scheduled] == ["r4095"]
    assert s.num_waiting == 0 and not s.waiting


def test_logit_bias_tensors_are_built_once_per_request() -> None:
    """Item 6: the bias tensors were rebuilt from the dict every step, for every request
    with a logit_bias. They are built at the request's first step and reused."""
    import torch

    from engine.sampler import Sampler

    sampler = Sampler(torch.device("cpu"))
    bias = {t: 100.0 for t in range(3, 1027)}
    request = Request("biased", [1, 2], SamplingParams(temperature=0.0, logit_bias=bias))
    logits = torch.zeros(1, 2000)
    first = sampler(logits, [request], [0]).token_ids
    cached = sampler._biases["biased"]
    second = sampler(logits, [request], [0]).token_ids
    assert sampler._biases["biased"] is cached  # the same tensors, not rebuilt
    assert first == second and first[0] in bias
    sampler.forget("biased")
    assert "biased" not in sampler._biases
