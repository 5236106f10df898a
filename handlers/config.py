"""Settings of the API workers, carried from the CLI to every gunicorn worker.

The CLI builds one `ServerConfig` from its flags and exports it as a single JSON
environment variable (`HEARTH_SERVER_CONFIG`); each worker process rebuilds it with
`from_env()`. One variable instead of one per flag keeps the worker side from
re-implementing flag parsing, and a bad value fails the worker at import, loudly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

import msgspec

from engine.config import DEFAULT_HEARTBEAT_TIMEOUT_S
from handlers.protocol.base import DEFAULT_LIMITS, RequestLimits

ENV_VAR = "HEARTH_SERVER_CONFIG"
"""The transport of the whole config from the CLI to its workers (docs/architecture.md,
"Configuration"): one JSON variable, written by `to_env`, not a setting of its own."""

DEFAULT_MAX_REQUEST_BODY_BYTES = 6 * 1024 * 1024
"""SageMaker's InvokeEndpoint limit (6 MiB); a bigger body could never arrive there."""

DEFAULT_SESSION_TTL_S = 1200.0
"""AWS's container standards' default session lifetime (SAGEMAKER_SESSIONS_EXPIRATION)."""


DEFAULT_RESPONSES_STORE_MAX_ENTRIES = 1024
DEFAULT_RESPONSES_STORE_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_RESPONSES_STORE_TTL_S = 3600.0
"""The stored responses of /v1/responses: 1024 entries, 256 MiB and one hour, whichever
bound is reached first (handlers/serving/response_store.py)."""

_LIMIT_MINIMUMS = {
    "max_n": 1,
    "max_request_body_bytes": 1,
    "max_stop_strings": 1,
    "max_logprobs": 0,
    "responses_store_max_entries": 0,
    "responses_store_max_bytes": 1,
}


def path_label(model: str) -> str:
    """A model path's last part (`/srv/models/llama-3/` -> `llama-3`): the name to show
    where the path itself should not be; a bare name is itself."""
    return PurePath(model.rstrip("/")).name or model


