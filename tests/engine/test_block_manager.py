"""The paged block pool and prefix cache, without torch."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.request import Request
from engine.sampling_params import SamplingParams


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def test_allocate_and_free_return_every_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    r = _req("a", list(range(10)))
    assert bm.allocate(r, 10)
    assert len(r.block_ids) == 3 and bm.num_used_blocks == 3
    bm.free(r)
    assert bm.num_used_blocks == 0 and r.block_ids == []


def test_allocation_refused_without_partial_change() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    r = _req("a", list(range(12)))
    assert not bm.allocate(r, 12)
    assert r.block_ids == [] and bm.num_free_blocks == 2


def test_prefix_hit_shares_blocks_and_leaves_one_token_to_compute() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 112))  # exactly 3 blocks
    first = _req("a", [*prompt, 1])
    assert bm.allocate(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    bm.commit(first)

    second = _req("b", [*prompt, 2])
    cached = bm.find_cached_prefix(second)
    assert cached == first.block_ids[:3]
    assert bm.allocate(second, second.num_tokens - 12, cached)
    assert second.num_computed_tokens == 12
    assert second.block_ids[:3] == first.block_ids[:3]
    assert bm.num_used_blocks == 5  # 4 of first, 1 new for second

    # A prompt that is entirely cached still recomputes its last block.
    third = _req("c", prompt)
    assert len(bm.find_cached_prefix(third)) == 2


def test_a_cache_salt_shares_blocks_only_with_the_same_salt() -> None:
    """vLLM's cache_salt: the salt seeds the hash chain, so the same prompt under another
    salt (or none) finds nothing, and under the same salt finds its blocks."""
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 112))
    first = _req("a", [*prompt, 1])
    first.cache_salt = b"tenant-1"
    assert bm.allocate(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    bm.commit(first)

    def lookup(salt: bytes) -> list[int]:
        other = _req("x", [*prompt, 2])
        other.cache_salt = salt
        return bm.find_cached_prefix(other)

    assert lookup(b"tenant-1") == first.block_ids[:3]
    assert lookup(b"tenant-2") == []
    assert lookup(b"") == []
    # a salted chain differs from the unsalted one from its first block on, so a salt
    # that is a prefix of another's, or a lora key's bytes, cannot collide with it
    unsalted = _req("u", [*prompt, 3])
    assert bm.allocate(unsalted, unsalted.num_tokens)
    unsalted.num_computed_tokens = unsalted.num_tokens
    bm.commit(unsalted)
    assert lookup(b"") == unsalted.block_ids[:3]
    assert lookup(b"tenant-1") == first.block_ids[:3]
    assert lookup(b"tenant-") == []


def test_freed_blocks_stay_cached_until_evicted() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = _req("a", list(range(9)))
    assert bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.commit(a)
    bm.free(a)
    assert bm.num_used_blocks == 0
    again = _req("b", list(range(9)))
    assert len(bm.find_cached_prefix(again)) == 2
    # Filling the pool with other content evicts the cached blocks.
    other = _req("c", list(range(500, 516)))
    assert bm.allocate(other, 16)
    bm.free(other)
    assert bm.find_cached_prefix(_req("d", list(range(9)))) == []


def test_prefix_caching_off_never_hits() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = _req("a", list(range(9)))
    assert bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.commit(a)
    assert bm.find_cached_prefix(_req("b", list(range(9)))) == []


def test_a_prefix_shared_by_three_stays_in_use_until_the_last_one_frees_it() -> None:
    """Each sequence that shares a cached block adds one reference: freeing two of three
    sharers must leave the block in use (not in the free list, where the next allocation
    would hand it out and overwrite the third sequence's KV)."""
    bm = BlockManager(num_blocks=12, block_size=4)
    prefix = list(range(100, 108))  # two full blocks
    sharers = [_req(name, [*prefix, tail]) for name, tail in (("a", 1), ("b", 2), ("c", 3))]
    first = sharers[0]
    assert bm.allocate(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    bm.commit(first)
    for request in sharers[1:]:
        cached = bm.find_cached_prefix(request)
        assert cached == first.block_ids[:2]
        assert bm.allocate(request, request.num_tokens - 8, cached)
    shared = set(first.block_ids[:2])
    assert bm.num_used_blocks == 2 + 3  # the prefix once, one tail block each

    last = sharers[2]
    for request in sharers[:2]:
        bm.free(request)
    assert bm.num_used_blocks == len(last.block_ids) == 3
    newcomer = _req("d", list(range(500, 500 + 4 * bm.num_free_blocks)))
    assert bm.allocate(newcomer, newcomer.num_tokens)  # takes every free block ...
    assert shared.isdisjoint(newcomer.block_ids)  # ... but none the third still reads
    bm.free(last)
    bm.free(newcomer)
    assert bm.num_used_blocks == 0


def test_sliding_window_frees_blocks_its_next_token_cannot_see() -> None:
    """Window 6, blocks of 4: after 16 tokens the next query (position 16) sees keys
    11..16, so blocks 0 and 1 (positions 0..7) go back to the pool, block 2 stays;
    decoding on releases each block once it is wholly behind the window; finishing
    frees the rest exactly once."""
    bm = BlockManager(num_blocks=8, block_size=4, sliding_window=6)
    r = _req("a", list(range(16)))
    assert bm.allocate(r, 16)
    r.num_computed_tokens = 16
    bm.commit(r)
    assert bm.free_outside_window(r) == 2
    assert r.num_freed_blocks == 2 and len(r.block_ids) == 4 and bm.num_used_blocks == 2
    assert bm.free_outside_window(r) == 0  # idempotent
    for n in range(16, 24):  # decode 8 tokens, one block at a time
        r.all_token_ids.append(n)
        assert bm.allocate(r, 1)
        r.num_computed_tokens += 1
        bm.commit(r)
        bm.free_outside_window(r)
        first_needed = r.num_computed_tokens - 6 + 1
        assert r.num_freed_blocks == first_needed // 4
        assert bm.num_used_blocks == len(r.block_ids) - r.num_freed_blocks <= 3
    assert bm.num_window_freed_blocks == r.num_freed_blocks == 4
    bm.free(r)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 8
    assert r.block_ids == [] and r.num_freed_blocks == 0


def test_window_freed_blocks_are_reusable_and_never_rehashed() -> None:
    """A released block can serve another request at once (the pool is small), and the
    first request's later commits never write a hash into it."""
    bm = BlockManager(num_blocks=4, block_size=4, sliding_window=1)
    a = _req("a", list(range(12)))
    assert bm.allocate(a, 12)
    a.num_computed_tokens = 12
    bm.commit(a)
    assert bm.free_outside_window(a) == 3  # window 1: the next token sees only itself
    b = _req("b", list(range(50, 62)))
    assert bm.allocate(b, 12)  # 3 blocks: only possible with a's released blocks
    taken = set(b.block_ids)
    a.all_token_ids += [12, 13, 14, 15]
    assert bm.allocate(a, 4)
    a.num_computed_tokens = 16
    bm.commit(a)
    for block in taken:
        assert bm._block_hash[block] is None  # b has not committed: a must not have either
    bm.free(a)
    bm.free(b)
    assert bm.num_used_blocks == 0


def test_no_window_frees_nothing() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    r = _req("a", list(range(16)))
    assert bm.allocate(r, 16)
    r.num_computed_tokens = 16
    assert bm.free_outside_window(r) == 0 and bm.num_used_blocks == 4
