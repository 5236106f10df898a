"""Continuous batching decisions: token budget, chunked prefill, preemption, priority."""

from __future__ import annotations

import math
import random

import pytest

from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.waiting_queue import FcfsQueue, PriorityQueue


def _req(
    rid: str, n: int, priority: int = 0, t: float = 0.0, first: int = 1, group: str | None = None
) -> Request:
    return Request(
        rid,
        list(range(first, first + n)),
        SamplingParams(max_tokens=100),
        priority=priority,
        arrival_time=t,
        group=group,
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


def test_the_first_prompt_chunk_may_run_past_the_budget_up_to_max_prefill_chunk() -> None:
    """A long prompt takes `max_prefill_chunk` tokens a step, not the budget's 10, and the
    decodes behind it in the running list still get their token."""
    s = Scheduler(
        BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10, max_prefill_chunk=24
    )
    s.add(_req("a", 30))
    s.add(_req("b", 3, first=500))
    assert _run_step(s) == {"a": 24}  # past the budget: nothing else joins this step
    assert _run_step(s) == {"a": 6, "b": 3}  # a's last chunk fits; b shares what is left
    s.add(_req("c", 50, first=1000))  # no prefix shared with a: no cache hit
    # a and b decode; c is the first prompt chunk of the step: 24 tokens, not 8.
    assert _run_step(s) == {"a": 1, "b": 1, "c": 24}
    s.add(_req("d", 2, first=2000))
    assert _run_step(s) == {"a": 1, "b": 1, "c": 24}  # d waits: the step is past its budget
    # c's last 2 tokens are the step's first prompt chunk; d shares the budget left.
    assert _run_step(s) == {"a": 1, "b": 1, "c": 2, "d": 2}


def test_a_second_prompt_in_a_step_keeps_to_the_budget_left() -> None:
    """Only the step's first prompt chunk is let past the budget: a later long prompt joins
    with what is left, so a short prompt's first token never waits for a long chunk."""
    s = Scheduler(
        BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10, max_prefill_chunk=40
    )
    s.add(_req("a", 4))
    s.add(_req("b", 60, first=500))
    assert _run_step(s) == {"a": 4, "b": 6}
    assert _run_step(s) == {"a": 1, "b": 40}  # now b is the first prompt chunk


def test_max_prefill_chunk_at_or_below_the_budget_changes_nothing() -> None:
    for chunk in (None, 4, 10):
        s = Scheduler(
            BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10, max_prefill_chunk=chunk
        )
        s.add(_req("a", 25))
        assert [_run_step(s) for _ in range(3)] == [{"a": 10}, {"a": 10}, {"a": 5}]


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
    assert s.waiting.head() is b and s.num_preemptions == 1


def test_a_readmission_after_preemption_mid_prompt_is_no_new_prefix_query() -> None:
    """A request preempted before its prompt was done (no output yet) finds its own
    committed blocks in the prefix cache when readmitted: that is neither a second query
    of the hit rate nor cached tokens of the request (usage's `cached_tokens`), as vLLM
    counts at first scheduling only."""
    bm = BlockManager(16, 4)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8)
    a = _req("a", 20)
    s.add(a)
    assert _run_step(s) == {"a": 8}  # two full blocks committed to the cache
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == (20, 0)
    s.preempt(a)
    assert _run_step(s) == {"a": 8}  # it resumes past its own cached blocks
    assert a.num_computed_tokens == 16
    assert (bm.num_prefix_queries, bm.num_prefix_hits, a.num_cached_tokens) == (20, 0, 0)


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


def _drain(queue: PriorityQueue | FcfsQueue) -> list[str]:
    order = []
    while (request := queue.head()) is not None:
        queue.remove(request)
        order.append(request.request_id)
    return order


