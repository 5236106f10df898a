"""Request bodies: size cap before parsing, JSON by orjson, shape caps around it.

Falcon has no global body limit, so a body is read here with one: a `Content-Length`
over it, or a chunked body that grows past it, is a 413 before anything is parsed.
orjson refuses nesting deeper than 1024 levels; a tighter cap keeps pydantic, jinja
and `json.dumps` (tools reach the chat template) far from Python's recursion limit.

What a body costs the event loop grows with its objects and arrays, not only its bytes:
6 MB of 200,000 messages took ~85 ms to parse and ~350 ms to walk for depth, 6 MB of
2,000,000 empty objects ~230 ms and 2.0 s, while 6 MB of prompt text parses in ~6 ms. So
the containers are capped too, first on the raw bytes (no parse), then exactly.
"""

from __future__ import annotations

from typing import Any

import falcon
import falcon.media
import orjson

from handlers.errors import BadRequestError, RequestTooLargeError, UnsupportedMediaTypeError
from handlers.protocol.json_schema import MAX_JSON_DEPTH, json_shape

JSON_MEDIA_TYPE = "application/json"

MAX_JSON_CONTAINERS = 65_536
"""Objects and arrays in one request body, at most. The largest legitimate bodies hold a
few tens of thousands (4,096 messages, each with a content list and tool calls, 128
tools with their schemas); parsing and walking 65,536 takes ~30 ms."""
MAX_BRACKET_BYTES = 2 * MAX_JSON_CONTAINERS
"""`{` and `[` bytes in a body, at most, counted before it is parsed (~3 ms for 6 MB).
They bound its containers from above; brackets inside strings count too, which a body
whose prompts fit a context reaches only with more than one bracket per token."""


def json_handler() -> falcon.media.JSONHandler:
    """orjson for `resp.media` (Falcon detects that dumps returns bytes)."""
    return falcon.media.JSONHandler(dumps=orjson.dumps, loads=orjson.loads)


async def read_body(req: falcon.asgi.Request, limit: int) -> bytes:
    length = req.content_length
    if length is not None and length > limit:
        raise RequestTooLargeError(f"The request body is {length} bytes; the limit is {limit}.")
    chunks: list[bytes] = []
    size = 0
    async for chunk in req.stream:
        size += len(chunk)
        if size > limit:
            raise RequestTooLargeError(f"The request body exceeds the limit of {limit} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


def check_json_content_type(req: falcon.asgi.Request) -> None:
    """No Content-Type is taken as JSON; anything else but JSON is a 415."""
    content_type = req.content_type
    if not content_type:
        return
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type == JSON_MEDIA_TYPE or media_type.endswith("+json"):
        return
    raise UnsupportedMediaTypeError(
        f"Content-Type {media_type!r} is not supported; send {JSON_MEDIA_TYPE}."
    )


def parse_json(data: bytes) -> Any:
    if not data.strip():
        raise BadRequestError("The request body is empty; send a JSON object.")
    brackets = data.count(b"{") + data.count(b"[")
    if brackets > MAX_BRACKET_BYTES:
        raise BadRequestError(
            f"The request body holds {brackets} '{{' and '[' characters; at most "
            f"{MAX_BRACKET_BYTES} are allowed (JSON objects and arrays, or those characters "
            "in text). Split the request."
        )
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise BadRequestError(f"The request body is not valid JSON: {exc}") from None
    if brackets > MAX_JSON_DEPTH:  # fewer containers cannot nest deeper: nothing to walk
        check_body_shape(value)
    return value


def check_body_shape(value: Any) -> None:
    depth, containers = json_shape(value, MAX_JSON_DEPTH, MAX_JSON_CONTAINERS)
    if depth > MAX_JSON_DEPTH:
        raise BadRequestError(f"The request body nests deeper than {MAX_JSON_DEPTH} levels.")
    if containers > MAX_JSON_CONTAINERS:
        raise BadRequestError(
            f"The request body holds more than {MAX_JSON_CONTAINERS} JSON objects and "
            "arrays. Split the request."
        )


async def read_json(req: falcon.asgi.Request, limit: int, *, any_content_type: bool = False) -> Any:
    """The decoded JSON body. `/invocations` takes any Content-Type (SageMaker callers
    send what they like); the OpenAI routes want JSON."""
    if not any_content_type:
        check_json_content_type(req)
    return parse_json(await read_body(req, limit))
