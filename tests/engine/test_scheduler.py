"""Continuous batching decisions: token budget, chunked prefill, preemption, priority."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


def _req(rid: str, n: int, priority: int = 0, t: float = 0.0) -> Request:
    return Request(
        rid,
        list(range(1, n + 1)),
        SamplingParams(max_tokens=100),
        priority=priority,
        arrival_time=t,
    )


def _run_step(s: Scheduler) -> dict[str, int]:
    out = s.schedule()
    s.commit_step(out)
    for item in out.scheduled:
        if item.request.num_computed_tokens == item.request.num_tokens:
            item.request.all_token_ids.append(7)  # the sampled token
    return {item.request.request_id: item.num_new_tokens for item in out.scheduled}


def test_budget_chunks_long_prefill_and_keeps_decodes_running() -> None:
    s = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    s.add(_req("a", 3))
    assert _run_step(s) == {"a": 3}
    s.add(_req("b", 25))
    assert _run_step(s) == {"a": 1, "b": 9}  # decode first, then a prefill chunk
    assert _run_step(s) == {"a": 1, "b": 9}
    assert _run_step(s) == {"a": 1, "b": 7}  # prompt done: b samples now
    assert _run_step(s) == {"a": 1, "b": 1}


def test_max_num_seqs_caps_the_batch() -> None:
    s = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        s.add(_req(f"r{i}", 2))
    assert set(_run_step(s)) == {"r0", "r1"}
    assert s.num_waiting == 1


def test_preemption_frees_blocks_and_requeues_at_front() -> None:
    # 4 blocks of 2 tokens: two sequences of 3 tokens fill 4 blocks after one decode.
    s = Scheduler(BlockManager(4, 2), max_num_seqs=4, max_num_batched_tokens=100)
    s.add(_req("a", 3))
    s.add(_req("b", 3))
    _run_step(s)  # both prefill: 2 blocks each
    out = s.schedule()  # decoding 4th token needs no new block (3 tokens -> slot 4 in block 2)
    s.commit_step(out)
    for item in out.scheduled:
        item.request.all_token_ids.append(7)
    out = s.schedule()  # 5th token needs a third block each: b is preempted
    assert [r.request_id for r in out.preempted] == ["b"]
    b = out.preempted[0]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and not b.block_ids
    assert s.waiting[0] is b and s.num_preemptions == 1


def test_abort_frees_blocks_anywhere() -> None:
    bm = BlockManager(16, 4)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100)
    s.add(_req("a", 5))
    s.add(_req("b", 5))
    _run_step(s)
    assert bm.num_used_blocks > 0
    s.abort("a")
    s.abort("b")
    s.abort("missing")
    assert bm.num_used_blocks == 0 and not s.has_work()


def test_priority_policy_runs_lower_value_first() -> None:
    s = Scheduler(
        BlockManager(64, 4), max_num_seqs=1, max_num_batched_tokens=100, policy="priority"
    )
    s.add(_req("low", 2, priority=5, t=1))
    s.add(_req("high", 2, priority=-1, t=2))
    assert set(_run_step(s)) == {"high"}
