"""Messages that cross the API worker <-> engine core boundary.

All are msgspec Structs tagged by type so one msgpack decoder reads any frame.
"""

from __future__ import annotations

import msgspec

from engine.sampling_params import SamplingParams


class TokenLogprob(msgspec.Struct, array_like=True):
    """The sampled token's logprob and the top-k alternatives (id, logprob)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


class AddRequest(msgspec.Struct, tag="add", kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    """Lower runs first under --scheduling-policy priority (vLLM's convention)."""
    arrival_time: float = 0.0
    session_id: str | None = None
    """The stateful session the request runs in (`X-Amzn-SageMaker-Session-Id`): the
    engine refuses it ('invalid') unless the session is open, and pins its KV blocks to
    the session when it ends."""


class AbortRequest(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class SessionCommand(msgspec.Struct, tag="session", kw_only=True):
    """Open or close a stateful session (engine/sessions.py); answered by SessionReply."""

    call_id: str
    """Names the reply (unique among this worker's pending calls)."""
    op: str
    """'open' or 'close'."""
    session_id: str | None = None
    """The session to close (open: None, the engine makes the id)."""
    ttl_s: float = 0.0
    """Open: seconds until the session expires."""


class SessionReply(msgspec.Struct, tag="session_reply", kw_only=True):
    call_id: str
    ok: bool
    session_id: str | None = None
    expires_at: float = 0.0
    """Unix time at which the session expires (open)."""
    error_kind: str | None = None
    """'invalid' (unknown, closed or expired session -> 400) or 'overloaded' (-> 503)."""
    message: str | None = None


class Hello(msgspec.Struct, tag="hello"):
    """A worker announcing itself so the engine knows where to route outputs."""


class Admission(msgspec.Struct, tag="admission", kw_only=True):
    """The engine's answer to AddRequest, sent before any output for it."""

    request_id: str
    accepted: bool
    error_kind: str | None = None
    """'overloaded' (queue full -> 503) or 'invalid' (-> 400) when not accepted."""
    message: str | None = None
    param: str | None = None
    """The request field at fault, when the engine knows it (a constraint that failed
    to compile)."""


class RequestOutput(msgspec.Struct, tag="out", kw_only=True, omit_defaults=True):
    """New tokens of one request from one engine step (a delta, not the whole text)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """One entry per prompt token (the first is None), on the request's first output only,
    when it asked for prompt logprobs."""
    finish_reason: str | None = None
    """None while running; 'stop' (EOS or stop token), 'length', 'abort' or 'error'."""
    stop_reason: int | None = None
    """The stop token id that ended the request, when finish_reason is 'stop' by a stop token."""
    finished_on_stop_token: bool = False
    """The last of `new_token_ids` is the EOS or `stop_token_ids` token that ended the
    request. The engine is the one that knows which token stopped it (the EOS ids are
    the model's, `ignore_eos` and `min_tokens` decide whether they count), so the worker
    reads this instead of re-deriving it when it leaves the stop token's text out."""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (set on the first output)."""
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputBatch(msgspec.Struct, tag="outs"):
    """All outputs of one engine step that belong to one worker."""

    outputs: list[RequestOutput]


EngineMessage = AddRequest | AbortRequest | SessionCommand | Hello
WorkerMessage = Admission | OutputBatch | SessionReply
