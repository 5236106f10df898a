"""SSE payloads as the serving classes yield them: bytes of one `data:` line, a named
`SSEEvent`, or None.

The transport adds the `data: ` framing (`handlers.http.resources.sse_frames`), and an
`event: ` line for an `SSEEvent` (Anthropic's and the Responses API's clients dispatch on
it). `None` is a keep-alive tick (`: ping`, only with --sse-keep-alive-interval), never
data.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass

import orjson
from pydantic import BaseModel

from handlers.errors import ServingError


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """A payload sent with an `event:` line before its `data:` line: the Messages and
    Responses APIs name every event by its type (as Anthropic, OpenAI and vLLM do)."""

    name: str
    data: bytes


SSEPayload = bytes | SSEEvent | None
SSEStream = AsyncGenerator[SSEPayload, None]
"""What a streaming serving method returns (admission already done)."""

DONE = b"[DONE]"


def encode_chunk(chunk: BaseModel) -> bytes:
    """A chunk as JSON without the fields never set (vLLM's `exclude_unset` chunks)."""
    return chunk.__pydantic_serializer__.to_json(chunk, exclude_unset=True)


def encode_error(error: ServingError) -> bytes:
    return orjson.dumps(error.body())
