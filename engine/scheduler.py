"""Continuous batching: which sequences run in the next step and how many tokens each.

One token budget per step (`max_num_batched_tokens`) is shared by decodes and prefill
chunks; there is no separate prefill phase. Running sequences are served first (one
token each when decoding, a chunk when their prompt is still being prefilled), then
waiting ones are admitted while budget, `max_num_seqs` and free KV blocks last.

The first prompt chunk of a step may run past the budget, up to `max_prefill_chunk`
tokens, with the decodes behind it still served. A small budget keeps a burst of short
prompts from sharing one long step (each prompt's first token comes after a short step);
the longer first chunk keeps a long prompt from being cut into many steps, each of which
also runs every running sequence's decode: at 16 running sequences of 1024-4096 tokens
that interleaving was a third of the prompt's time to first token. The running decodes
are scheduled before it, so they still advance every step. When
blocks run out, the lowest-priority running sequence is preempted by recompute: its
blocks are freed and it goes back to the front of the queue (under the priority policy:
back to its place by priority and arrival). The queue itself is `engine/waiting_queue.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus
from engine.waiting_queue import WaitingQueue, make_waiting_queue


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    """Tokens fed to the model this step, starting at request.num_computed_tokens."""

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the sequence, so a token is sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    """Sequences of this step in scheduling order (the runner reorders for attention)."""
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
        max_prefill_chunk: int | None = None,
    ) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}: use fcfs or priority")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_chunk = max(max_prefill_chunk or 0, max_num_batched_tokens)
        """Most prompt tokens the step's first prefill chunk may take (>= the budget)."""
        self._chunk_past_budget = self.max_prefill_chunk > max_num_batched_tokens
        self.policy = policy
        self.waiting: WaitingQueue = make_waiting_queue(policy, self.max_prefill_chunk)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_waiting_tokens = 0

    # -- queue ----------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.num_waiting or self.running)

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._enqueue(request, preempted=False)

    def _enqueue(self, request: Request, preempted: bool) -> None:
        request.status = RequestStatus.WAITING
        self.num_waiting_tokens += request.num_tokens
        if preempted:
            self.waiting.push_preempted(request)
        else:
            self.waiting.push(request)

    def _dequeue(self, request: Request) -> None:
        """Out of the queue: O(1) at the head, lazily elsewhere (see waiting_queue.py)."""
        self.waiting.remove(request)
        self.num_waiting_tokens -= request.num_tokens

    def finish(self, request: Request, reason: str) -> None:
        """Remove a request wherever it is and free its blocks."""
        if request.is_finished:
            return
        was_waiting = request.status is RequestStatus.WAITING
        # Finished before it leaves the queue: the queue then knows it was not taken by
        # the scheduler, and charges nothing to its group's turn (waiting_queue.py).
        request.status = RequestStatus.FINISHED
        if was_waiting:
            self._dequeue(request)
        elif request in self.running:
            self.running.remove(request)
        self.block_manager.free(request)
        request.finish_reason = reason
        self.requests.pop(request.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, "abort")
        return request

    # -- one step ------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        has_prefill = False  # a prompt chunk is in this step: later ones keep to the budget

        # 1. Running sequences, in order; preempt from the back when blocks run out.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            pending = request.num_pending_tokens
            num_new = self._chunk(pending, budget, has_prefill)
            while not bm.allocate(request, num_new):
                # Only sequences not yet scheduled this step can give their blocks back.
                victim = self._pick_victim(self.running[index:])
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted itself; self.running shrank at or before index
            out.scheduled.append(ScheduledRequest(request, num_new))
            # Past the budget only as the step's last sequence: the running list is in
            # admission order, so nothing decodes behind a sequence still prefilling.
            budget = max(budget - num_new, 0)
            has_prefill = has_prefill or pending > 1
            index += 1

        # 2. Waiting sequences, unless this step already had to preempt.
        while (
            not out.preempted
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and (request := self.waiting.head()) is not None
        ):
            # A request that scores or pools its prompt must compute every position it
            # reads: no cache hit (a cached block has K/V but no hidden states), except
            # for pooling that reads the last position only (never cached).
            use_cache = (
                request.num_computed_tokens == 0
                and request.prompt_logprobs is None
                and (request.pooling is None or request.pooling_uses_cache)
            )
            cached = bm.find_cached_prefix(request) if use_cache else []
            num_cached_tokens = len(cached) * bm.block_size
            num_new = self._chunk(request.num_tokens - num_cached_tokens, budget, has_prefill)
            if not bm.allocate(request, num_new, cached):
                break
            # First admission, not a resumed preemption (which finds its own blocks); an
            # embedding that never looks the cache up is no query of the hit rate either.
            if not request.ever_scheduled and use_cache:
                bm.num_prefix_queries += request.num_prompt_tokens
                bm.num_prefix_hits += num_cached_tokens
                request.num_cached_tokens = num_cached_tokens
            request.ever_scheduled = True
            self._dequeue(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget = max(budget - num_new, 0)
            has_prefill = True

        return out

    def _chunk(self, pending: int, budget: int, has_prefill: bool) -> int:
        """Tokens a sequence feeds this step: all it has pending, within the budget left,
        except that the step's first prompt chunk may take up to `max_prefill_chunk`."""
        if pending > budget and not has_prefill and self._chunk_past_budget:
            return min(pending, self.max_prefill_chunk)
        return min(pending, budget)

    def _pick_victim(self, candidates: list[Request]) -> Request:
        if self.policy == "priority":
            return max(candidates, key=Request.sort_key)
        return candidates[-1]

    def preempt(self, request: Request) -> None:
        """Free a running request's blocks and queue it again (recompute): when blocks
        run out, or for a prefix-cache reset that must empty every block."""
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        self.num_preemptions += 1
        self._enqueue(request, preempted=True)

    def commit_step(self, out: SchedulerOutput) -> None:
        """Advance every scheduled sequence by the tokens it just computed.

        An embedding request's blocks are registered in the prefix cache only when its
        pooling reads the last position alone (`Request.pooling_uses_cache`); otherwise
        it ends at its last prefill chunk and its blocks go straight back to the free
        list (engine/pooler.py)."""
        for item in out.scheduled:
            request = item.request
            if request.is_finished:
                continue
            request.num_computed_tokens += item.num_new_tokens
            if request.pooling is None or request.pooling_uses_cache:
                self.block_manager.commit(request)
            self.block_manager.free_outside_window(request)
