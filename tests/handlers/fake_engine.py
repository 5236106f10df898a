"""A scripted EngineClient for the handler tests.

It is a real `EngineClient` whose transport hook (`_send`) is the "engine": admission,
output collectors, dispatch and aborts are the production code, and the fake answers
`AddRequest` with an `Admission` and pushes `OutputBatch`es through `_dispatch` as the
IPC reader does. It emulates the engine's token-level rules:
EOS and `stop_token_ids` stop a sequence (after `min_tokens`, unless `ignore_eos`),
`max_tokens` ends it with 'length'; like the engine, it says when the last token is the
stop token (`finished_on_stop_token`). Each test scripts the tokens a request produces;
the fake records admissions and aborts, can refuse admission, fail mid-stream, or
die, and reports which requests are still live (never aborted nor finished). An
embedding request (`pooling` set) gets one output carrying `fake_embedding` of its
prompt, truncated to its `dimensions` as the engine would.
"""

from __future__ import annotations

import asyncio
import math
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.client import EngineClient
from engine.config import ModelInfo
from engine.messages import (
    AbortRequest,
    AdapterCommand,
    AdapterReply,
    AddRequest,
    Admission,
    OutputBatch,
    PoolingParams,
    RequestOutput,
    SessionCommand,
    SessionReply,
    TokenLogprob,
)
from engine.sampling_params import SamplingParams

SESSION_GONE = "The session is unknown, closed or expired; start a new one (NEW_SESSION)."


@dataclass
class Script:
    """What the fake engine produces for one request."""

    token_ids: list[int]
    """Tokens to sample, in order; the engine rules may stop earlier."""
    tokens_per_step: int = 1
    step_delay: float = 0.0
    hold: asyncio.Event | None = None
    """Wait for this event before the first output (a long prefill)."""
    fail_at_step: int | None = None
    """Report finish_reason='error' at this step."""
    raise_at_step: int | None = None
    """The engine dies at this step (every request gets EngineDeadError)."""
    num_cached_tokens: int = 0


@dataclass
class AddedRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    pooling: PoolingParams | None = None
    session_id: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    group: str | None = None


def fake_embedding(prompt_token_ids: list[int], size: int) -> list[float]:
    """The fake engine's vector for a prompt: float32 values that differ per prompt."""
    seed = sum(prompt_token_ids) + len(prompt_token_ids)
    return array("f", [math.sin(seed + 0.37 * j) for j in range(size)]).tolist()


ScriptFn = Callable[[AddedRequest], Script]


