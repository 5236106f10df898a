"""The async interface the serving classes use to talk to an engine core.

Two implementations share it: `InprocEngineClient` runs the core in a thread of this
process (tests, Lambda); `ZmqEngineClient` talks to the core process the gunicorn
master spawned. Serving code cannot tell them apart. Both exchange the same msgspec
messages with the core; this module holds everything but the transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import weakref
from abc import ABC, abstractmethod

from engine.collector import OutputCollector
from engine.config import ModelInfo
from engine.errors import (
    EngineDeadError,
    EngineNotReadyError,
    EngineOverloadedError,
    InvalidEngineRequestError,
    UnknownAdapterError,
)
from engine.messages import (
    AbortRequest,
    AdapterCommand,
    AdapterReply,
    AddRequest,
    Admission,
    ControlCommand,
    ControlReply,
    OutputBatch,
    PoolingParams,
    SessionCommand,
    SessionReply,
)
from engine.sampling_params import SamplingParams


def dead_error() -> EngineDeadError:
    return EngineDeadError("The engine core has died; the server is restarting.")


def stalled_error() -> EngineOverloadedError:
    return EngineOverloadedError(
        "The engine is not making progress (heartbeat stale); retry later."
    )


# Weak references, not a WeakSet: clients need not be hashable (test doubles may be
# dataclasses).
_LIVE_CLIENTS: list[weakref.ref[EngineClient]] = []


def live_clients() -> list[EngineClient]:
    """Every engine client of this process (the worker ends their streams at shutdown)."""
    alive = [c for ref in _LIVE_CLIENTS if (c := ref()) is not None]
    _LIVE_CLIENTS[:] = [weakref.ref(c) for c in alive]
    return alive


ADMISSION_TIMEOUT_S = 30.0
"""How long `add_request` waits for the engine's answer before a 503. The engine answers
between steps, so this only fires when it is stalled or the burst ahead is huge."""
ADAPTER_COMMAND_TIMEOUT_S = 120.0
"""How long a LoRA load/unload/list waits for the engine (reading an adapter's files
happens between two steps)."""

EngineCommand = AddRequest | AbortRequest | AdapterCommand | SessionCommand | ControlCommand
CallReply = AdapterReply | SessionReply | ControlReply


class EngineClient(ABC):
    """Tokens in, tokens out. Admission is answered before `add_request` returns."""

    admission_timeout_s: float = ADMISSION_TIMEOUT_S

    def __init__(self) -> None:
        _LIVE_CLIENTS.append(weakref.ref(self))
        self._collectors: dict[str, OutputCollector] = {}
        """Engine request id -> the collector of its API request, until it finishes."""
        self._admissions: dict[str, asyncio.Future[Admission]] = {}
        self._calls: dict[str, asyncio.Future[CallReply]] = {}
        """Call id -> the caller waiting for an adapter or session command's reply."""
        self._call_ids = itertools.count()
        self._model_info: ModelInfo | None = None
        self._dead = False
        self._stalled = False
        self._ready_event: asyncio.Event | None = None

    # -- state ------------------------------------------------------------------------
    @property
    def model_info(self) -> ModelInfo | None:
        """Known once the engine is ready."""
        if self._model_info is None:
            self._refresh_state()
        return self._model_info

    def is_ready(self) -> bool:
        """Warm and accepting requests (SageMaker /ping)."""
        self._refresh_state()
        return self._model_info is not None and not self._dead and not self._stalled

    def is_dead(self) -> bool:
        """The engine core is gone for good, or hung past its heartbeat limit (/health
        answers 503; a hung engine that resumes is healthy again)."""
        self._refresh_state()
        return self._dead or self._stalled

    def _refresh_state(self) -> None:  # noqa: B027 (optional hook)
        """Re-read readiness and liveness now, for transports that otherwise learn them by
        polling: every worker then answers from the same facts at the same moment, so two
        workers never disagree for a poll interval (a /ping 200 from one and a 503
        "still loading" from the other)."""

    @property
    def num_in_flight(self) -> int:
        """Requests of this worker still producing output (/load)."""
        return len(self._collectors)

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
    def _send(self, message: EngineCommand) -> None:
        """Queue a message for the engine core: never blocks, never drops."""

    async def _wait_for_send_room(self) -> None:  # noqa: B027 (optional hook)
        """Backpressure: wait while the transport's outbox is full (no-op by default)."""

    # -- requests -------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        collector: OutputCollector | None = None,
        *,
        lora_name: str | None = None,
        pooling: PoolingParams | None = None,
        session_id: str | None = None,
        cache_salt: str | None = None,
        group: str | None = None,
    ) -> OutputCollector:
        """Admit a request whose outputs go to `collector` (a new one by default; the n
        choices of one API request share one), on the LoRA adapter `lora_name` (None:
        the base), in the stateful session `session_id` (None: none); with `pooling`, an
        embedding request (one final output carrying the vector); `cache_salt`: shares
        prefix-cache blocks only with requests of the same salt; `group`: the API request
        it is one input or choice of (they take turns with later arrivals). Raises
        EngineOverloadedError / EngineDeadError / EngineNotReadyError /
        InvalidEngineRequestError / UnknownAdapterError before any output exists."""
        self._check_serving()
        if request_id in self._collectors or request_id in self._admissions:
            raise InvalidEngineRequestError(f"request id {request_id!r} is already in flight")
        if collector is None:
            collector = OutputCollector(self)
        future: asyncio.Future[Admission] = asyncio.get_running_loop().create_future()
        self._admissions[request_id] = future
        self._collectors[request_id] = collector
        collector.track(request_id)
        try:
            async with asyncio.timeout(self.admission_timeout_s):
                await self._wait_for_send_room()
                self._send(
                    AddRequest(
                        request_id=request_id,
                        prompt_token_ids=prompt_token_ids,
                        params=params,
                        priority=priority,
                        lora_name=lora_name,
                        pooling=pooling,
                        session_id=session_id,
                        cache_salt=cache_salt,
                        group=group,
                    )
                )
                admission = await future
        except TimeoutError:
            collector.abort([request_id])  # the engine may still admit it later
            raise EngineOverloadedError(
                f"The engine did not admit the request within {self.admission_timeout_s:g} s; "
                "retry later."
            ) from None
        except BaseException:
            # Cancelled while waiting for admission: the engine may still admit it.
            collector.abort([request_id])
            raise
        finally:
            self._admissions.pop(request_id, None)
        if not admission.accepted:
            self._collectors.pop(request_id, None)
            collector.forget(request_id)
            message = admission.message or "request refused"
            if admission.error_kind == "overloaded":
                raise EngineOverloadedError(message)
            if admission.error_kind == "not_found":
                raise UnknownAdapterError(message)
            raise InvalidEngineRequestError(message, param=admission.param)
        return collector

    def _check_serving(self) -> None:
        ready = self.is_ready()  # re-reads the transport's state once, for all three checks
        if self._dead:
            raise dead_error()
        if self._stalled:
            raise stalled_error()
        if not ready:
            raise EngineNotReadyError("The model is still loading; retry shortly.")

    async def adapter_command(
        self,
        op: str,
        name: str | None = None,
        path: str | None = None,
        source: str | None = None,
    ) -> AdapterReply:
        """Register ('load'), unregister ('unload') or 'list' LoRA adapters in the
        engine's one registry; the reply lists every adapter afterwards."""
        reply = await self._call(
            AdapterCommand(call_id="", op=op, name=name, path=path, source=source),
            ADAPTER_COMMAND_TIMEOUT_S,
        )
        assert isinstance(reply, AdapterReply)
        return reply

    # -- stateful sessions (engine/sessions.py) ---------------------------------------
    async def open_session(self, ttl_s: float) -> SessionReply:
        """Open a session in the engine's table (shared by every worker): its id and
        expiry. Raises EngineOverloadedError when the table is full."""
        return await self._session_call(SessionCommand(call_id="", op="open", ttl_s=ttl_s))

    async def close_session(self, session_id: str) -> None:
        """Close a session; InvalidEngineRequestError if it is unknown, closed or expired."""
        await self._session_call(SessionCommand(call_id="", op="close", session_id=session_id))

    async def _session_call(self, command: SessionCommand) -> SessionReply:
        reply = await self._call(command, self.admission_timeout_s)
        assert isinstance(reply, SessionReply)
        if reply.ok:
            return reply
        if reply.error_kind == "overloaded":
            raise EngineOverloadedError(reply.message or "no room for another session")
        raise InvalidEngineRequestError(reply.message or "session refused")

    # -- operator commands (vLLM's dev and profiler routes) ----------------------------
    async def control_command(self, command: ControlCommand) -> ControlReply:
        """Reset the prefix cache or start / stop the profiler (engine/profiler.py);
        InvalidEngineRequestError when the engine cannot (no profiler, already running)."""
        reply = await self._call(command, ADAPTER_COMMAND_TIMEOUT_S)
        assert isinstance(reply, ControlReply)
        if reply.error_kind is not None:
            raise InvalidEngineRequestError(reply.message or "refused")
        return reply

    async def _call(
        self, command: AdapterCommand | SessionCommand | ControlCommand, timeout_s: float
    ) -> CallReply:
        """Send a command the engine answers with one reply (matched by call id)."""
        self._check_serving()
        command.call_id = f"{command.op}-{next(self._call_ids)}"
        future: asyncio.Future[CallReply] = asyncio.get_running_loop().create_future()
        self._calls[command.call_id] = future
        try:
            async with asyncio.timeout(timeout_s):
                await self._wait_for_send_room()
                self._send(command)
                return await future
        except TimeoutError:
            raise EngineOverloadedError(
                f"The engine did not answer within {timeout_s:g} s; retry later."
            ) from None
        finally:
            self._calls.pop(command.call_id, None)

    async def abort(self, request_ids: list[str]) -> None:
        self._abort_now(request_ids)

    def _abort_now(self, request_ids: list[str]) -> None:
        """Tell the engine to stop these requests (those still in flight here)."""
        ids = [rid for rid in request_ids if self._collectors.pop(rid, None) is not None]
        if ids and not self._dead:
            self._send(AbortRequest(ids))

    # -- incoming (called on the event loop) ------------------------------------------
    def _dispatch(self, message: Admission | OutputBatch | CallReply) -> None:
        if isinstance(message, OutputBatch):
            collectors = self._collectors
            for out in message.outputs:
                collector = collectors.get(out.request_id)
                if collector is not None:
                    if out.finish_reason is not None:
                        del collectors[out.request_id]
                    collector.put(out)
        elif isinstance(message, AdapterReply | SessionReply | ControlReply):
            call = self._calls.get(message.call_id)
            if call is not None and not call.done():
                call.set_result(message)
        else:
            future = self._admissions.get(message.request_id)
            if future is not None and not future.done():
                future.set_result(message)

    def _pending_calls(self) -> list[asyncio.Future[Admission] | asyncio.Future[CallReply]]:
        return [*self._admissions.values(), *self._calls.values()]

    def _set_ready(self, info: ModelInfo) -> None:
        self._model_info = info
        if self._ready_event is not None:
            self._ready_event.set()

    def _set_dead(self) -> None:
        if self._dead:
            return
        self._dead = True
        error = dead_error()
        for future in self._pending_calls():
            if not future.done():
                future.set_exception(error)
        self.fail_in_flight(error)
        if self._ready_event is not None:
            self._ready_event.set()

    def _set_stalled(self, stalled: bool) -> None:
        """The engine's heartbeat went stale (or came back). Waiting callers get a 503
        now instead of hanging; their requests are aborted so a resumed engine frees them."""
        if stalled == self._stalled:
            return
        self._stalled = stalled
        if not stalled:
            return
        error = stalled_error()
        for future in self._pending_calls():
            if not future.done():
                future.set_exception(error)  # add_request aborts it in the engine
        self.fail_in_flight(error)

    def fail_in_flight(self, error: BaseException) -> int:
        """End every running request of this client with `error` (the serving layer turns
        it into an error chunk and `[DONE]`) and abort them in the engine. Used when the
        drain deadline comes, so a client sees a clean end instead of a cut connection."""
        ids = list(self._collectors)
        collectors = {id(c): c for c in self._collectors.values()}
        self._collectors.clear()
        for collector in collectors.values():
            collector.fail(error)
        if ids and not self._dead:
            self._send(AbortRequest(ids))
        return len(ids)
