"""Embeddings: one engine request per input, each prefill only, pooled by the model's
recipe (`engine/pooling_config.py`, announced by the engine in `ModelInfo.pooling`).

The engine sends each vector as float32 bytes (little endian), so `encoding_format:
base64` is those bytes base64-encoded, and `float` is the same values as JSON numbers:
the two formats carry bit-identical vectors. A request is never streamed.
"""

from __future__ import annotations

import base64
import logging
import sys
from array import array
from dataclasses import dataclass

from engine.messages import PoolingParams, RequestOutput
from engine.pooling_config import PoolingConfig
from engine.sampling_params import SamplingParams
from handlers.errors import BadRequestError, InternalServerError, from_engine_error
from handlers.protocol.base import UsageInfo
from handlers.protocol.embedding import EmbeddingData, EmbeddingRequest, EmbeddingResponse
from handlers.serving.base import PromptInput, ServingBase
from handlers.serving.context import RequestContext

logger = logging.getLogger(__name__)

_NO_SAMPLING = SamplingParams(max_tokens=0)
"""What an embedding request carries as sampling parameters: nothing is sampled."""


class ServingEmbedding(ServingBase):
    """`POST /v1/embeddings` (and `/invocations` bodies marked as embeddings).

    Shares ServingBase's model check, request ids, all-or-none admission, deadline and
    request stats with the generating endpoints; it has no choices to stream.
    """

    kind = "embedding"
    id_prefix = "embd"

    async def create(self, request: EmbeddingRequest, ctx: RequestContext) -> EmbeddingResponse:
        model_name = self.model_name(request.model)
        pooling = self.pooling_params(request.dimensions)
        inputs = await self.tokenize_prompts(
            request.inputs(),
            add_special_tokens=request.add_special_tokens,
            field="input",
            truncation=self.served.truncation(
                request.truncate_prompt_tokens, request.truncation_side
            ),
        )
        pooled = await self.pool(
            inputs,
            pooling,
            ctx,
            request_id=request.request_id,
            priority=request.priority,
            cache_salt=request.cache_salt,
        )
        encode = _base64 if request.encoding_format == "base64" else _floats
        data = [
            EmbeddingData(index=i, embedding=encode(vector))
            for i, vector in enumerate(pooled.vectors)
        ]
        tokens = pooled.num_prompt_tokens
        return EmbeddingResponse(
            id=pooled.response_id,
            model=model_name,
            data=data,
            usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens),
        )

    async def pool(
        self,
        inputs: list[PromptInput],
        pooling: PoolingParams,
        ctx: RequestContext,
        *,
        request_id: str | None,
        priority: int,
        cache_salt: str | None,
    ) -> PooledBatch:
        """Run each input as one prefill-only engine request, admitted all or none, and
        collect its pooled vector (float32 bytes, little endian), in input order."""
        for prompt in inputs:
            self.served.check_input_len(len(prompt.token_ids), prompt.param)
        response_id, engine_id = self.request_ids(self.id_prefix, ctx, request_id)
        for prompt in inputs:
            self.served.log_prompt(response_id, prompt.logged)
        tracker = self.tracker(response_id, ctx)
        num_prompt_tokens = sum(len(prompt.token_ids) for prompt in inputs)
        status = "aborted"
        collector = None
        deadline = None
        try:
            collector = await self.admit(
                engine_id,
                [prompt.token_ids for prompt in inputs],
                [_NO_SAMPLING] * len(inputs),
                priority,
                pooling=pooling,
                cache_salt=cache_salt,
            )
            deadline = self.arm_deadline(ctx, collector)
            vectors: dict[str, bytes] = {}
            while not collector.finished:
                for output in await collector.get():
                    vectors[output.request_id] = _vector_of(output)
            status = "ok"
        except Exception as exc:
            status = "error"
            mapped = from_engine_error(exc)
            if mapped is not None:
                raise mapped from None
            raise
        finally:
            if deadline is not None:
                deadline.cancel()
            if collector is not None:
                collector.close()
            tracker.finish(
                status,
                num_prompt_tokens=num_prompt_tokens,
                num_output_tokens=0,
                num_cached_tokens=0,
                finish_reasons=["stop" if status == "ok" else status] * len(inputs),
            )
        return PooledBatch(
            response_id,
            [vectors[f"{engine_id}-{i}"] for i in range(len(inputs))],
            num_prompt_tokens,
        )

    def pooling_params(self, dimensions: int | None = None) -> PoolingParams:
        """400 when the model serves no embeddings or cannot give `dimensions`."""
        config: PoolingConfig | None = self.served.info().pooling
        if config is None:
            raise BadRequestError("This server's engine does not serve embeddings.", param="model")
        if config.unsupported is not None:
            raise BadRequestError(
                f"Embeddings are not available: {config.unsupported}.", param="model"
            )
        problem = config.check_dimensions(dimensions)
        if problem is not None:
            raise BadRequestError(f"dimensions: {problem}", param="dimensions")
        return PoolingParams(dimensions=dimensions)


@dataclass(frozen=True, slots=True)
class PooledBatch:
    """What `ServingEmbedding.pool` returns."""

    response_id: str
    vectors: list[bytes]
    """Each input's vector: float32, little endian, in input order."""
    num_prompt_tokens: int


def vector_values(vector: bytes) -> array[float]:
    """A pooled vector's float32 values."""
    values = array("f")
    values.frombytes(vector)
    if sys.byteorder == "big":
        values.byteswap()  # the engine sends little endian
    return values


def _vector_of(output: RequestOutput) -> bytes:
    if output.finish_reason == "error" or output.embedding is None:
        logger.error("engine failed embedding request %r: %s", output.request_id, output.error)
        raise InternalServerError("The engine failed while computing this embedding.")
    return output.embedding


def _floats(vector: bytes) -> list[float]:
    return vector_values(vector).tolist()


def _base64(vector: bytes) -> str:
    return base64.b64encode(vector).decode("ascii")
