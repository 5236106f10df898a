"""SSE payloads as the serving classes yield them: bytes of one `data:` line, or None.

The transport adds the `data: ` framing (`handlers.http.resources.sse_frames`). `None`
is a keep-alive tick (`: ping`, only with --sse-keep-alive-interval), never data.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

import orjson
from pydantic import BaseModel

from handlers.errors import ServingError

SSEPayload = bytes | None
SSEStream = AsyncGenerator[SSEPayload, None]
"""What a streaming serving method returns (admission already done)."""

DONE = b"[DONE]"


def encode_chunk(chunk: BaseModel) -> bytes:
    """A chunk as JSON without the fields never set (vLLM's `exclude_unset` chunks)."""
    return chunk.__pydantic_serializer__.to_json(chunk, exclude_unset=True)


def encode_error(error: ServingError) -> bytes:
    return orjson.dumps(error.body())