@dataclass
class FakeEngine(EngineClient):
    """EngineClient whose "engine" is a coroutine per request following a Script."""

    info: ModelInfo
    script: ScriptFn | Script | None = None
    ready: bool = True
    refuse_after: int | None = None
    """Admit this many requests, then raise EngineOverloadedError."""
    added: list[AddedRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    started: bool = False
    closed: bool = False
    _dead: bool = False
    _tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    sessions: set[str] = field(default_factory=set)
    """Open stateful sessions (the engine's table, engine/sessions.py, in miniature)."""

    def __post_init__(self) -> None:
        EngineClient.__init__(self)

    # -- EngineClient -----------------------------------------------------------------
    @property
    def model_info(self) -> ModelInfo | None:
        return self.info if self.ready else None

    def is_ready(self) -> bool:
        return self.ready and not self._dead

    def is_dead(self) -> bool:
        return self._dead

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True
        for task in self._tasks.values():
            task.cancel()

    async def wait_ready(self, timeout: float | None = None) -> ModelInfo:
        return self.info

    def _send(self, message: AddRequest | AbortRequest | SessionCommand | AdapterCommand) -> None:
        loop = asyncio.get_running_loop()
        if isinstance(message, SessionCommand):
            loop.call_soon(self._dispatch, self._session_reply(message))
            return
        if isinstance(message, AdapterCommand):
            loop.call_soon(self._dispatch, self._adapter_reply(message))
            return
        if isinstance(message, AbortRequest):
            for request_id in message.request_ids:
                self.aborted.append(request_id)
                task = self._tasks.get(request_id)
                if task is not None:
                    task.cancel()
            return
        request_id = message.request_id
        if self.refuse_after is not None and len(self.added) >= self.refuse_after:
            refusal = Admission(
                request_id=request_id,
                accepted=False,
                error_kind="overloaded",
                message="The waiting queue is full; retry later.",
            )
            loop.call_soon(self._dispatch, refusal)
            return
        if message.session_id is not None and message.session_id not in self.sessions:
            refusal = Admission(
                request_id=request_id, accepted=False, error_kind="invalid", message=SESSION_GONE
            )
            loop.call_soon(self._dispatch, refusal)
            return
        request = AddedRequest(
            request_id,
            list(message.prompt_token_ids),
            message.params,
            message.priority,
            message.pooling,
            message.session_id,
            message.lora_name,
            message.cache_salt,
            message.group,
        )
        self.added.append(request)
        # Admission is a round trip in the real clients: answered on a later loop turn.
        loop.call_soon(self._dispatch, Admission(request_id=request_id, accepted=True))
        script = self._script_for(request)
        self._tasks[request_id] = asyncio.create_task(self._produce(request, script))

    def _adapter_reply(self, command: AdapterCommand) -> AdapterReply:
        """The registry in miniature: it holds no adapter (list empty, unload 404s)."""
        if command.op == "list":
            return AdapterReply(call_id=command.call_id, ok=True)
        return AdapterReply(
            call_id=command.call_id,
            ok=False,
            error_kind="not_found",
            message=f"The lora adapter '{command.name}' cannot be found.",
        )

    def _session_reply(self, command: SessionCommand) -> SessionReply:
        if command.op == "open":
            session_id = f"session{len(self.sessions)}-" + "x" * 24
            self.sessions.add(session_id)
            return SessionReply(
                call_id=command.call_id, ok=True, session_id=session_id, expires_at=2e9
            )
        if command.session_id in self.sessions:
            self.sessions.discard(command.session_id)
            return SessionReply(call_id=command.call_id, ok=True, session_id=command.session_id)
        return SessionReply(
            call_id=command.call_id, ok=False, error_kind="invalid", message=SESSION_GONE
        )

    # -- test controls ----------------------------------------------------------------
    def die(self) -> None:
        """The engine core is gone: every request in flight gets EngineDeadError."""
        for task in self._tasks.values():
            task.cancel()
        self._set_dead()

    @property
    def live(self) -> set[str]:
        """Requests still producing, or whose client still waits for their end."""
        running = {rid for rid, task in self._tasks.items() if not task.done()}
        return running | set(self._collectors)

    async def settle(self) -> None:
        """Let scheduled aborts and producers run (the SSE generator is closed by the
        event loop's async-generator finalizer, a task of its own)."""
        for _ in range(20):
            await asyncio.sleep(0.001)

    # -- the "engine" -----------------------------------------------------------------
    def _script_for(self, request: AddedRequest) -> Script:
        if callable(self.script):
            return self.script(request)
        if isinstance(self.script, Script):
            return self.script
        return Script(token_ids=[5, 6, 7, self.info.eos_token_ids[0]])

    async def _produce(self, request: AddedRequest, script: Script) -> None:
        params = request.params
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.info.eos_token_ids)
        if script.hold is not None:
            await script.hold.wait()
        generated: list[int] = []
        remaining = list(script.token_ids)
        step = 0
        first = True
        while True:
            if script.step_delay:
                await asyncio.sleep(script.step_delay)
            else:
                await asyncio.sleep(0)
            if script.raise_at_step == step:
                self.die()
                return
            new: list[int] = []
            finish: str | None = None
            stop_reason: int | None = None
            on_stop_token = False
            if script.fail_at_step == step:
                finish = "error"
            elif request.pooling is not None:
                self._dispatch(OutputBatch([self._embedding_output(request)]))
                return
            elif params.max_tokens == 0:
                finish = "length"  # score only: nothing is generated
            if not remaining and finish is None:
                # The script ran dry before any engine rule ended the request: a real
                # engine would go on generating, so the request stays live until the
                # serving layer aborts it (that is what `live` checks).
                await asyncio.Event().wait()
            while finish is None and len(new) < script.tokens_per_step:
                if not remaining:
                    break
                token = remaining.pop(0)
                new.append(token)
                generated.append(token)
                if token in stop_ids and len(generated) > params.min_tokens:
                    finish = "stop"
                    stop_reason = token if token in params.stop_token_ids else None
                    on_stop_token = True
                elif len(generated) >= params.max_tokens:
                    finish = "length"
            output = RequestOutput(
                request_id=request.request_id,
                new_token_ids=new,
                new_logprobs=_logprobs(new, params.logprobs, params.logprob_token_ids),
                finish_reason=finish,
                stop_reason=stop_reason,
                finished_on_stop_token=on_stop_token,
                num_prompt_tokens=len(request.prompt_token_ids) if first else 0,
                num_cached_tokens=script.num_cached_tokens if first else 0,
                error="scripted failure" if finish == "error" else None,
                prompt_logprobs=_prompt_logprobs(request.prompt_token_ids, params.prompt_logprobs)
                if first
                else None,
            )
            first = False
            self._dispatch(OutputBatch([output]))
            step += 1
            if finish is not None:
                return

    def _embedding_output(self, request: AddedRequest) -> RequestOutput:
        assert request.pooling is not None and self.info.pooling is not None
        classifier = self.info.pooling.classifier  # its "vector" is the head's logits
        size = (
            classifier.num_labels
            if classifier is not None
            else request.pooling.dimensions or self.info.pooling.hidden_size
        )
        vector = array("f", fake_embedding(request.prompt_token_ids, size))
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=[],
            embedding=vector.tobytes(),
            finish_reason="stop",
            num_prompt_tokens=len(request.prompt_token_ids),
        )


def _logprobs(
    token_ids: list[int], k: int | None, named: list[int] | None = None
) -> list[TokenLogprob] | None:
    """The sampled token at -0.5 and rank 1; its top k ids after it at -0.5 - j, or, with
    `logprob_token_ids`, those ids at -1 - id / 100 (distinct and known to the tests)."""
    if k is None:
        return None
    out = []
    for token_id in token_ids:
        if named:
            top = [(t, -1.0 - t / 100) for t in named]
        else:
            top = [(token_id, -0.5)] + [(token_id + j, -0.5 - j) for j in range(1, k)]
        out.append(TokenLogprob(token_id=token_id, logprob=-0.5, rank=1, top=top[:k]))
    return out


def _prompt_logprobs(prompt: list[int], k: int | None) -> list[TokenLogprob | None] | None:
    """Prompt token i gets logprob -i/10 and rank 2; its top k are ids (7i + j) % 256."""
    if k is None:
        return None
    entries: list[TokenLogprob | None] = [None]
    for i, token_id in enumerate(prompt[1:], start=1):
        top = [((7 * i + j) % 256, -0.01 * (j + 1)) for j in range(k)]
        entries.append(TokenLogprob(token_id=token_id, logprob=-i / 10, rank=2, top=top))
    return entries
