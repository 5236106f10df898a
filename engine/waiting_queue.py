"""The scheduler's waiting queue, one class per policy, both with lazy removal.

`FcfsQueue` takes API requests in arrival order, the inputs of one API request in turns
with later arrivals (see the class); preempted requests go to the front. Under
`--scheduling-policy priority` the queue is a binary heap keyed on (priority, arrival
time, enqueue sequence), so an arrival costs O(log n) rather than the O(n) scan of a
sorted deque, and ties keep FCFS order; the inputs of one API request take turns with
later arrivals of their priority there too. A preempted request keeps its arrival time,
so it goes back to where it was: ahead of every later arrival of its priority.

Removal is lazy in both: a request that leaves the queue anywhere but the head (abort
of a queued request) only marks itself finished; `head()` drops such entries when they
reach the front. Aborting a burst of queued requests is O(1) each, not O(queue).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
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
    """First come, first served by API request; the inputs of one API request take turns
    with later arrivals; preempted requests go to the very front.

    The engine requests of one API request (its n choices, its batch of prompts or
    embedding inputs) share a `Request.group`. Strict FCFS over engine requests let one
    request of 1024 long inputs hold every later arrival behind all of them (180
    embeddings of 6.4K tokens: half an hour of prefill on a 2-vCPU host). Here the groups
    queue in arrival order and the front group keeps the front only for a turn of
    `turn_tokens` prompt tokens (at least one request), then goes to the back: a later
    request waits for at most one turn of each group ahead of it, not for their whole
    batch. A group of one (most requests) is plain FCFS; a group whose requests fit in one
    turn (n choices of a short chat) is admitted together.
    """

    __slots__ = ("_groups", "_num_entries", "_turn_taken", "_turn_tokens")

    def __init__(self, turn_tokens: int = 1) -> None:
        super().__init__()
        self._groups: OrderedDict[str, deque[Request]] = OrderedDict()
        """Group -> its waiting requests, in turn order (front: the group whose turn it is)."""
        self._turn_tokens = max(turn_tokens, 1)
        self._turn_taken = 0
        """Prompt tokens the front group has taken in its current turn."""
        self._num_entries = 0

    def push(self, request: Request) -> None:
        group = self._groups.get(request.group)
        if group is None:
            self._groups[request.group] = group = deque()
        group.append(request)
        self._num_entries += 1

    def push_preempted(self, request: Request) -> None:
        group = self._groups.get(request.group)
        if group is None:
            self._groups[request.group] = group = deque()
        group.appendleft(request)
        if next(iter(self._groups)) != request.group:
            self._groups.move_to_end(request.group, last=False)
            self._turn_taken = 0
        self._num_entries += 1

    def _front(self) -> Request | None:
        for group in self._groups.values():
            return group[0]
        return None

    def _drop_front(self) -> None:
        key, group = next(iter(self._groups.items()))
        request = group.popleft()
        self._num_entries -= 1
        if not request.is_finished:  # taken by the scheduler: it counts to the turn
            self._turn_taken += request.num_tokens
        if not group:
            del self._groups[key]
            self._turn_taken = 0
        elif self._turn_taken >= self._turn_tokens:
            self._groups.move_to_end(key)
            self._turn_taken = 0

    def num_entries(self) -> int:
        return self._num_entries


class _GroupTurn:
    """The turn state of one API request's engine requests in `PriorityQueue`."""

    __slots__ = ("key", "pending", "taken", "turn")

    def __init__(self, key: float) -> None:
        self.turn = 0
        """Turns ended so far; an entry queued for an earlier turn is re-keyed at the front."""
        self.key = key
        """The arrival its entries are ordered by in the current turn (its own arrival,
        then the latest arrival when a turn ended)."""
        self.taken = 0
        """Prompt tokens taken in the current turn."""
        self.pending = 0
        """Entries of the group in the heap (stale ones included)."""


class PriorityQueue(_LazyRemovalQueue):
    """`Request.sort_key` order (lower priority value first, then earlier arrival), then
    enqueue order, at O(log n) per push and pop; and, as `FcfsQueue`, the engine requests
    of one API request (`Request.group`) take turns of `turn_tokens` prompt tokens with
    later arrivals of their priority: when a group's turn ends, its entries still waiting
    are ordered by the latest arrival so far (re-keyed lazily, as each reaches the
    front). A preempted request goes back by its own arrival, ahead of later arrivals of
    its priority."""

    __slots__ = ("_groups", "_heap", "_latest", "_sequence", "_turn_tokens")

    def __init__(self, turn_tokens: int = 1) -> None:
        super().__init__()
        self._heap: list[tuple[int, float, int, int, Request]] = []
        """(priority, arrival key, enqueue sequence, group turn, request)."""
        self._sequence = itertools.count()
        """Tie-break for equal keys: earlier enqueue first. Never equal, so the heap never
        compares two turns or Requests."""
        self._turn_tokens = max(turn_tokens, 1)
        self._groups: dict[str, _GroupTurn] = {}
        self._latest = float("-inf")
        """The latest arrival pushed: where a group whose turn ended goes."""

    def _push(self, request: Request, key: float) -> None:
        group = self._groups.get(request.group)
        if group is None:
            self._groups[request.group] = group = _GroupTurn(request.arrival_time)
        group.pending += 1
        # Flat, not nested: a nested key tuple costs extra comparisons per sift.
        entry = (request.priority, key, next(self._sequence), group.turn, request)
        heapq.heappush(self._heap, entry)

    def push(self, request: Request) -> None:
        self._latest = max(self._latest, request.arrival_time)
        group = self._groups.get(request.group)
        self._push(request, group.key if group is not None else request.arrival_time)

    def push_preempted(self, request: Request) -> None:
        # NOTE: the original arrival time puts it back ahead of later arrivals of its
        # priority; a more urgent request that is waiting still runs first.
        self._push(request, request.arrival_time)

    def _front(self) -> Request | None:
        heap = self._heap
        while heap:
            priority, _, _, turn, request = heap[0]
            group = self._groups[request.group]
            if turn >= group.turn:
                return request
            entry = (priority, group.key, next(self._sequence), group.turn, request)
            heapq.heapreplace(heap, entry)  # queued for an ended turn: behind later arrivals
        return None

    def _drop_front(self) -> None:
        request = heapq.heappop(self._heap)[4]
        group = self._groups[request.group]
        group.pending -= 1
        if group.pending == 0:
            del self._groups[request.group]
            return
        if not request.is_finished:  # taken by the scheduler: it counts to the turn
            group.taken += request.num_tokens
            if group.taken >= self._turn_tokens:
                group.turn, group.key, group.taken = group.turn + 1, self._latest, 0

    def num_entries(self) -> int:
        return len(self._heap)


def make_waiting_queue(policy: str, turn_tokens: int = 1) -> WaitingQueue:
    """The queue of `policy`; `turn_tokens`: the prompt tokens an API request of many
    inputs may take before a later one (of its priority) gets a turn."""
    if policy == "priority":
        return PriorityQueue(turn_tokens)
    return FcfsQueue(turn_tokens)