def test_priority_queue_orders_by_priority_then_arrival_then_enqueue() -> None:
    q = PriorityQueue()
    for rid, priority, t in [
        ("a", 1, 1.0),
        ("b", 0, 2.0),
        ("c", 1, 0.5),
        ("d", 0, 2.0),
        ("e", -3, 9.0),
    ]:
        q.push(_req(rid, 1, priority=priority, t=t))
    # b and d tie on (priority, arrival): the first enqueued goes first (FCFS).
    assert len(q) == 5 and _drain(q) == ["e", "b", "d", "c", "a"]
    assert len(q) == 0 and q.num_entries() == 0


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preempted_request_runs_before_later_arrivals(policy: str) -> None:
    """fcfs: back to the very front. priority: back to its place by (priority, arrival),
    which is ahead of every later arrival of its priority, behind more urgent ones."""
    # 4 blocks of 2 tokens: a and b (3 tokens each) fill the pool; c waits (max_num_seqs).
    s = Scheduler(BlockManager(4, 2), max_num_seqs=2, max_num_batched_tokens=100, policy=policy)
    for rid, t in [("a", 0.0), ("b", 1.0), ("c", 2.0)]:
        s.add(_req(rid, 3, t=t))
    assert set(_run_step(s)) == {"a", "b"}
    _run_step(s)  # the 4th token of each still fits in their second block
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["b"]
    assert s.waiting.head() is out.preempted[0] and s.num_waiting == 2
    if policy == "priority":
        urgent = _req("urgent", 1, priority=-1, t=3.0)
        s.add(urgent)
        assert s.waiting.head() is urgent
        assert _drain(s.waiting) == ["urgent", "b", "c"]


class _CountingInt(int):
    """A priority that counts how often the queue compares it."""

    num_comparisons = 0

    def _count(self) -> None:
        _CountingInt.num_comparisons += 1

    def __eq__(self, other: object) -> bool:
        self._count()
        return int(self) == other

    def __lt__(self, other: int) -> bool:
        self._count()
        return int(self) < other

    def __gt__(self, other: int) -> bool:
        self._count()
        return int(self) > other

    def __le__(self, other: int) -> bool:
        self._count()
        return int(self) <= other

    def __ge__(self, other: int) -> bool:
        self._count()
        return int(self) >= other

    __hash__ = int.__hash__


@pytest.mark.parametrize("order", ["ascending", "descending", "shuffled"])
def test_priority_queue_is_logarithmic_per_insert_and_pop(order: str) -> None:
    """Issue 8: insertion scanned a sorted deque, O(queue) comparisons each; ascending
    arrivals (every one goes to the back) made n inserts cost n^2/2. Counting the
    comparisons of the priorities themselves (no clock, and deterministic) bounds a push
    and a pop by O(log n); the linear scan made 8.4M calls here for ascending arrivals."""
    n = 2048
    priorities = list(range(n))
    if order == "descending":
        priorities.reverse()
    elif order == "shuffled":
        random.Random(0).shuffle(priorities)
    s = Scheduler(
        BlockManager(64, 4), max_num_seqs=1, max_num_batched_tokens=100, policy="priority"
    )
    _CountingInt.num_comparisons = 0
    requests = [_req(f"r{p}", 1, priority=_CountingInt(p), t=0.0) for p in priorities]
    for request in requests:
        s.add(request)
    bound = 4 * n * math.log2(n)  # two calls (== then <) per tuple comparison
    assert 0 < _CountingInt.num_comparisons <= bound
    # Aborting queued requests away from the head is lazy: no comparisons, no scan.
    head = s.waiting.head()
    aborted = [r for r in requests[1::2] if r is not head]
    before = _CountingInt.num_comparisons
    for request in aborted:
        assert s.abort(request.request_id) is request
    assert _CountingInt.num_comparisons == before
    assert s.num_waiting == n - len(aborted) and s.num_waiting_tokens == n - len(aborted)
    assert _drain(s.waiting) == [f"r{p}" for p in sorted(priorities) if f"r{p}" in s.requests]
    assert 0 < _CountingInt.num_comparisons <= 3 * bound  # pushes and n pops
    assert s.waiting.num_entries() == 0


