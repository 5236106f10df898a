"""JSON Lines on `/invocations`: SageMaker batch transform's MultiRecord/Line payloads.

With `BatchStrategy=MultiRecord, SplitType=Line` a transform job packs many records,
one JSON document per line, into one request (`Content-Type: application/jsonlines`).
Each record is its own inference request, dispatched like a single `/invocations`
body; all run at once, so the engine batches them together, and the answer has one
line per record in the order they came, which is what the job's `AssembleWith=Line`
and `JoinSource` rely on. A bad record gets an error line (the route's error body) and
the others still run: one typo must not fail a payload of thousands.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

import orjson
from pydantic import BaseModel

from handlers.errors import BadRequestError, InternalServerError, ServingError, from_engine_error
from handlers.serving.context import RequestContext
from handlers.serving.invocations import ServingInvocations

logger = logging.getLogger(__name__)

JSONLINES_MEDIA_TYPES = frozenset(
    {"application/jsonlines", "application/x-jsonlines", "application/jsonl"}
)
JSONLINES_MEDIA_TYPE = "application/jsonlines"
MAX_RECORDS_IN_FLIGHT = 512
"""Records of one payload admitted at once: enough to fill a batch many times over,
few enough that a payload of 100k tiny records does not make 100k tasks at once."""


def is_jsonlines(content_type: str | None) -> bool:
    if not content_type:
        return False
    return content_type.split(";", 1)[0].strip().lower() in JSONLINES_MEDIA_TYPES


class ServingJsonLines:
    def __init__(self, invocations: ServingInvocations) -> None:
        self._invocations = invocations

    async def invoke_lines(self, records: list[Any | ServingError], ctx: RequestContext) -> bytes:
        """One answer line per record, in order. `records` holds each line's decoded JSON,
        or the error that decoding it raised."""
        if not records:
            raise BadRequestError("The JSON Lines body holds no records.")
        window = asyncio.Semaphore(MAX_RECORDS_IN_FLIGHT)

        async def run(record: Any | ServingError) -> bytes:
            async with window:
                return await self._one(record, ctx)

        lines = await asyncio.gather(*(run(record) for record in records))
        return b"".join(line + b"\n" for line in lines)

    async def _one(self, record: Any | ServingError, ctx: RequestContext) -> bytes:
        try:
            if isinstance(record, ServingError):
                raise record
            if isinstance(record, dict) and record.get("stream"):
                raise BadRequestError(
                    "A JSON Lines record cannot stream; leave out 'stream' (each record "
                    "is answered by one line).",
                    param="stream",
                )
            # Each record is its own request: its own id, the call's arrival and session.
            result = await self._invocations.invoke(record, replace(ctx, request_id=None))
            assert isinstance(result, BaseModel)
            return result.__pydantic_serializer__.to_json(result)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = from_engine_error(exc)
            if error is None:
                logger.exception("a JSON Lines record failed")
                error = InternalServerError("Internal server error.")
            return orjson.dumps(error.body())
