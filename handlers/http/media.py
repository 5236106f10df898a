"""Request bodies: size cap before parsing, JSON by orjson, a nesting cap after.

Falcon has no global body limit, so a body is read here with one: a `Content-Length`
over it, or a chunked body that grows past it, is a 413 before anything is parsed.
orjson refuses nesting deeper than 1024 levels; a tighter cap keeps pydantic, jinja
and `json.dumps` (tools reach the chat template) far from Python's recursion limit.
"""

from __future__ import annotations

from typing import Any

import falcon
import falcon.media
import orjson

from handlers.errors import BadRequestError, RequestTooLargeError, UnsupportedMediaTypeError
from handlers.protocol.json_schema import MAX_JSON_DEPTH, depth_exceeds

JSON_MEDIA_TYPE = "application/json"


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
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise BadRequestError(f"The request body is not valid JSON: {exc}") from None
    if depth_exceeds(value, MAX_JSON_DEPTH):
        raise BadRequestError(f"The request body nests deeper than {MAX_JSON_DEPTH} levels.")
    return value


async def read_json(req: falcon.asgi.Request, limit: int, *, any_content_type: bool = False) -> Any:
    """The decoded JSON body. `/invocations` takes any Content-Type (SageMaker callers
    send what they like); the OpenAI routes want JSON."""
    if not any_content_type:
        check_json_content_type(req)
    return parse_json(await read_body(req, limit))
