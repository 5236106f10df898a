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


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An embedding request: prefill only, the pooled hidden state comes back instead of
    tokens (engine/pooler.py). How to pool is the model's (`engine/pooling_config.py`)."""

    dimensions: int | None = None
    """Keep the first `dimensions` values (Matryoshka), before normalising; None: all."""
    normalize: bool | None = None
    """vLLM's `use_activation`: whether to L2-normalise; None: as the model prescribes."""


class AddRequest(msgspec.Struct, tag="add", kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    """Lower runs first under --scheduling-policy priority (vLLM's convention)."""
    arrival_time: float = 0.0
    pooling: PoolingParams | None = None
    """Set for an embedding request (then `params` is unused: nothing is sampled)."""
    lora_name: str | None = None
    """The LoRA adapter to run with (the request's `model`, or SageMaker's adapter
    header); None: the base model."""
    session_id: str | None = None
    """The stateful session the request runs in (`X-Amzn-SageMaker-Session-Id`): the
    engine refuses it ('invalid') unless the session is open, and pins its KV blocks to
    the session when it ends."""
    group: str | None = None
    """The API request this one belongs to (its other choices or inputs share it): under
    fcfs the inputs of one API request take turns with later arrivals. None: its own."""
    cache_salt: str | None = None
    """vLLM's `cache_salt`: the request's prefix-cache hash chain is seeded with it, so
    it shares cached KV blocks only with requests of the same salt (a tenant cannot
    learn from timing whether another tenant sent a prompt)."""


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
    """'overloaded' (queue full, no LoRA slot -> 503), 'invalid' (-> 400) or 'not_found'
    (an unknown LoRA adapter -> 404) when not accepted."""
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
    embedding: bytes | None = None
    """An embedding request's result, on its one (final) output: float32 values, little
    endian (exactly what OpenAI's `encoding_format: base64` encodes)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class AdapterCommand(msgspec.Struct, tag="adapter", kw_only=True):
    """Register, unregister or list LoRA adapters (the load/unload routes, /v1/models).
    The engine holds the one registry, so every API worker sees the same adapters."""

    call_id: str
    op: str
    """'load', 'unload' or 'list'."""
    name: str | None = None
    path: str | None = None
    """'load': a local adapter directory (the worker fetched an s3:// source already)."""
    source: str | None = None
    """'load': where the client said the adapter is (`/v1/models` shows it as `root`):
    the s3:// URL of a fetched adapter, whose download is gone once it is read."""


class AdapterCard(msgspec.Struct, kw_only=True):
    name: str
    path: str
    rank: int
    resident: bool
    """In a --max-loras slot now (else loaded on the next request that names it)."""


class AdapterReply(msgspec.Struct, tag="adapter_reply", kw_only=True):
    call_id: str
    ok: bool
    error_kind: str | None = None
    """'not_found', 'invalid' (bad files, rank, targets), 'conflict' (name taken) or
    'disabled' (no --enable-lora) when not ok."""
    message: str | None = None
    adapters: list[AdapterCard] = msgspec.field(default_factory=list)
    """Every registered adapter after the command."""


class ControlCommand(msgspec.Struct, tag="control", kw_only=True):
    """An operator's command to the engine (vLLM's dev and profiler routes): 'reset_prefix_cache',
    'start_profile' or 'stop_profile'; answered by ControlReply."""

    call_id: str
    op: str
    reset_running_requests: bool = False
    """reset_prefix_cache: preempt the running requests (they recompute) so every block
    can be forgotten; otherwise the reset fails while any block is in use."""
    profile_prefix: str | None = None
    delay_iterations: int | None = None
    max_iterations: int | None = None


class ControlReply(msgspec.Struct, tag="control_reply", kw_only=True):
    call_id: str
    ok: bool
    """The command ran (reset_prefix_cache: the cache was emptied)."""
    error_kind: str | None = None
    """'invalid' (-> 400: profiler not running, already running) when it could not run."""
    message: str | None = None
    files: list[str] = msgspec.field(default_factory=list)
    """stop_profile: the trace and table files written."""


class OutputBatch(msgspec.Struct, tag="outs"):
    """All outputs of one engine step that belong to one worker."""

    outputs: list[RequestOutput]


EngineMessage = AddRequest | AbortRequest | AdapterCommand | SessionCommand | ControlCommand | Hello
WorkerMessage = Admission | OutputBatch | AdapterReply | SessionReply | ControlReply
