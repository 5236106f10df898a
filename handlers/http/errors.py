"""One error handler for everything: the OpenAI error body, whatever went wrong.

Falcon's own errors (unknown route, wrong method) and ours (`ServingError`) are mapped
to `{"error": {"message", "type", "param", "code"}}`; anything else is a bug: it is
logged with its traceback and answered 500 with a message that tells nothing inside.
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
    error_body,
    error_type_for_status,
    from_engine_error,
)

logger = logging.getLogger(__name__)


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
    if isinstance(ex, falcon.HTTPError):
        status = ex.status_code
        body = error_body(_falcon_message(req, ex), error_type_for_status(status), status)
        headers = dict(ex.headers or {})
    else:
        error = from_engine_error(ex)
        if error is None:
            logger.exception("unhandled error on %s %s", req.method, req.path)
            error = InternalServerError("Internal server error.")
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
