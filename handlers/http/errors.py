"""One error handler for everything: the OpenAI error body, whatever went wrong.

Falcon's own errors (unknown route, wrong method) and ours (`ServingError`) are mapped
to `{"error": {"message", "type", "param", "code"}}`; anything else is a bug: it is
logged with its traceback and answered 500 with a message that tells nothing inside.
Under `/v1/messages` (Anthropic's routes), and for an error the Messages serving class
raised (an Anthropic body sent to `/invocations`), the same errors are rendered in
Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`: the auth
middleware's 401, a 404 and a 405 included, since those clients parse nothing else.
"""

from __future__ import annotations

import logging
from typing import Any

import falcon
import falcon.asgi
import orjson

from handlers.errors import (
    InternalServerError,
    ServingError,
    anthropic_error_body,
    error_body,
    error_type_for_status,
    from_engine_error,
)

logger = logging.getLogger(__name__)

ANTHROPIC_PATH = "/v1/messages"


def is_anthropic_path(path: str) -> bool:
    """`/v1/messages` and everything under it (`/v1/messages/count_tokens`)."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def _falcon_message(req: falcon.asgi.Request, ex: falcon.HTTPError) -> str:
    if isinstance(ex, falcon.HTTPRouteNotFound) or ex.status_code == 404:
        return f"Route {req.method} {req.path} not found."
    if ex.status_code == 405:
        return f"Method {req.method} is not allowed for {req.path}."
    return ex.description or ex.title or "Request error"


async def handle_error(
    req: falcon.asgi.Request, resp: falcon.asgi.Response, ex: Exception, params: Any
) -> None:
    """Registered for Exception and HTTPError (Falcon picks the most specific handler)."""
    headers: dict[str, str] = {}
    anthropic = is_anthropic_path(req.path)
    if isinstance(ex, falcon.HTTPError):
        status = ex.status_code
        message = _falcon_message(req, ex)
        if anthropic:
            body = anthropic_error_body(message, status)
        else:
            body = error_body(message, error_type_for_status(status), status)
        headers = dict(ex.headers or {})
    else:
        error = from_engine_error(ex)
        if error is None:
            logger.exception("unhandled error on %s %s", req.method, req.path)
            error = InternalServerError("Internal server error.")
        if anthropic:
            error.dialect = "anthropic"
        status = int(error.status)
        body = error.body()
        headers = error.headers
    write_error(resp, status, body, headers)


def write_error(
    resp: falcon.asgi.Response, status: int, body: dict[str, Any], headers: dict[str, str]
) -> None:
    resp.status = status
    resp.content_type = falcon.MEDIA_JSON
    resp.data = orjson.dumps(body)
    resp.sse = None
    for name, value in headers.items():
        resp.set_header(name, value)


def error_response(resp: falcon.asgi.Response, error: ServingError) -> None:
    write_error(resp, int(error.status), error.body(), error.headers)
