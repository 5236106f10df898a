"""The engine streams of one API request, merged, with keep-alive ticks and aborts.

`n > 1` (and batched completion prompts) fan out into several engine requests; their
outputs are interleaved in arrival order. While nothing arrives for `keep_alive`
seconds the iterator yields `None`: the SSE layer turns it into a `: ping` comment,
and that yield is the only moment the HTTP server can notice a client that went away
(during a long prefill, say). Closing a `Generation` aborts every engine request that
is still running, which is what frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

from engine.client import RequestStream
from engine.messages import RequestOutput

Event = tuple[int, RequestOutput] | None
"""(choice index, output delta), or None for a keep-alive tick."""


def _coalesce(first: RequestOutput, stream: RequestStream) -> RequestOutput:
    """Fold outputs that are already queued behind `first` into one delta, so a burst
    (a slow consumer, or several engine steps per loop turn) becomes one chunk."""
    get_nowait = getattr(stream, "get_nowait", None)
    if get_nowait is None or first.finished:
        return first
    merged: RequestOutput | None = None
    while True:
        nxt = get_nowait()
        if nxt is None:
            break
        if merged is None:
            merged = RequestOutput(
                request_id=first.request_id,
                new_token_ids=list(first.new_token_ids),
                new_logprobs=list(first.new_logprobs) if first.new_logprobs is not None else None,
                num_prompt_tokens=first.num_prompt_tokens,
                num_cached_tokens=first.num_cached_tokens,
                prompt_logprobs=first.prompt_logprobs,
            )
        merged.new_token_ids.extend(nxt.new_token_ids)
        if nxt.new_logprobs is not None:
            merged.new_logprobs = (merged.new_logprobs or []) + list(nxt.new_logprobs)
        merged.num_prompt_tokens = merged.num_prompt_tokens or nxt.num_prompt_tokens
        merged.num_cached_tokens = merged.num_cached_tokens or nxt.num_cached_tokens
        if nxt.finished:
            merged.finish_reason = nxt.finish_reason
            merged.stop_reason = nxt.stop_reason
            merged.error = nxt.error
            break
    return merged or first


class Generation:
    """Admitted engine streams of one API request (choice i is `streams[i]`)."""

    def __init__(self, streams: list[RequestStream], keep_alive: float | None) -> None:
        self._streams = streams
        self._keep_alive = keep_alive
        self._done = [False] * len(streams)
        self._pending: dict[asyncio.Task[RequestOutput], int] = {}

    @property
    def request_ids(self) -> list[str]:
        return [s.request_id for s in self._streams]

    def __len__(self) -> int:
        return len(self._streams)

    async def events(self) -> AsyncGenerator[Event, None]:
        """Outputs of all choices as they arrive, `None` on each keep-alive timeout.

        Exceptions from a stream (engine death) propagate; the caller must still
        `aclose()` the Generation (a `finally`) to abort the other choices.
        """
        pending = self._pending

        def schedule(index: int) -> None:
            if not self._done[index]:
                task = asyncio.create_task(self._streams[index].__anext__())
                pending[task] = index

        try:
            for index in range(len(self._streams)):
                schedule(index)
            while pending:
                done, _ = await asyncio.wait(
                    pending, timeout=self._keep_alive, return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    yield None
                    continue
                for task in sorted(done, key=pending.__getitem__):
                    index = pending.pop(task)
                    try:
                        output = task.result()
                    except StopAsyncIteration:
                        self._done[index] = True
                        continue
                    output = _coalesce(output, self._streams[index])
                    if output.finished:
                        self._done[index] = True
                    yield index, output
                    # NOTE: scheduled only after the consumer had its turn: it may have
                    # finished this choice (a stop string) in between.
                    schedule(index)
        finally:
            await self._cancel_pending()

    async def _cancel_pending(self) -> None:
        tasks = list(self._pending)
        self._pending.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def finish(self, index: int) -> None:
        """Stop one choice early (its stop string matched): abort it in the engine."""
        if not self._done[index]:
            self._done[index] = True
            await self._streams[index].aclose()

    async def aclose(self) -> None:
        """Abort every choice still running; safe to call more than once."""
        await self._cancel_pending()
        for index in range(len(self._streams)):
            if not self._done[index]:
                self._done[index] = True
                with contextlib.suppress(Exception):
                    await self._streams[index].aclose()
