"""Errors the serving layer raises, and their OpenAI wire form.

Every failure a client can cause or see is a `ServingError` carrying the HTTP status,
OpenAI/vLLM error type name and the offending parameter. The HTTP layer, the SSE error
chunk and the Lambda adapter all render it with `error_body()`, so the three agree.

Type names follow vLLM (`BadRequestError`, `NotFoundError`, `InternalServerError`),
which are the `openai` SDK's exception class names; the statuses vLLM does not name
get the SDK's name for that status.

The Anthropic routes answer the same errors in Anthropic's shape
(`anthropic_error_body`): a `ServingError` raised while serving one of them carries
`dialect = "anthropic"`, so the HTTP layer and the SSE error event render it that way.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from engine.errors import (
    EngineDeadError,
    EngineNotReadyError,
    EngineOverloadedError,
    InvalidEngineRequestError,
    UnknownAdapterError,
)


class ServingError(Exception):
    """An error with an HTTP status and an OpenAI error body."""

    status: HTTPStatus = HTTPStatus.BAD_REQUEST
    type: str = "BadRequestError"
    """The wire `type`: a subclass's own class name unless it sets one (see module doc)."""
    dialect: str = "openai"
    """The error shape of the API that raised it: "openai", or "anthropic" (set on the
    instance by the Messages serving class, whose clients parse only Anthropic's shape)."""

    def __init__(
        self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "type" not in cls.__dict__:
            cls.type = cls.__name__

    def body(self) -> dict[str, Any]:
        """The body in this error's dialect."""
        if self.dialect == "anthropic":
            return anthropic_error_body(self.message, self.status)
        return error_body(self.message, self.type, self.status, self.param)


class BadRequestError(ServingError):
    """Schema, range, or semantic error in the request (400)."""


class AuthenticationError(ServingError):
    """Missing or wrong API key (401)."""

    status = HTTPStatus.UNAUTHORIZED


class NotFoundError(ServingError):
    """Unknown model (404); Falcon's own 404 for an unknown route gets this type name."""

    status = HTTPStatus.NOT_FOUND


class MethodNotAllowedError(ServingError):
    """Known route, wrong method (405): Falcon answers it; listed for its type name."""

    status = HTTPStatus.METHOD_NOT_ALLOWED


class RequestTooLargeError(ServingError):
    """Body over the size cap, refused before it is read whole (413)."""

    status = HTTPStatus.REQUEST_ENTITY_TOO_LARGE


class UnsupportedMediaTypeError(ServingError):
    """A body that is not JSON (415)."""

    status = HTTPStatus.UNSUPPORTED_MEDIA_TYPE


class FailedDependencyError(ServingError):
    """An adapter the server cannot serve (bad weights, rank over --max-lora-rank) on
    SageMaker's `/adapters` route (424, as AWS's container standards answer it)."""

    status = HTTPStatus.FAILED_DEPENDENCY


class ServiceUnavailableError(ServingError):
    """Queue full, engine dead or still loading (503): retrying later can succeed."""

    status = HTTPStatus.SERVICE_UNAVAILABLE


class RequestTimeoutError(ServingError):
    """The server's own deadline (--request-timeout) ended the request (504); its engine
    requests were aborted, so a retry starts from scratch rather than piling work up."""

    status = HTTPStatus.GATEWAY_TIMEOUT


class InternalServerError(ServingError):
    """A bug or an engine-side generation failure; the message never carries internals."""

    status = HTTPStatus.INTERNAL_SERVER_ERROR


def error_body(message: str, type_: str, status: int, param: str | None = None) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}` as vLLM answers it."""
    return {"error": {"message": message, "type": type_, "param": param, "code": int(status)}}


ANTHROPIC_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
"""Anthropic's error type names by status (docs.anthropic.com, "Errors"). hearth answers
a full queue or a loading engine 503 (not Anthropic's 529), typed `overloaded_error`."""


def anthropic_error_body(message: str, status: int) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`, Anthropic's error shape; a status
    it does not name is `invalid_request_error` (4xx) or `api_error` (5xx)."""
    fallback = "api_error" if status >= 500 else "invalid_request_error"
    kind = ANTHROPIC_ERROR_TYPES.get(int(status), fallback)
    return {"type": "error", "error": {"type": kind, "message": message}}


_STATUS_TO_CLASS: dict[int, type[ServingError]] = {
    cls.status: cls
    for cls in (
        BadRequestError,
        AuthenticationError,
        NotFoundError,
        MethodNotAllowedError,
        RequestTooLargeError,
        UnsupportedMediaTypeError,
        FailedDependencyError,
        ServiceUnavailableError,
        RequestTimeoutError,
        InternalServerError,
    )
}


def error_type_for_status(status: int) -> str:
    """The type name used for a status that no ServingError raised (e.g. Falcon's own)."""
    cls = _STATUS_TO_CLASS.get(status)
    if cls is not None:
        return cls.type
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    return "".join(word.capitalize() for word in phrase.replace("-", " ").split()) + "Error"


def from_engine_error(exc: BaseException) -> ServingError | None:
    """Map the engine's typed errors to their HTTP meaning; None for anything else."""
    if isinstance(exc, ServingError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        return ServiceUnavailableError(
            str(exc) or "The server is overloaded; retry later.",
            headers={"Retry-After": "1"},
        )
    if isinstance(exc, EngineNotReadyError):
        return ServiceUnavailableError(str(exc) or "The model is still loading; retry shortly.")
    if isinstance(exc, EngineDeadError):
        return ServiceUnavailableError(str(exc) or "The engine has stopped; the server restarts.")
    if isinstance(exc, UnknownAdapterError):
        return NotFoundError(str(exc), param="model")
    if isinstance(exc, InvalidEngineRequestError):
        return BadRequestError(str(exc), param=exc.param)
    return None
