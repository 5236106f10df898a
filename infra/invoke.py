"""Calling a deployed hearth: SageMaker endpoints (buffered and streamed) and Lambda.

The container speaks OpenAI JSON on ``/invocations`` (``messages`` -> chat, ``prompt`` ->
completion) and streams SSE when the body says ``"stream": true``.  Through
``InvokeEndpointWithResponseStream`` that SSE arrives as ``PayloadPart`` chunks cut at
arbitrary byte positions, possibly followed by a ``ModelStreamError`` or
``InternalStreamFailure`` event; :func:`stream_deltas` reassembles it (via :mod:`infra.sse`)
into text deltas and turns every failure into :class:`~infra.errors.StreamError`.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from botocore.exceptions import EventStreamError

from infra.errors import DeployError, StreamError, error_code
from infra.session import Clients
from infra.sse import iter_sse_data

__all__ = [
    "Delta",
    "chat_body",
    "deltas_from_sse",
    "function_url_event",
    "invoke_json",
    "invoke_lambda",
    "load_body",
    "payload_chunks",
    "response_text",
    "send",
    "stream_deltas",
]

JSON = "application/json"


@dataclass(frozen=True)
class Delta:
    """New text of one choice (``index``) from one stream chunk."""

    index: int
    text: str
    finish_reason: str | None = None


def chat_body(
    prompt: str,
    *,
    max_tokens: int | None = 256,
    model: str | None = None,
    temperature: float | None = None,
    stream: bool = False,
) -> dict[str, Any]:
    """An OpenAI chat request with one user message (``model`` may be omitted on SageMaker:
    the container serves one model)."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]}
    if model:
        body["model"] = model
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if temperature is not None:
        body["temperature"] = temperature
    if stream:
        body["stream"] = True
    return body


