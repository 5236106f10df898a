"""One clear line for every way an AWS call can fail.

botocore raises a zoo of exceptions (``ClientError`` with a service error code, credential and
region errors, waiter errors, connection errors, parameter validation errors).  A user running
``hearth deploy`` wants one line that says what failed and what to do about it, not a traceback.
Everything in :mod:`infra` raises :class:`DeployError` for its own failures, and
:func:`describe_error` turns botocore's exceptions into the same kind of line.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from boto3.exceptions import Boto3Error
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    NoRegionError,
    ParamValidationError,
    PartialCredentialsError,
    WaiterError,
)

# Everything a boto3 call can raise; the CLI turns these into one line.
AWS_ERRORS = (ClientError, BotoCoreError, Boto3Error)

__all__ = [
    "AWS_ERRORS",
    "DeployError",
    "StreamError",
    "aws_errors",
    "describe_error",
    "error_code",
    "if_exists",
    "is_not_found",
]

T = TypeVar("T")

# Hints for error codes whose AWS message alone does not say what to do next.
_HINTS: dict[str, str] = {
    "AccessDenied": "check the IAM permissions of the caller",
    "AccessDeniedException": "check the IAM permissions of the caller",
    "UnrecognizedClientException": "the access key is not valid in this account/region",
    "InvalidClientTokenId": "the access key is not valid in this account/region",
    "ExpiredToken": "the session credentials expired; refresh them (aws sso login, ...)",
    "ExpiredTokenException": "the session credentials expired; refresh them (aws sso login, ...)",
    "ResourceLimitExceeded": "request a quota increase in Service Quotas or pick another "
    "instance type",
    "ThrottlingException": "AWS throttled the call; retry in a moment",
}


class DeployError(Exception):
    """A deployment or invocation step failed; ``str(err)`` is the one line to show a user."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class StreamError(DeployError):
    """A response stream broke off: ``ModelStreamError``, ``InternalStreamFailure``, an error
    chunk from the server, or a stream that ended without ``data: [DONE]``."""


def error_code(exc: ClientError) -> str:
    """The service error code of a ``ClientError`` (``""`` when absent)."""
    return str(exc.response.get("Error", {}).get("Code", ""))


def _error_message(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Message", "")).strip()


def is_not_found(exc: ClientError) -> bool:
    """Whether a ``ClientError`` means "no such resource".

    SageMaker answers a describe of a missing model, endpoint config or endpoint with
    ``ValidationException`` "Could not find ..." rather than a not-found code, so the message
    is part of the test; other services use ``ResourceNotFoundException`` / ``NoSuchKey`` /
    a bare 404.
    """
    code = error_code(exc)
    if code in {"ResourceNotFoundException", "ResourceNotFound", "NoSuchKey", "NotFound", "404"}:
        return True
    message = _error_message(exc).lower()
    return code in {"ValidationException", "ValidationError"} and (
        "could not find" in message or "does not exist" in message
    )


def if_exists(call: Callable[..., T], **kwargs: Any) -> T | None:
    """``call(**kwargs)``, or ``None`` when AWS answers that the resource does not exist.

    Describe-before-create is how every ``ensure_*`` stays idempotent; this is the one
    place that decides what "does not exist" looks like (:func:`is_not_found`).
    """
    try:
        return call(**kwargs)
    except ClientError as exc:
        if is_not_found(exc):
            return None
        raise


def _model_error_line(exc: ClientError) -> str:
    """SageMaker wraps any 4xx/5xx of the container in ``ModelError`` (HTTP 424) and keeps
    the container's status and body in ``OriginalStatusCode`` / ``OriginalMessage``; show
    those, and the OpenAI error message inside the body when there is one."""
    resp = exc.response
    err = resp.get("Error", {})
    status = resp.get("OriginalStatusCode", err.get("OriginalStatusCode"))
    original = resp.get("OriginalMessage", err.get("OriginalMessage")) or _error_message(exc)
    detail = str(original).strip()
    try:
        body = json.loads(detail)
    except (TypeError, ValueError):
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        detail = str(body["error"].get("message", detail))
    log = resp.get("LogStreamArn", err.get("LogStreamArn"))
    line = f"the model container answered {status}: {detail}" if status else detail
    if log:
        line += f" (logs: {log})"
    return line


def describe_error(exc: BaseException) -> str:
    """Render any AWS/botocore failure as one line (no newlines) naming the failed call."""
    if isinstance(exc, DeployError):
        text = exc.message
    elif isinstance(exc, ClientError):
        code = error_code(exc)
        op = getattr(exc, "operation_name", None) or "AWS call"
        if code == "ModelError":
            text = f"{op} failed: {_model_error_line(exc)}"
        else:
            text = f"{op} failed: {code}: {_error_message(exc)}"
            hint = _HINTS.get(code)
            if hint:
                text += f" ({hint})"
    elif isinstance(exc, NoCredentialsError | PartialCredentialsError):
        text = (
            "no usable AWS credentials: set AWS_PROFILE (or pass --profile), "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or run `aws configure`"
        )
    elif isinstance(exc, NoRegionError):
        text = "no AWS region: pass --region or set AWS_REGION / AWS_DEFAULT_REGION"
    elif isinstance(exc, EndpointConnectionError):
        text = f"cannot reach AWS: {exc}"
    elif isinstance(exc, WaiterError):
        last = exc.last_response or {}
        reason = last.get("Error", {}).get("Message") or exc.kwargs.get("reason", "")
        text = f"gave up waiting: {exc.kwargs.get('name', 'waiter')}: {reason}"
    elif isinstance(exc, ParamValidationError):
        text = f"invalid request parameters: {exc}"
    elif isinstance(exc, BotoCoreError | Boto3Error):
        text = f"AWS client error: {exc}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())


@contextmanager
def aws_errors(action: str) -> Iterator[None]:
    """Re-raise botocore failures inside the block as ``DeployError("<action>: <line>")``.

    Library code wraps each user-visible step with it so the message says which step broke
    (``creating endpoint config x: CreateEndpointConfig failed: ...``).
    """
    try:
        yield
    except DeployError:
        raise
    except (ClientError, BotoCoreError, Boto3Error) as exc:
        raise DeployError(f"{action}: {describe_error(exc)}") from exc
