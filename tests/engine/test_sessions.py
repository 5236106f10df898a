"""Stateful sessions in the engine: the table (ids, expiry, capacity) and the pins that
keep a session's prefix blocks warm (evicted last, released on close or expiry).
No torch: the block pool and the table are plain Python."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.sessions import SessionTable, SessionTableFull

BLOCK = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _run(
    bm: BlockManager,
    rid: str,
    tokens: list[int],
    session_id: str | None = None,
    lora_key: bytes = b"",
) -> Request:
    """Admit, compute and finish one request (its blocks committed, then freed)."""
    request = Request(rid, tokens, SamplingParams(max_tokens=1), session_id=session_id)
    request.lora_key = lora_key
    cached = bm.find_cached_prefix(request)
    assert bm.allocate(request, request.num_tokens - len(cached) * BLOCK, cached)
    request.num_computed_tokens = request.num_tokens
    bm.commit(request)
    bm.free(request)
    return request


def _hits(bm: BlockManager, tokens: list[int], lora_key: bytes = b"") -> int:
    probe = Request("probe", tokens, SamplingParams(max_tokens=1))
    probe.lora_key = lora_key
    return len(bm.find_cached_prefix(probe))


CONVERSATION = [*range(1000, 1000 + 3 * BLOCK), 7]  # 3 full blocks and one token


def _fill(bm: BlockManager, start: int) -> None:
    """Other traffic: one request that needs every block of the pool at once."""
    tokens = list(range(start, start + bm.num_blocks * BLOCK))
    request = Request(f"fill-{start}", tokens, SamplingParams(max_tokens=1))
    if bm.allocate(request, len(tokens)):
        bm.free(request)


def _churn(bm: BlockManager, rounds: int) -> None:
    """Other traffic that fits beside the pinned blocks: small requests, many times."""
    for i in range(rounds):
        _run(bm, f"churn-{i}", list(range(50_000 + 100 * i, 50_000 + 100 * i + 2 * BLOCK + 1)))


def test_session_blocks_outlive_other_traffic_that_evicts_unpinned_ones() -> None:
    pinned, plain = BlockManager(8, BLOCK), BlockManager(8, BLOCK)
    table = SessionTable(pinned, clock=Clock())
    session_id, _ = table.open(ttl_s=60)
    _run(pinned, "turn-1", CONVERSATION, session_id)
    _run(plain, "turn-1", CONVERSATION)
    assert pinned.num_pinned_blocks == 3
    _churn(pinned, 20)
    _churn(plain, 20)
    assert _hits(pinned, CONVERSATION) == 3  # the session's prefix survived
    assert _hits(plain, CONVERSATION) == 0  # without a session it was evicted


def test_a_session_on_an_adapter_pins_the_adapters_chain_only() -> None:
    """The hash chain of a LoRA request starts from its adapter's cache key: the session
    pins those blocks, so its next turn on the same adapter hits them, and neither the
    base model nor another adapter ever does."""
    bm = BlockManager(8, BLOCK)
    table = SessionTable(bm, clock=Clock())
    session_id, _ = table.open(ttl_s=60)
    _run(bm, "turn-1", CONVERSATION, session_id, lora_key=b"sql")
    assert bm.num_pinned_blocks == 3
    _churn(bm, 20)
    assert _hits(bm, CONVERSATION, lora_key=b"sql") == 3
    assert _hits(bm, CONVERSATION) == 0
    assert _hits(bm, CONVERSATION, lora_key=b"chat") == 0
    assert table.close(session_id)
    assert bm.num_pinned_blocks == 0


def test_pins_never_keep_blocks_from_a_request_that_needs_them() -> None:
    bm = BlockManager(8, BLOCK)
    table = SessionTable(bm, clock=Clock())
    session_id, _ = table.open(ttl_s=60)
    _run(bm, "turn-1", CONVERSATION, session_id)
    tokens = list(range(9000, 9000 + 8 * BLOCK))
    request = Request("big", tokens, SamplingParams(max_tokens=1))
    assert bm.allocate(request, len(tokens))  # every block, the pinned ones last
    assert bm.num_pinned_blocks == 0 and bm.session_blocks(session_id) == frozenset()
    bm.free(request)
    assert bm.num_free_blocks == 8


def test_close_unpins_and_the_blocks_become_ordinary_cache() -> None:
    bm = BlockManager(8, BLOCK)
    table = SessionTable(bm, clock=Clock())
    session_id, _ = table.open(ttl_s=60)
    _run(bm, "turn-1", CONVERSATION, session_id)
    assert table.close(session_id)
    assert bm.num_pinned_blocks == 0
    assert _hits(bm, CONVERSATION) == 3  # still cached, just no longer protected
    _churn(bm, 20)
    assert _hits(bm, CONVERSATION) == 0
    assert not table.close(session_id)  # a second close finds nothing


def test_expiry_closes_the_session_and_releases_its_pins() -> None:
    clock = Clock()
    bm = BlockManager(8, BLOCK)
    table = SessionTable(bm, clock=clock)
    session_id, expires_at = table.open(ttl_s=30)
    assert expires_at == clock.now + 30
    _run(bm, "turn-1", CONVERSATION, session_id)
    clock.now += 29
    assert table.expire() == 0 and table.is_live(session_id)
    clock.now += 2
    assert table.expire() == 1
    assert not table.is_live(session_id) and len(table) == 0
    assert bm.num_pinned_blocks == 0


def test_expired_session_is_not_live_even_before_the_sweep() -> None:
    clock = Clock()
    table = SessionTable(BlockManager(8, BLOCK), clock=clock)
    session_id, _ = table.open(ttl_s=5)
    clock.now += 6
    assert not table.is_live(session_id)


def test_a_request_of_a_closed_session_pins_nothing() -> None:
    bm = BlockManager(8, BLOCK)
    table = SessionTable(bm, clock=Clock())
    session_id, _ = table.open(ttl_s=60)
    table.close(session_id)
    _run(bm, "late", CONVERSATION, session_id)
    assert bm.num_pinned_blocks == 0


def test_two_sessions_sharing_a_prefix_keep_it_until_both_close() -> None:
    bm = BlockManager(8, BLOCK)
    table = SessionTable(bm, clock=Clock())
    a, _ = table.open(ttl_s=60)
    b, _ = table.open(ttl_s=60)
    _run(bm, "a-1", CONVERSATION, a)
    _run(bm, "b-1", CONVERSATION, b)  # hits a's blocks and pins them too
    table.close(a)
    assert bm.num_pinned_blocks == 3
    _churn(bm, 20)
    assert _hits(bm, CONVERSATION) == 3
    table.close(b)
    assert bm.num_pinned_blocks == 0


def test_ids_are_unguessable_and_distinct() -> None:
    table = SessionTable(BlockManager(8, BLOCK), clock=Clock())
    ids = {table.open(ttl_s=60)[0] for _ in range(200)}
    assert len(ids) == 200
    assert all(len(i) >= 32 for i in ids)  # 24 random bytes, base64url


def test_a_full_table_refuses_until_a_session_closes() -> None:
    table = SessionTable(BlockManager(8, BLOCK), max_sessions=2, clock=Clock())
    first, _ = table.open(ttl_s=60)
    table.open(ttl_s=60)
    with pytest.raises(SessionTableFull):
        table.open(ttl_s=60)
    table.close(first)
    table.open(ttl_s=60)


def test_reset_prefix_cache_forgets_pinned_blocks_too() -> None:
    bm = BlockManager(8, BLOCK)
    table = SessionTable(bm, clock=Clock())
    session_id, _ = table.open(ttl_s=60)
    _run(bm, "turn-1", CONVERSATION, session_id)
    bm.reset_prefix_cache()
    assert _hits(bm, CONVERSATION) == 0 and bm.num_free_blocks == 8
    _fill(bm, 70_000)  # every block can be handed out again
    assert bm.num_free_blocks == 8
