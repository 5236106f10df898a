"""The scheduler's waiting queue, one class per policy, both with lazy removal.

`FcfsQueue` is a deque: arrivals at the back, preempted requests at the front. Under
`--scheduling-policy priority` the queue is a binary heap keyed on (priority, arrival
time, enqueue sequence), so an arrival costs O(log n) rather than the O(n) scan of a
sorted deque, and ties keep FCFS order. A preempted request keeps its arrival time, so
it goes back to where it was: ahead of every later arrival of its priority.

Removal is lazy in both: a request that leaves the queue anywhere but the head (abort
of a queued request) only marks itself finished; `head()` drops such entries when they
reach the front. Aborting a burst of queued requests is O(1) each, not O(queue).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Protocol

from engine.request import Request


class WaitingQueue(Protocol):
    def push(self, request: Request) -> None:
        """A new arrival."""

    def push_preempted(self, request: Request) -> None:
        """A request sent back by preemption (it runs again before later arrivals)."""

    def head(self) -> Request | None:
        """The next live request, without taking it; stale entries are dropped."""

    def remove(self, request: Request) -> None:
        """Take `request` out: O(1) at the head, lazily elsewhere (the caller marks it
        finished, and `head()` skips it)."""

    def __len__(self) -> int:
        """Live requests (stale entries not counted)."""


class _LazyRemovalQueue:
    """Lazy removal, written once for both policies: subclasses say how to look at, drop
    and count the front entry of their container."""

    __slots__ = ("_num_stale",)

    def __init__(self) -> None:
        self._num_stale = 0

    def _front(self) -> Request | None:
        raise NotImplementedError

    def _drop_front(self) -> None:
        raise NotImplementedError

    def num_entries(self) -> int:
        """Entries held, stale ones included (for tests of the lazy removal)."""
        raise NotImplementedError

    def head(self) -> Request | None:
        while (request := self._front()) is not None and request.is_finished:
            self._drop_front()
            self._num_stale -= 1
        return request

    def remove(self, request: Request) -> None:
        if self._front() is request:
            self._drop_front()
        else:
            self._num_stale += 1

    def __len__(self) -> int:
        return self.num_entries() - self._num_stale


class FcfsQueue(_LazyRemovalQueue):
    """First come, first served; preempted requests go to the very front."""

    __slots__ = ("_items",)

    def __init__(self, items: deque[Request] | None = None) -> None:
        super().__init__()
        self._items: deque[Request] = deque() if items is None else items

    def push(self, request: Request) -> None:
        self._items.append(request)

    def push_preempted(self, request: Request) -> None:
        self._items.appendleft(request)

    def _front(self) -> Request | None:
        return self._items[0] if self._items else None

    def _drop_front(self) -> None:
        self._items.popleft()

    def num_entries(self) -> int:
        return len(self._items)


class PriorityQueue(_LazyRemovalQueue):
    """`Request.sort_key` order (lower priority value first, then earlier arrival), then
    enqueue order: the same order as a sorted deque with stable insertion, at O(log n)
    per push and pop."""

    __slots__ = ("_heap", "_sequence")

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._sequence = itertools.count()
        """Tie-break for equal sort keys: earlier enqueue first. Never equal, so the heap
        never compares two Requests."""

    def push(self, request: Request) -> None:
        # Flat, not nested: a nested key tuple costs extra comparisons per sift.
        entry = (*request.sort_key(), next(self._sequence), request)
        heapq.heappush(self._heap, entry)

    def push_preempted(self, request: Request) -> None:
        # NOTE: the original arrival time puts it back ahead of later arrivals of its
        # priority; a more urgent request that is waiting still runs first.
        self.push(request)

    def _front(self) -> Request | None:
        return self._heap[0][3] if self._heap else None

    def _drop_front(self) -> None:
        heapq.heappop(self._heap)

    def num_entries(self) -> int:
        return len(self._heap)


def make_waiting_queue(policy: str) -> WaitingQueue:
    if policy == "priority":
        return PriorityQueue()
    return FcfsQueue()