def digest_api_key(key: str) -> str:
    """SHA-256 hex digest of an API key; only digests are kept and compared."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """What the API worker needs beyond the engine: names, auth, CORS, limits."""

    model_dir: str | None = None
    """Directory of tokenizer.json / chat_template.jinja; None: the engine's ModelInfo.model_dir."""
    served_model_names: tuple[str, ...] = ()
    """Names a request's `model` may use; the first is reported. Empty: model_dir (or 'default')."""
    metrics_model_name: str = ""
    """The `model_name` label of the /metrics series; empty: the reported served name.
    Where that name defaults to the model's path (no --served-model-name), it is the
    path's last part: series end up in dashboards and scrapers that see no other route,
    and a filesystem path in every one tells them the host's layout (issue 17)."""
    api_key_digests: tuple[str, ...] = ()
    """SHA-256 hex digests of the accepted API keys (`digest_api_key`); empty: no auth."""
    response_role: str = "assistant"
    """Role of the generated message (vLLM's --response-role)."""
    tool_call_parser: str | None = None
    """Tool-call format ('hermes', 'llama3_json', 'mistral'); None: from the chat template."""
    reasoning_parser: str | None = None
    """'think', 'harmony' or 'none'; None: 'harmony' for gpt-oss (or a template with
    harmony channels), else 'think' when the chat template mentions <think>."""
    chat_template: str | None = None
    """Template text overriding the model's own (the CLI reads --chat-template files)."""
    trust_request_chat_template: bool = False
    """Accept a `chat_template` in the request body (arbitrary Jinja from clients)."""
    allowed_origins: tuple[str, ...] = ()
    """CORS origins; empty disables CORS (no Access-Control-* headers at all)."""
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    enable_request_id_headers: bool = False
    """Echo the request id in an `X-Request-Id` response header."""
    sse_keep_alive_interval: float | None = None
    """Seconds between `: ping` comments while a stream waits for the engine, for proxies
    that close quiet connections; None (default): no comments, which some clients (e.g.
    `vllm bench serve`) cannot parse. Disconnects are noticed without them."""
    request_timeout: float | None = None
    """Seconds after arrival at which a request still generating is ended with a 504
    error (or an error event) and aborted in the engine; None: no deadline."""
    enable_server_load_tracking: bool = False
    """Expose GET /load."""
    enable_tokenizer_info_endpoint: bool = False
    server_dev_mode: bool = False
    """vLLM's developer routes (VLLM_SERVER_DEV_MODE there, --server-dev-mode here):
    POST /reset_prefix_cache, /reset_mm_cache, /reset_encoder_cache, GET /server_info."""
    enable_profiler_routes: bool = False
    """POST /start_profile and /stop_profile: set when --profiler-config names a profiler."""
    """Expose GET /tokenizer_info (vLLM's flag of the same name)."""
    enable_lora: bool = False
    """--enable-lora: a `model` that is not a served name names a LoRA adapter."""
    enable_runtime_lora_updating: bool = False
    """--enable-runtime-lora-updating (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING): with
    --enable-lora, the adapter routes exist (SageMaker's /adapters, vLLM's load/unload).
    Off, a client cannot make the server read a directory or an S3 object, or unload an
    adapter others use; the start-up adapters serve as they are."""
    enable_prompt_tokens_details: bool = False
    """Report usage.prompt_tokens_details.cached_tokens (prefix-cache hits)."""
    root_path: str = ""
    """Path prefix added by a proxy in front of the server; stripped before routing."""
    disable_log_requests: bool = False
    """No per-request log line (vLLM's --disable-log-requests)."""
    max_log_len: int | None = None
    """Characters of a prompt shown in debug logs; None: all."""
    max_n: int = DEFAULT_LIMITS.max_n
    """Upper bound of `n` (each choice is one engine request; --max-n)."""
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    """--max-request-body-bytes: a bigger body is a 413, read no further."""
    max_stop_strings: int = DEFAULT_LIMITS.max_stop_strings
    """--max-stop-strings."""
    max_logprobs: int = DEFAULT_LIMITS.max_logprobs
    """Upper bound of top_logprobs / completion logprobs (vLLM's --max-logprobs)."""
    engine_heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    """Seconds the engine's heartbeat may be stale before the worker calls it hung
    (--engine-heartbeat-timeout)."""
    runtime_dir: str | None = None
    """The engine's socket and runtime files: a directory `hearth serve` makes per run
    (not a flag). None outside `hearth serve` (in-process engines need none)."""
    enable_stateful_sessions: bool = False
    """Answer SageMaker's session requests on /invocations (`handlers/serving/sessions.py`)."""
    session_ttl: float = DEFAULT_SESSION_TTL_S
    """Seconds from NEW_SESSION until a session expires (SageMaker's
    SAGEMAKER_SESSIONS_EXPIRATION, 1200 by default)."""
    generation_config: str = "auto"
    """'auto': the model's generation_config.json sets default sampling params (as vLLM);
    'vllm': OpenAI defaults only."""
    background_responses: bool = True
    """Whether `/v1/responses` runs `background: true` (a long-running server; the Lambda
    entry turns it off: its process is frozen between invocations)."""
    responses_store_max_entries: int = DEFAULT_RESPONSES_STORE_MAX_ENTRIES
    """Stored responses (`store: true` of /v1/responses) kept at most; the oldest go
    first; 0: nothing is stored (--responses-store-max-entries)."""
    responses_store_max_bytes: int = DEFAULT_RESPONSES_STORE_MAX_BYTES
    """Bytes of stored responses and their conversations kept at most
    (--responses-store-max-bytes)."""
    responses_store_ttl: float = DEFAULT_RESPONSES_STORE_TTL_S
    """Seconds a stored response is kept (--responses-store-ttl)."""

    def __post_init__(self) -> None:
        # NOTE: lists from callers (and JSON) become tuples so the config is really immutable.
        for name in (
            "served_model_names",
            "api_key_digests",
            "allowed_origins",
            "allowed_methods",
            "allowed_headers",
        ):
            value = getattr(self, name)
            if isinstance(value, str):
                raise TypeError(f"ServerConfig.{name} must be a list of strings, not a string")
            object.__setattr__(self, name, tuple(value))
        if not self.served_model_names:
            default = self.model_dir.rstrip("/") if self.model_dir else "default"
            object.__setattr__(self, "served_model_names", (default,))
            if not self.metrics_model_name:
                object.__setattr__(self, "metrics_model_name", path_label(default))
        for digest in self.api_key_digests:
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError("ServerConfig.api_key_digests holds SHA-256 hex digests")
        if not self.responses_store_ttl > 0:
            raise ValueError("ServerConfig.responses_store_ttl must be > 0")
        for name in ("sse_keep_alive_interval", "request_timeout", "session_ttl"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"ServerConfig.{name} must be > 0 (or unset)")
        if not self.engine_heartbeat_timeout > 0:
            raise ValueError("ServerConfig.engine_heartbeat_timeout must be > 0")
        for name, minimum in _LIMIT_MINIMUMS.items():
            if getattr(self, name) < minimum:
                raise ValueError(
                    f"ServerConfig.{name} must be at least {minimum}, got {getattr(self, name)}"
                )
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError("ServerConfig.generation_config is 'auto' or 'vllm'")
        if self.root_path and not self.root_path.startswith("/"):
            raise ValueError("ServerConfig.root_path must start with '/'")

    @property
    def default_model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def metrics_label(self) -> str:
        return self.metrics_model_name or self.default_model_name

    def request_limits(self) -> RequestLimits:
        """The limits request validation enforces (the pydantic validation context)."""
        return RequestLimits(
            max_n=self.max_n,
            max_logprobs=self.max_logprobs,
            max_stop_strings=self.max_stop_strings,
        )

    @classmethod
    def with_api_keys(cls, keys: Iterable[str], **kwargs: Any) -> ServerConfig:
        """A config accepting these plain keys (the CLI's --api-key values)."""
        return cls(api_key_digests=tuple(digest_api_key(k) for k in keys), **kwargs)

    # -- environment transport ------------------------------------------------------
    def to_env(self) -> dict[str, str]:
        """The environment entries that make `from_env()` rebuild this config."""
        return {ENV_VAR: msgspec.json.encode(self).decode()}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ServerConfig:
        """Rebuild the config the CLI exported; defaults when the variable is unset.

        Unknown keys and wrong types raise ValueError, so a CLI/worker version skew fails
        at worker start instead of silently dropping a setting.
        """
        environ = os.environ if environ is None else environ
        text = environ.get(ENV_VAR)
        if not text:
            return cls()
        try:
            raw = msgspec.json.decode(text)
        except msgspec.DecodeError as exc:
            raise ValueError(f"{ENV_VAR} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError(f"{ENV_VAR} must hold a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{ENV_VAR} has unknown settings: {', '.join(unknown)}")
        try:
            return msgspec.convert(raw, type=cls)
        except (msgspec.ValidationError, TypeError) as exc:
            raise ValueError(f"{ENV_VAR}: {exc}") from exc
