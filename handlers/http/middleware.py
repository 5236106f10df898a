"""Middleware: engine lifespan, root path, request ids, API keys, CORS, SageMaker headers."""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import falcon
import falcon.asgi

from engine.client import EngineClient
from handlers.config import ServerConfig
from handlers.errors import AuthenticationError

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/ping", "/health", "/version"})
"""Routes answered without an API key: the probes (docs/api.md, "Routes"). `/metrics`
needs the key when one is set: its series name the served model (by default the model's
filesystem path) and show the traffic."""

CUSTOM_ATTRIBUTES_HEADER = "X-Amzn-SageMaker-Custom-Attributes"
REQUEST_ID_HEADER = "X-Request-Id"
API_KEY_HEADER = "X-Api-Key"
"""The Anthropic clients' key header (`ApiKeyAuth` also takes `Authorization: Bearer`)."""
_MAX_REQUEST_ID_LEN = 256


class EngineLifespan:
    """Connects the worker's EngineClient at ASGI startup, without waiting for warm-up
    (`/ping` says 503 until the engine is ready); at shutdown runs `before_close` (work
    that still needs the engine to wind down: background responses) and closes it."""

    def __init__(
        self,
        engine: EngineClient,
        before_close: Sequence[Callable[[], Awaitable[None]]] = (),
    ) -> None:
        self._engine = engine
        self._before_close = before_close

    async def process_startup(self, scope: dict[str, Any], event: dict[str, Any]) -> None:
        await self._engine.start()

    async def process_shutdown(self, scope: dict[str, Any], event: dict[str, Any]) -> None:
        for step in self._before_close:
            try:
                await step()
            except Exception:  # the engine is closed whatever happened before
                logger.exception("shutdown step failed")
        await self._engine.close()


class RequestSetup:
    """Arrival time, root-path stripping and the request id, before routing."""

    def __init__(self, config: ServerConfig) -> None:
        self._root_path = config.root_path.rstrip("/")
        self._echo_id = config.enable_request_id_headers

    async def process_request(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        req.context.arrival_time = time.monotonic()
        root = self._root_path
        if root and (req.path == root or req.path.startswith(root + "/")):
            # NOTE: Falcon routes on req.path after process_request, so this reroutes.
            req.path = req.path[len(root) :] or "/"
        request_id = req.get_header(REQUEST_ID_HEADER)
        if request_id is not None and not _valid_request_id(request_id):
            request_id = None
        if request_id is None and self._echo_id:
            request_id = uuid.uuid4().hex
        req.context.request_id = request_id

    async def process_response(
        self,
        req: falcon.asgi.Request,
        resp: falcon.asgi.Response,
        resource: object,
        req_succeeded: bool,
    ) -> None:
        if self._echo_id and getattr(req.context, "request_id", None):
            resp.set_header(REQUEST_ID_HEADER, req.context.request_id)
        attributes = req.get_header(CUSTOM_ATTRIBUTES_HEADER)
        if attributes is not None:
            resp.set_header(CUSTOM_ATTRIBUTES_HEADER, attributes)


def _valid_request_id(value: str) -> bool:
    return 0 < len(value) <= _MAX_REQUEST_ID_LEN and value.isascii() and value.isprintable()


class ApiKeyAuth:
    """`Authorization: Bearer <key>` or `x-api-key: <key>` on every route but the open
    ones (and CORS preflights, which browsers send without credentials).

    `x-api-key` is how the `anthropic` SDK (and Claude Code) send their key; it is
    accepted on every route, so one client configuration works for all of them."""

    def __init__(self, config: ServerConfig) -> None:
        self._digests = [bytes.fromhex(d) for d in config.api_key_digests]

    async def process_request(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        if not self._digests or req.method == "OPTIONS" or req.path in OPEN_PATHS:
            return
        header = req.get_header("Authorization") or ""
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and token and self._matches(token.strip()):
            return
        api_key = req.get_header(API_KEY_HEADER)
        if api_key and self._matches(api_key.strip()):
            return
        raise AuthenticationError(
            "Invalid or missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
            headers={"WWW-Authenticate": "Bearer"},
        )

    def _matches(self, token: str) -> bool:
        digest = hashlib.sha256(token.encode("utf-8")).digest()
        matched = False
        for known in self._digests:  # every digest is compared: no early exit
            matched |= hmac.compare_digest(digest, known)
        return matched


class ConfiguredCORS(falcon.CORSMiddleware):
    """Falcon's CORS policy, narrowed to the configured methods and headers."""

    def __init__(self, config: ServerConfig) -> None:
        origins = "*" if "*" in config.allowed_origins else list(config.allowed_origins)
        credentials: str | list[str] | None = None
        if config.allow_credentials and origins == "*":
            # Falcon would reflect every Origin with Allow-Credentials: any site could
            # send the user's cookies and read the answer. Credentials need named origins.
            logger.warning(
                "--allow-credentials is ignored with --allowed-origins '*': name the "
                "origins that may send credentials"
            )
        elif config.allow_credentials:
            credentials = origins
        super().__init__(allow_origins=origins, allow_credentials=credentials)
        self._methods = None if "*" in config.allowed_methods else config.allowed_methods
        self._headers = None if "*" in config.allowed_headers else config.allowed_headers

    def process_response(self, req: Any, resp: Any, resource: object, req_succeeded: bool) -> None:
        super().process_response(req, resp, resource, req_succeeded)
        if resp.get_header("Access-Control-Allow-Methods") is None:
            return
        if self._methods is not None:
            resp.set_header("Access-Control-Allow-Methods", ", ".join(self._methods))
        if self._headers is not None:
            resp.set_header("Access-Control-Allow-Headers", ", ".join(self._headers))
