"""The async interface the serving classes use to talk to an engine core.

Two implementations share it: `InprocEngineClient` runs the core in a thread of this
process (tests, Lambda); `ZmqEngineClient` talks to the core process the gunicorn
master spawned. Serving code cannot tell them apart.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator

from engine.config import ModelInfo
from engine.errors import EngineDeadError
from engine.outputs import RequestOutput
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

    # -- producer side (the client's reader) ---------------------------------
    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    # -- consumer side -------------------------------------------------------
    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._finished = True
            self._client._forget(self.request_id)
            raise item
        if item.finished:
            self._finished = True
            self._client._forget(self.request_id)
        return item

    async def aclose(self) -> None:
        if not self._finished:
            self._finished = True
            self._client._forget(self.request_id)
            await self._client.abort([self.request_id])

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class EngineClient(ABC):
    """Tokens in, tokens out. Admission is answered before `add_request` returns."""

    def __init__(self) -> None:
        self._streams: dict[str, RequestStream] = {}

    @property
    @abstractmethod
    def model_info(self) -> ModelInfo | None:
        """Known once the engine is ready."""

    @abstractmethod
    def is_ready(self) -> bool:
        """Warm and accepting requests (SageMaker /ping)."""

    @abstractmethod
    def is_dead(self) -> bool:
        """The engine core is gone for good (/health answers 503)."""

    @abstractmethod
    async def start(self) -> None:
        """Connect (or start the in-process core); returns without waiting for warm-up."""

    @abstractmethod
    async def wait_ready(self, timeout: float | None = None) -> ModelInfo:
        """Block until the engine is warm; raises EngineDeadError if it dies first."""

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> RequestStream:
        """Admit a request; raises EngineOverloadedError / EngineDeadError / InvalidEngineRequestError."""

    @abstractmethod
    async def abort(self, request_ids: list[str]) -> None: ...

    @property
    def num_in_flight(self) -> int:
        """Requests of this worker still producing output (/load)."""
        return len(self._streams)

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def _fail_all(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream.put(error)
        self._streams.clear()


def dead_error() -> EngineDeadError:
    return EngineDeadError("The engine core process has died; the server is restarting.")
