"""One API request's engine outputs, merged as they arrive (vLLM's output collector).

An API request fans out into one engine request per choice (`n`, batched prompts).
The client's IPC reader puts each `RequestOutput` straight into the request's
collector; outputs of the same engine request that the consumer has not taken yet are
merged on put, so a burst (several engine steps per event-loop turn, or a slow client)
costs one wake-up and becomes one chunk. There is no task per output: the consumer
awaits one future, and only when nothing is ready.

Closing the collector aborts every engine request that has not finished, which is what
frees their KV blocks when a client goes away (docs/architecture.md, "Disconnects").
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING

from engine.messages import RequestOutput

if TYPE_CHECKING:
    from engine.client import EngineClient


def merge_into(merged: RequestOutput, later: RequestOutput) -> None:
    """Append `later` (the next output of the same engine request) to `merged`.

    New lists every time: an output's lists may be shared with its sender (the
    in-process engine) and must not grow under it. Merges are rare (a burst), short.
    """
    merged.new_token_ids = merged.new_token_ids + later.new_token_ids
    if later.new_logprobs is not None:
        merged.new_logprobs = (merged.new_logprobs or []) + later.new_logprobs
    merged.num_prompt_tokens = merged.num_prompt_tokens or later.num_prompt_tokens
    merged.num_cached_tokens = merged.num_cached_tokens or later.num_cached_tokens
    if later.prompt_logprobs is not None:  # only ever on a request's first output
        merged.prompt_logprobs = later.prompt_logprobs
    if later.embedding is not None:  # an embedding request's one output
        merged.embedding = later.embedding
    if later.finish_reason is not None:
        merged.finish_reason = later.finish_reason
        merged.stop_reason = later.stop_reason
        merged.finished_on_stop_token = later.finished_on_stop_token
        merged.error = later.error


class OutputCollector:
    """The outputs of the engine requests of one API request, in arrival order.

    Fed by `EngineClient` (`put`, `fail`), drained by one consumer (`get`). The first
    pending output of each engine request is kept and later ones are merged into it.
    """

    __slots__ = ("_client", "_error", "_ready", "_unfinished", "_waiter")

    def __init__(self, client: EngineClient) -> None:
        self._client = client
        self._ready: dict[str, RequestOutput] = {}
        """Engine request id -> everything it produced since the consumer last looked."""
        self._unfinished: set[str] = set()
        """Admitted engine requests whose final output has not arrived (and not aborted)."""
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    # -- producer side (the client, on the event loop) ----------------------------------
    def track(self, request_id: str) -> None:
        """An engine request of this collector was sent to the engine."""
        self._unfinished.add(request_id)

    def forget(self, request_id: str) -> None:
        """An engine request of this collector was refused at admission."""
        self._unfinished.discard(request_id)

    def put(self, output: RequestOutput) -> None:
        request_id = output.request_id
        if request_id not in self._unfinished:
            return  # aborted by the consumer: whatever was still in flight is dropped
        if output.finish_reason is not None:
            self._unfinished.discard(request_id)
        merged = self._ready.get(request_id)
        if merged is None:
            self._ready[request_id] = output
        else:
            merge_into(merged, output)
        self._wake()

    def fail(self, error: BaseException) -> None:
        """End the request with `error` (engine death, drain deadline, request timeout):
        the consumer gets what was already ready, then the error."""
        if self._error is None:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- consumer side -------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        """Every output was taken and no engine request of this collector is running."""
        return not self._unfinished and not self._ready and self._error is None

    async def get(self, timeout: float | None = None) -> list[RequestOutput]:
        """The outputs that arrived since the last call (one merged output per engine
        request), waiting for the first; `[]` when `timeout` passes with nothing (or when
        everything is finished). Raises the error given to `fail` once the outputs that
        came before it are taken."""
        if not self._ready and self._error is None and self._unfinished:
            # PERF: one future per wait, and only when nothing is ready yet.
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = None if timeout is None else loop.call_later(timeout, _release, waiter)
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
        if self._ready:
            ready = list(self._ready.values())
            self._ready.clear()
            return ready
        if self._error is not None:
            raise self._error
        return []

    def abort(self, request_ids: Iterable[str] | None = None) -> None:
        """Stop these engine requests (all unfinished ones by default) in the engine; what
        they still send is dropped. Never awaits, so it also runs under cancellation."""
        ids = list(self._unfinished if request_ids is None else request_ids)
        ids = [rid for rid in ids if rid in self._unfinished]
        self._unfinished.difference_update(ids)
        if ids:
            self._client._abort_now(ids)

    def close(self) -> None:
        """Abort what is still running; safe to call more than once."""
        self.abort()
        self._ready.clear()


def _release(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