def test_the_default_prefill_chunk_is_long_only_where_amx_tiles_run_the_linears() -> None:
    from engine.config import default_prefill_chunk

    assert default_prefill_chunk("cpu", 256, tiled_linears=True) == 2048
    assert default_prefill_chunk("cpu", 256, tiled_linears=False) == 512
    assert default_prefill_chunk("cpu", 1000, tiled_linears=False) == 1000  # never below
    assert default_prefill_chunk("cuda", 2048, tiled_linears=True) == 2048  # GPU: the budget


@pytest.mark.parametrize(
    ("budget", "chunk", "expected"),
    [
        (None, None, (256, None)),  # CPU defaults: short steps, the chunk by the kernels
        (40, None, (40, 40)),  # an explicit budget caps every step, as vLLM's does
        (40, 100, (40, 100)),
        (None, 100, (256, 256)),  # a chunk below the budget is the budget
    ],
)
def test_the_prefill_chunk_resolves_from_the_budget_flags(
    model_smollm2_dir: str, budget: int | None, chunk: int | None, expected: tuple[int, int]
) -> None:
    from engine.config import EngineConfig
    from engine.resolved_config import resolve

    config = EngineConfig(
        model=model_smollm2_dir,
        device="cpu",
        max_num_batched_tokens=budget,
        max_prefill_chunk=chunk,
    )
    resolved = resolve(config, lambda _: None)
    assert (resolved.max_num_batched_tokens, resolved.max_prefill_chunk) == expected


# -- both policies: the inputs of one API request take turns with later arrivals ---------
def _queue(policy: str, turn_tokens: int) -> FcfsQueue | PriorityQueue:
    return FcfsQueue(turn_tokens) if policy == "fcfs" else PriorityQueue(turn_tokens)


class _Clock:
    """Arrival times that grow with each request, as the engine's do."""

    def __init__(self) -> None:
        self.now = 0.0

    def req(self, rid: str, n: int, **fields) -> Request:
        self.now += 1.0
        return _req(rid, n, t=self.now, **fields)


POLICIES = pytest.mark.parametrize("policy", ["fcfs", "priority"])


@POLICIES
def test_without_groups_it_is_arrival_order(policy: str) -> None:
    q, clock = _queue(policy, 100), _Clock()
    for rid in "abcde":
        q.push(clock.req(rid, 7))
    assert len(q) == 5 and _drain(q) == list("abcde")
    assert len(q) == 0 and q.num_entries() == 0


@POLICIES
def test_a_many_input_request_takes_turns_with_later_arrivals(policy: str) -> None:
    """Six 40-token inputs of one API request, then x and y: strict FCFS ran x after all
    six; with turns of 64 tokens x runs after the first two, y after the next two."""
    q, clock = _queue(policy, 64), _Clock()
    for i in range(6):
        q.push(_req(f"big{i}", 40, group="big", t=1.0))  # one API request: one arrival
    clock.now = 1.0
    q.push(clock.req("x", 5))
    q.push(clock.req("y", 5))
    assert _drain(q) == ["big0", "big1", "x", "y", "big2", "big3", "big4", "big5"]


@POLICIES
def test_a_group_within_one_turn_is_taken_together(policy: str) -> None:
    """The n choices of a short request (4 x 10 tokens, turn 64) stay together."""
    q = _queue(policy, 64)
    for i in range(4):
        q.push(_req(f"n{i}", 10, group="chat", t=1.0))
    q.push(_req("z", 5, t=2.0))
    assert _drain(q) == ["n0", "n1", "n2", "n3", "z"]


@POLICIES
def test_every_waiting_group_gets_a_turn_in_arrival_order(policy: str) -> None:
    q = _queue(policy, 1)  # one input a turn
    for i in range(3):
        q.push(_req(f"a{i}", 3, group="a", t=1.0))
    for i in range(2):
        q.push(_req(f"b{i}", 3, group="b", t=2.0))
    q.push(_req("c", 3, t=3.0))
    assert _drain(q) == ["a0", "b0", "c", "a1", "b1", "a2"]


