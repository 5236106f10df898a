"""SSE payloads as the serving classes yield them: bytes of one `data:` line, a named
event, or None.

The transport adds the `data: ` framing (`handlers.http.resources.sse_frames`). `None`
is a keep-alive tick (`: ping`, only with --sse-keep-alive-interval), never data. A
`NamedEvent` also gets an `event:` line: Anthropic's clients dispatch on it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass

import orjson
from pydantic import BaseModel

from handlers.errors import ServingError


@dataclass(frozen=True, slots=True)
class NamedEvent:
    """An event with a name: `event: <name>` then `data: <data>`."""

    name: str
    data: bytes


SSEPayload = bytes | NamedEvent | None
SSEStream = AsyncGenerator[SSEPayload, None]
"""What a streaming serving method returns (admission already done)."""

DONE = b"[DONE]"


def encode_chunk(chunk: BaseModel) -> bytes:
    """A chunk as JSON without the fields never set (vLLM's `exclude_unset` chunks)."""
    return chunk.__pydantic_serializer__.to_json(chunk, exclude_unset=True)


def encode_error(error: ServingError) -> bytes:
    return orjson.dumps(error.body())
