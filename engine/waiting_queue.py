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


class FcfsQueue:
    """First come, first served; preempted requests go to the very front."""

    __slots__ = ("_items", "_num_stale")

    def __init__(self, items: deque[Request] | None = None) -> None:
        self._items: deque[Request] = deque() if items is None else items
        self._num_stale = 0

    def push(self, request: Request) -> None:
        self._items.append(request)

    def push_preempted(self, request: Request) -> None:
        self._items.appendleft(request)

    def head(self) -> Request | None:
        items = self._items
        while items and items[0].is_finished:
            items.popleft()
            self._num_stale -= 1
        return items[0] if items else None

    def remove(self, request: Request) -> None:
        if self._items and self._items[0] is request:
            self._items.popleft()
        else:
            self._num_stale += 1

    def __len__(self) -> int:
        return len(self._items) - self._num_stale

    def num_entries(self) -> int:
        """Entries held, stale ones included (for tests of the lazy removal)."""
        return len(self._items)


class PriorityQueue:
    """Lower `priority` first, then earlier arrival, then enqueue order: the same order
    as a sorted deque with stable insertion, at O(log n) per push and pop."""

    __slots__ = ("_heap", "_num_stale", "_sequence")

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._num_stale = 0
        self._sequence = itertools.count()
        """Tie-break for equal (priority, arrival): earlier enqueue first. Never equal,
        so the heap never compares two Requests."""

    def push(self, request: Request) -> None:
        entry = (request.priority, request.arrival_time, next(self._sequence), request)
        heapq.heappush(self._heap, entry)

    def push_preempted(self, request: Request) -> None:
        # NOTE: the original arrival time puts it back ahead of later arrivals of its
        # priority; a more urgent request that is waiting still runs first.
        self.push(request)

    def head(self) -> Request | None:
        heap = self._heap
        while heap and heap[0][3].is_finished:
            heapq.heappop(heap)
            self._num_stale -= 1
        return heap[0][3] if heap else None

    def remove(self, request: Request) -> None:
        if self._heap and self._heap[0][3] is request:
            heapq.heappop(self._heap)
        else:
            self._num_stale += 1

    def __len__(self) -> int:
        return len(self._heap) - self._num_stale

    def num_entries(self) -> int:
        """Entries held, stale ones included (for tests of the lazy removal)."""
        return len(self._heap)


def make_waiting_queue(policy: str) -> WaitingQueue:
    if policy == "priority":
        return PriorityQueue()
    return FcfsQueue()
