"""The async interface the serving classes use to talk to an engine core.

Two implementations share it: `InprocEngineClient` runs the core in a thread of this
process (tests, Lambda); `ZmqEngineClient` talks to the core process the gunicorn
master spawned. Serving code cannot tell them apart. Both exchange the same msgspec
messages with the core; this module holds everything but the transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator

from engine.config import ModelInfo
from engine.errors import (
    EngineDeadError,
    EngineNotReadyError,
    EngineOverloadedError,
    InvalidEngineRequestError,
)
from engine.messages import AbortRequest, AddRequest, Admission, OutputBatch, RequestOutput
from engine.sampling_params import SamplingParams


class RequestStream:
    """Outputs of one admitted request, in order; closing it early aborts the request.

    The serving layer must either iterate to the end or call `aclose()` (an `async
    with` or a `finally` does it): that is what frees the request's KV blocks when a
    client disconnects.
    """

    def __init__(self, request_id: str, client: EngineClient) -> None:
        self.request_id = request_id
        self._client = client
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished:
            raise StopAsyncIteration
        return self._take(await self._queue.get())

    def get_nowait(self) -> RequestOutput | None:
        """The next queued output if one is already here (to coalesce a burst)."""
        if self._finished or self._queue.empty():
            return None
        return self._take(self._queue.get_nowait())

    def _take(self, item: RequestOutput | BaseException) -> RequestOutput:
        """Hand one queued item to the consumer; the last one (or an error) ends the stream."""
        if isinstance(item, BaseException) or item.finished:
            self._finished = True
            self._client._forget(self.request_id)
        if isinstance(item, BaseException):
            raise item
        return item

    @property
    def finished(self) -> bool:
        return self._finished

    async def aclose(self) -> None:
        if not self._finished:
            self._finished = True
            self._client._forget(self.request_id)
            await self._client.abort([self.request_id])

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def dead_error() -> EngineDeadError:
    return EngineDeadError("The engine core has died; the server is restarting.")


# Weak references, not a WeakSet: clients need not be hashable (test doubles may be
# dataclasses).
_LIVE_CLIENTS: list[weakref.ref[EngineClient]] = []


def live_clients() -> list[EngineClient]:
    """Every engine client of this process (the worker ends their streams at shutdown)."""
    alive = [c for ref in _LIVE_CLIENTS if (c := ref()) is not None]
    _LIVE_CLIENTS[:] = [weakref.ref(c) for c in alive]
    return alive


class EngineClient(ABC):
    """Tokens in, tokens out. Admission is answered before `add_request` returns."""

    def __init__(self) -> None:
        _LIVE_CLIENTS.append(weakref.ref(self))
        self._streams: dict[str, RequestStream] = {}
        self._admissions: dict[str, asyncio.Future[Admission]] = {}
        self._model_info: ModelInfo | None = None
        self._dead = False
        self._ready_event: asyncio.Event | None = None

    # -- state ------------------------------------------------------------------------
    @property
    def model_info(self) -> ModelInfo | None:
        """Known once the engine is ready."""
        return self._model_info

    def is_ready(self) -> bool:
        """Warm and accepting requests (SageMaker /ping)."""
        return self._model_info is not None and not self._dead

    def is_dead(self) -> bool:
        """The engine core is gone for good (/health answers 503)."""
        return self._dead

    @property
    def num_in_flight(self) -> int:
        """Requests of this worker still producing output (/load)."""
        return len(self._streams)

    @abstractmethod
    async def start(self) -> None:
        """Connect (or start the in-process core); returns without waiting for warm-up."""

    async def wait_ready(self, timeout: float | None = None) -> ModelInfo:
        """Block until the engine is warm; raises EngineDeadError if it dies first."""
        if self._ready_event is None:
            self._ready_event = asyncio.Event()
        async with asyncio.timeout(timeout):
            while not self.is_ready():
                if self._dead:
                    raise dead_error()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._ready_event.wait(), 0.2)
        assert self._model_info is not None
        return self._model_info

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    def _send(self, message: AddRequest | AbortRequest) -> None:
        """Hand a message to the engine core (never blocks)."""

    # -- requests -------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> RequestStream:
        """Admit a request; raises EngineOverloadedError / EngineDeadError /
        EngineNotReadyError / InvalidEngineRequestError before any output exists."""
        if self._dead:
            raise dead_error()
        if not self.is_ready():
            raise EngineNotReadyError("The model is still loading; retry shortly.")
        if request_id in self._streams or request_id in self._admissions:
            raise InvalidEngineRequestError(f"request id {request_id!r} is already in flight")
        future: asyncio.Future[Admission] = asyncio.get_running_loop().create_future()
        self._admissions[request_id] = future
        stream = RequestStream(request_id, self)
        self._streams[request_id] = stream
        try:
            self._send(
                AddRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt_token_ids,
                    params=params,
                    priority=priority,
                )
            )
            admission = await future
        except BaseException:
            self._streams.pop(request_id, None)
            if not self._dead:
                # Cancelled while waiting for admission: the engine may still admit it.
                self._send(AbortRequest([request_id]))
            raise
        finally:
            self._admissions.pop(request_id, None)
        if not admission.accepted:
            self._streams.pop(request_id, None)
            message = admission.message or "request refused"
            if admission.error_kind == "overloaded":
                raise EngineOverloadedError(message)
            raise InvalidEngineRequestError(message, param=admission.param)
        return stream

    async def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._streams.pop(rid, None)
        if not self._dead and request_ids:
            self._send(AbortRequest(request_ids))

    # -- incoming (called on the event loop) ------------------------------------------
    def _dispatch(self, message: Admission | OutputBatch) -> None:
        if isinstance(message, OutputBatch):
            for out in message.outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put(out)
        else:
            future = self._admissions.get(message.request_id)
            if future is not None and not future.done():
                future.set_result(message)

    def _set_ready(self, info: ModelInfo) -> None:
        self._model_info = info
        if self._ready_event is not None:
            self._ready_event.set()

    def _set_dead(self) -> None:
        if self._dead:
            return
        self._dead = True
        error = dead_error()
        for future in self._admissions.values():
            if not future.done():
                future.set_exception(error)
        self.fail_in_flight(error)
        if self._ready_event is not None:
            self._ready_event.set()

    def fail_in_flight(self, error: BaseException) -> int:
        """End every running stream of this client with `error` (the serving layer turns
        it into an error chunk and `[DONE]`) and abort them in the engine. Used when the
        drain deadline comes, so a client sees a clean end instead of a cut connection."""
        streams = list(self._streams.values())
        for stream in streams:
            stream.put(error)
        ids = [s.request_id for s in streams]
        self._streams.clear()
        if ids and not self._dead:
            self._send(AbortRequest(ids))
        return len(ids)

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
