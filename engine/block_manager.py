"""Paged KV cache bookkeeping: which physical blocks each sequence owns, and the prefix cache.

Plain Python, no torch, so the scheduler and its tests run anywhere. A block is
`block_size` token slots in every layer's K and V cache. Full blocks are identified
by a hash chain over their tokens (each hash covers the parent's hash and the block's
tokens), so two requests with the same prefix map it to the same physical blocks.
Freed blocks keep their contents and hash: they are reused for a later hit until the
allocator needs them for new content (least recently freed evicted first).

With a sliding window that bounds every layer (Mistral, Qwen2 with every layer windowed),
a running sequence's blocks that lie wholly before the window of its next token are
released as it advances (`free_outside_window`), so a long sequence holds about
``window / block_size`` blocks, not its whole length.

A stateful session (SageMaker's sticky sessions, `engine/sessions.py`) pins the full
blocks of its requests when they are freed: a pinned free block sits in a second free
list that the allocator takes from only when the first is empty, so a conversation's
prefix is evicted last, not never (pins cannot starve new requests of blocks). Closing
or expiring the session moves its blocks back to the ordinary list.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from engine.request import Request


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        """The window every layer attends within (the model's `sliding_window`), or None."""
        self.num_window_freed_blocks = 0
        """Blocks released because they fell out of the window (a counter for tests)."""
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        # Free blocks in eviction order (oldest first). Values unused.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block: dict[bytes, int] = {}
        # Free blocks some live session pins, evicted only when `_free` is empty.
        self._free_pinned: OrderedDict[int, None] = OrderedDict()
        self._block_sessions: dict[int, set[str]] = {}
        self._session_blocks: dict[str, set[int]] = {}
        self.num_prefix_queries = 0
        """Prompt tokens looked up in the prefix cache (for the hit-rate metric)."""
        self.num_prefix_hits = 0

    # -- accounting ---------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._free_pinned)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks (free or in use) that hold a live session's prefix."""
        return len(self._block_sessions)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------
    def _hash_blocks(self, request: Request, num_full_blocks: int) -> list[bytes]:
        """Extend the request's hash chain to cover its first num_full_blocks blocks."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            h = hashlib.blake2b(digest_size=16)
            if i:
                h.update(hashes[i - 1])
            else:  # the chain's root: K/V depend on the adapter; a salt keeps tenants apart
                if request.lora_key:
                    h.update(request.lora_key)
                if request.cache_salt:
                    h.update(b"salt" + len(request.cache_salt).to_bytes(8, "little"))
                    h.update(request.cache_salt)
            h.update(array("q", tokens[i * bs : (i + 1) * bs]).tobytes())
            hashes.append(h.digest())
        return hashes

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks that hold a prefix of this (not yet running) request's tokens.

        Never covers the whole sequence: at least one token must go through the model
        so there are logits to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        num_full = (request.num_tokens - 1) // self.block_size
        hashes = self._hash_blocks(request, num_full)
        hit: list[int] = []
        for block_hash in hashes[:num_full]:
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    # -- allocation ---------------------------------------------------------------
    def can_allocate(
        self, request: Request, num_new_tokens: int, cached: list[int] | None = None
    ) -> bool:
        cached = cached or []
        total = request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        needed = self.blocks_needed(total) - len(request.block_ids) - len(cached)
        # Cached blocks sitting in the free list are taken out of it by the hit.
        reusable_free = sum(1 for b in cached if self._ref_counts[b] == 0)
        return needed <= self.num_free_blocks - reusable_free

    def allocate(
        self, request: Request, num_new_tokens: int, cached: list[int] | None = None
    ) -> bool:
        """Give the request slots for num_new_tokens more tokens (after any cached prefix).

        Returns False, changing nothing, when there are not enough free blocks.
        """
        cached = cached or []
        if not self.can_allocate(request, num_new_tokens, cached):
            return False
        for block_id in cached:
            self._take(block_id)
            request.block_ids.append(block_id)
        if cached:
            request.num_computed_tokens += len(cached) * self.block_size
        total = request.num_computed_tokens + num_new_tokens
        while len(request.block_ids) < self.blocks_needed(total):
            free = self._free if self._free else self._free_pinned
            block_id, _ = free.popitem(last=False)
            self._evict(block_id)
            self._ref_counts[block_id] = 1
            request.block_ids.append(block_id)
        return True

    def _take(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            if block_id in self._block_sessions:
                del self._free_pinned[block_id]
            else:
                del self._free[block_id]
        self._ref_counts[block_id] += 1

    def _evict(self, block_id: int) -> None:
        for session_id in self._block_sessions.pop(block_id, ()):
            self._session_blocks[session_id].discard(block_id)
        block_hash = self._block_hash[block_id]
        if block_hash is not None:
            if self._hash_to_block.get(block_hash) == block_id:
                del self._hash_to_block[block_hash]
            self._block_hash[block_id] = None

    def commit(self, request: Request) -> None:
        """Register the request's newly filled blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        hashes = self._hash_blocks(request, num_full)
        # Blocks released by the window may belong to someone else now: never touch them.
        for i in range(num_full - 1, request.num_freed_blocks - 1, -1):
            block_id = request.block_ids[i]
            if self._block_hash[block_id] is not None:
                break  # everything before it was committed already
            self._block_hash[block_id] = hashes[i]
            self._hash_to_block.setdefault(hashes[i], block_id)

    def free(self, request: Request) -> None:
        """Release the request's blocks; the tail goes to the free list first so a
        shared prefix outlives the request-specific suffix in the cache. A request of a
        live session first pins its full blocks to that session (blocks already released
        behind a sliding window are not its to pin)."""
        live = request.block_ids[request.num_freed_blocks :]
        if request.session_id is not None:
            self._pin(request.session_id, live)
        for block_id in reversed(live):
            self._release(block_id)
        request.block_ids = []
        request.num_freed_blocks = 0

    def free_outside_window(self, request: Request) -> int:
        """Release the blocks of a running request that its next token's window no
        longer reaches; returns how many. Its next query sits at position
        ``num_computed_tokens`` and sees keys from ``num_computed_tokens - window + 1`` on,
        so block i can go once ``(i + 1) * block_size`` is at most that. Later steps only
        move the window forward, so a released block is never needed again (a
        preempted request recomputes from scratch)."""
        window = self.sliding_window
        if window is None:
            return 0
        first_needed = request.num_computed_tokens - window + 1
        upto = min(max(first_needed, 0) // self.block_size, len(request.block_ids))
        released = 0
        while request.num_freed_blocks < upto:
            self._release(request.block_ids[request.num_freed_blocks])
            request.num_freed_blocks += 1
            released += 1
        self.num_window_freed_blocks += released
        return released

    def _release(self, block_id: int) -> None:
        """Drop one reference; a block nobody holds goes to the free list of its kind
        (pinned to a session: the list taken from last)."""
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            if block_id in self._block_sessions:
                self._free_pinned[block_id] = None
            else:
                self._free[block_id] = None

    def reset_prefix_cache(self) -> None:
        for block_id in [*self._free, *self._free_pinned]:
            self._evict(block_id)
        self._free.update(self._free_pinned)  # unpinned by the eviction
        self._free_pinned.clear()

    # -- sessions -------------------------------------------------------------------
    def open_session(self, session_id: str) -> None:
        """Start pinning the blocks of this session's requests (`engine/sessions.py`)."""
        self._session_blocks.setdefault(session_id, set())

    def close_session(self, session_id: str) -> None:
        """Unpin the session's blocks: the free ones become ordinary cache again, at the
        recently-freed end (still worth a hit, no longer protected)."""
        for block_id in self._session_blocks.pop(session_id, ()):
            sessions = self._block_sessions[block_id]
            sessions.discard(session_id)
            if sessions:
                continue
            del self._block_sessions[block_id]
            if block_id in self._free_pinned:
                del self._free_pinned[block_id]
                self._free[block_id] = None

    def session_blocks(self, session_id: str) -> frozenset[int]:
        return frozenset(self._session_blocks.get(session_id, ()))

    def _pin(self, session_id: str, block_ids: list[int]) -> None:
        """Pin the blocks that a later turn can hit: full ones the prefix cache maps to."""
        pinned = self._session_blocks.get(session_id)
        if pinned is None or not self.enable_prefix_caching:
            return  # closed or expired meanwhile, or nothing could ever hit
        for block_id in block_ids:
            block_hash = self._block_hash[block_id]
            if block_hash is None or self._hash_to_block.get(block_hash) != block_id:
                continue
            pinned.add(block_id)
            self._block_sessions.setdefault(block_id, set()).add(session_id)