@POLICIES
def test_an_aborted_head_uses_none_of_its_groups_turn(policy: str) -> None:
    """Aborting the request at the head of the queue (a client gone before it ran) takes
    nothing of its group's turn: its sibling is still next, not the later arrival."""
    s = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=100, policy=policy)
    s.waiting = _queue(policy, 10)
    for rid in ("a1", "a2"):
        s.add(_req(rid, 12, group="A", t=1.0))
    s.add(_req("b", 3, t=2.0, first=900))
    s.abort("a1")
    head = s.waiting.head()
    assert head is not None and head.request_id == "a2"


def test_priority_turns_stay_within_a_priority() -> None:
    """A turn lets later arrivals of the group's own priority go first; a more urgent
    request goes first anyway, a less urgent one waits for the whole group."""
    q = PriorityQueue(turn_tokens=1)
    for i in range(3):
        q.push(_req(f"g{i}", 3, group="g", t=1.0))
    q.push(_req("same", 3, t=2.0))
    q.push(_req("later-low", 3, priority=5, t=3.0))
    q.push(_req("urgent", 3, priority=-1, t=4.0))
    assert _drain(q) == ["urgent", "g0", "same", "g1", "g2", "later-low"]


def test_a_preempted_input_goes_back_by_its_arrival_under_priority() -> None:
    q = PriorityQueue(turn_tokens=1)
    for i in range(2):
        q.push(_req(f"a{i}", 3, group="a", t=1.0))
    q.push(_req("b", 3, t=2.0))
    first = q.head()
    assert first is not None and first.request_id == "a0"
    q.remove(first)  # a0 admitted: the rest of group a goes behind b
    assert q.head() is not None and q.head().request_id == "b"
    q.push_preempted(first)  # a0 preempted: back by its own arrival, ahead of b
    assert _drain(q) == ["a0", "b", "a1"]


def test_a_preempted_input_goes_to_the_very_front() -> None:
    q = FcfsQueue(turn_tokens=1)
    for i in range(2):
        q.push(_req(f"a{i}", 3, group="a"))
    q.push(_req("b", 3))
    q.push(_req("c", 3))
    first = q.head()
    assert first is not None
    q.remove(first)  # a0 admitted: group a goes behind b and c
    assert q.head() is not None and q.head().request_id == "b"
    q.push_preempted(first)  # a0 preempted: ahead of everything again
    assert _drain(q) == ["a0", "b", "c", "a1"]


@POLICIES
def test_aborted_inputs_are_skipped_and_not_counted(policy: str) -> None:
    q = _queue(policy, 1)
    requests = [_req(f"a{i}", 3, group="a", t=1.0) for i in range(3)] + [_req("b", 3, t=2.0)]
    for request in requests:
        q.push(request)
    for request in requests[:2]:  # a0 (the head) and a1 (lazily)
        q.remove(request)
        request.status = RequestStatus.FINISHED
    assert len(q) == 2 and _drain(q) == ["b", "a2"]
    assert q.num_entries() == 0


def test_scheduler_admits_a_later_request_between_the_inputs_of_a_long_one() -> None:
    """Through the scheduler: eight 24-token inputs of one API request arrive, then a short
    request; the budget admits one input a step. The short one is admitted in the second
    step, not the ninth, and every input still runs."""
    s = Scheduler(BlockManager(256, 4), max_num_seqs=2, max_num_batched_tokens=24)
    for i in range(8):
        s.add(_req(f"in{i}", 24, first=100 * i + 1, group="batch"))
    s.add(_req("late", 4, first=5000))
    admitted: list[str] = []
    for _ in range(40):
        out = s.schedule()
        s.commit_step(out)
        for item in out.scheduled:
            request = item.request
            if request.request_id not in admitted:
                admitted.append(request.request_id)
            if request.num_computed_tokens == request.num_tokens:
                s.finish(request, "stop")  # one step of output is enough here
        if not s.has_work():
            break
    assert admitted[:3] == ["in0", "late", "in1"]
    assert sorted(admitted) == sorted([f"in{i}" for i in range(8)] + ["late"])