def load_body(text: str) -> dict[str, Any]:
    """Parse a ``--body`` argument: inline JSON, or ``@path`` to read it from a file."""
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as exc:
            raise DeployError(f"cannot read body file {text[1:]}: {exc.strerror}") from exc
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise DeployError(f"--body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise DeployError("--body must be a JSON object")
    return body


def response_text(response: Mapping[str, Any]) -> str:
    """The generated text of a non-streamed chat or completion response (first choice),
    or of a Responses API `response` (its message items' text)."""
    if response.get("object") == "response" and isinstance(response.get("output"), list):
        return "".join(
            str(part.get("text") or "")
            for item in response["output"]
            if isinstance(item, dict) and item.get("type") == "message"
            for part in item.get("content") or []
            if isinstance(part, dict)
        )
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        raise DeployError(f"response has no choices: {json.dumps(response)[:200]}")
    first = choices[0]
    message = first.get("message")
    if isinstance(message, dict):
        return str(message.get("content") or "")
    return str(first.get("text") or "")


def _decode_json(raw: bytes, source: str) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise DeployError(f"{source} did not answer JSON: {raw[:200]!r}") from exc
    if not isinstance(body, dict):
        raise DeployError(f"{source} answered JSON that is not an object: {raw[:200]!r}")
    return body


def _invoke_kwargs(
    endpoint: str, body: Mapping[str, Any], custom_attributes: str | None, variant: str | None
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "EndpointName": endpoint,
        "Body": json.dumps(body).encode(),
        "ContentType": JSON,
    }
    if custom_attributes:
        kwargs["CustomAttributes"] = custom_attributes
    if variant:
        kwargs["TargetVariant"] = variant
    return kwargs


def invoke_json(
    rt: Any,
    endpoint: str,
    body: Mapping[str, Any],
    *,
    custom_attributes: str | None = None,
    variant: str | None = None,
) -> dict[str, Any]:
    """``InvokeEndpoint`` with a JSON body; returns the decoded JSON answer."""
    kwargs = _invoke_kwargs(endpoint, body, custom_attributes, variant)
    response = rt.invoke_endpoint(Accept=JSON, **kwargs)
    return _decode_json(response["Body"].read(), f"endpoint {endpoint}")


def payload_chunks(events: Iterable[Mapping[str, Any]]) -> Iterator[bytes]:
    """The bytes of every ``PayloadPart`` of a response stream, in order.

    Error events end the stream with :class:`StreamError`, whether they arrive as event
    dicts or, as botocore delivers modelled exception events, as ``EventStreamError``.
    """
    try:
        for event in events:
            if "PayloadPart" in event:
                data = event["PayloadPart"].get("Bytes", b"")
                if data:
                    yield data
            elif "ModelStreamError" in event:
                err = event["ModelStreamError"]
                code = err.get("ErrorCode", "ModelStreamError")
                raise StreamError(f"model stream error ({code}): {err.get('Message', '')}")
            elif "InternalStreamFailure" in event:
                msg = event["InternalStreamFailure"].get("Message", "")
                raise StreamError(f"SageMaker internal stream failure: {msg}")
    except EventStreamError as exc:
        code = error_code(exc)
        message = exc.response.get("Error", {}).get("Message", "")
        if code == "InternalStreamFailure":
            raise StreamError(f"SageMaker internal stream failure: {message}") from exc
        raise StreamError(f"model stream error ({code}): {message}") from exc


_RESPONSES_END = {"response.completed": "stop", "response.incomplete": "length"}


def _responses_event(event: Mapping[str, Any]) -> Delta | None:
    """A Responses API stream event (it has a `type`) as a Delta: text deltas, and the
    end (`response.completed` / `response.incomplete`: such a stream has no `[DONE]`)."""
    kind = event.get("type")
    if kind == "response.output_text.delta":
        return Delta(index=0, text=str(event.get("delta") or ""))
    if kind in _RESPONSES_END:
        return Delta(index=0, text="", finish_reason=_RESPONSES_END[kind])
    if kind in ("error", "response.failed"):
        error = (event.get("response") or {}).get("error") or event
        raise StreamError(f"server error during the stream: {error.get('message', error)}")
    return None


def deltas_from_sse(data: Iterable[str]) -> Iterator[Delta]:
    """Turn OpenAI stream events (chat or completion chunks, or the Responses API's typed
    events) into :class:`Delta` values.

    Stops at ``data: [DONE]`` (a Responses stream at its `response.completed`); an
    ``{"error": ...}`` chunk (how hearth reports a failure after the 200 status went out)
    and a stream without its end raise StreamError.
    """
    for item in data:
        if item.strip() == "[DONE]":
            return
        try:
            chunk = json.loads(item)
        except ValueError as exc:
            raise StreamError(f"malformed stream event: {item[:200]!r}") from exc
        if not isinstance(chunk, dict):
            raise StreamError(f"unexpected stream event: {item[:200]!r}")
        if isinstance(chunk.get("type"), str):
            delta = _responses_event(chunk)
            if delta is not None:
                yield delta
                if delta.finish_reason is not None:
                    return
            continue
        if "error" in chunk:
            err = chunk["error"]
            message = err.get("message", err) if isinstance(err, dict) else err
            raise StreamError(f"server error during the stream: {message}")
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            finish = choice.get("finish_reason")
            if text or finish:
                yield Delta(
                    index=int(choice.get("index", 0)), text=text or "", finish_reason=finish
                )
    raise StreamError("the stream ended before data: [DONE]")


def stream_deltas(
    rt: Any,
    endpoint: str,
    body: Mapping[str, Any],
    *,
    custom_attributes: str | None = None,
    variant: str | None = None,
) -> Iterator[Delta]:
    """``InvokeEndpointWithResponseStream`` -> text deltas, as they arrive.

    ``"stream": true`` is forced into the body: it is what makes the container answer SSE.
    A container that still answers plain JSON yields its text as a single delta.
    """
    kwargs = _invoke_kwargs(endpoint, {**body, "stream": True}, custom_attributes, variant)
    response = rt.invoke_endpoint_with_response_stream(Accept="text/event-stream", **kwargs)
    chunks = payload_chunks(response["Body"])
    content_type = response.get("ContentType", "text/event-stream")
    if "json" in content_type:
        answer = _decode_json(b"".join(chunks), f"endpoint {endpoint}")
        yield Delta(index=0, text=response_text(answer), finish_reason="stop")
        return
    try:
        yield from deltas_from_sse(iter_sse_data(chunks))
    except UnicodeDecodeError as exc:
        raise StreamError(f"the stream is not valid UTF-8: {exc.reason}") from exc


def function_url_event(path: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """A Lambda Function URL (payload format 2.0) event carrying a JSON POST.

    Invoking the function directly with this event exercises the same code path as a real
    Function URL request (Mangum and the Lambda Web Adapter both understand it), without
    SigV4-signing an HTTP request.
    """
    now = time.time()
    return {
        "version": "2.0",
        "routeKey": "$default",
        "rawPath": path,
        "rawQueryString": "",
        "headers": {"content-type": JSON, "accept": JSON, "host": "lambda-url.invalid"},
        "requestContext": {
            "accountId": "anonymous",
            "apiId": "hearth-invoke",
            "domainName": "lambda-url.invalid",
            "domainPrefix": "hearth-invoke",
            "http": {
                "method": "POST",
                "path": path,
                "protocol": "HTTP/1.1",
                "sourceIp": "127.0.0.1",
                "userAgent": "hearth-invoke",
            },
            "requestId": str(uuid.uuid4()),
            "routeKey": "$default",
            "stage": "$default",
            "time": time.strftime("%d/%b/%Y:%H:%M:%S +0000", time.gmtime(now)),
            "timeEpoch": int(now * 1000),
        },
        "body": json.dumps(body),
        "isBase64Encoded": False,
    }


def invoke_lambda(
    lam: Any, function: str, body: Mapping[str, Any], path: str = "/v1/chat/completions"
) -> dict[str, Any]:
    """Invoke the function with a Function URL event; return the JSON body it answered.

    A function error (unhandled exception, timeout) or an HTTP error status from the app
    becomes one DeployError line.
    """
    response = lam.invoke(
        FunctionName=function, Payload=json.dumps(function_url_event(path, body)).encode()
    )
    payload = _decode_json(response["Payload"].read(), f"function {function}")
    if response.get("FunctionError"):
        raise DeployError(
            f"function {function} failed: {payload.get('errorType', 'Error')}: "
            f"{payload.get('errorMessage', payload)}"
        )
    raw = payload.get("body", "")
    if payload.get("isBase64Encoded"):
        raw = base64.b64decode(raw).decode()
    status = int(payload.get("statusCode", 200))
    try:
        answer = json.loads(raw) if raw else {}
    except ValueError:
        answer = {"raw": raw}
    if status >= 400:
        err = answer.get("error") if isinstance(answer, dict) else None
        message = err.get("message") if isinstance(err, dict) else raw[:200]
        raise DeployError(f"function {function} answered {status}: {message}")
    if not isinstance(answer, dict):
        raise DeployError(f"function {function} answered JSON that is not an object")
    return answer


def _lambda_path(body: Mapping[str, Any]) -> str:
    """The route a body goes to on a Lambda function (which has no /invocations dispatch
    of its own): chat by `messages`, the Responses API by `input`, else completions."""
    if "messages" in body:
        return "/v1/chat/completions"
    if "input" in body:
        return "/v1/responses"
    return "/v1/completions"


def send(
    clients: Clients,
    body: Mapping[str, Any],
    *,
    endpoint: str | None = None,
    function: str | None = None,
    stream: bool = False,
    raw: bool = False,
    path: str | None = None,
    custom_attributes: str | None = None,
    variant: str | None = None,
) -> Iterator[str]:
    """``hearth invoke``: send one request to an endpoint (optionally streamed) or to a
    Lambda function, and yield what to print, piece by piece as it arrives.

    A body that asks for a stream gets one (a buffered call would receive raw SSE text);
    Lambda is called buffered, so a stream there is refused.
    """
    stream = stream or body.get("stream") is True
    if function:
        if stream:
            raise DeployError(
                'streaming (--stream or "stream": true) needs --endpoint; stream from Lambda '
                "through its Function URL (deploy with --mode stream)"
            )
        lam = clients("lambda", read_timeout_s=905, max_attempts=1)
        path = path or _lambda_path(body)
        answer = invoke_lambda(lam, function, body, path)
    elif endpoint:
        rt = clients("sagemaker-runtime", read_timeout_s=70, max_attempts=2)
        target = {"custom_attributes": custom_attributes, "variant": variant}
        if stream:
            for delta in stream_deltas(rt, endpoint, body, **target):
                if delta.index == 0 and delta.text:
                    yield delta.text
            yield "\n"
            return
        answer = invoke_json(rt, endpoint, body, **target)
    else:
        raise DeployError("give an endpoint or a function to invoke")
    yield (json.dumps(answer, indent=2) if raw else response_text(answer)) + "\n"
