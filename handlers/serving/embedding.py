"""Embeddings: one engine request per input, each prefill only, pooled by the model's
recipe (`engine/pooling_config.py`, announced by the engine in `ModelInfo.pooling`).

The engine sends each vector as float32 bytes (little endian), so `encoding_format:
base64` is those bytes base64-encoded, and `float` is the same values as JSON numbers:
the two formats carry bit-identical vectors (unless the request asks base64 for another
`embed_dtype` or byte order: `vector_encoder`). A request is never streamed.
"""

from __future__ import annotations

import base64
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from engine.messages import PoolingParams, RequestOutput
from engine.pooling_config import ClassifierConfig, PoolingConfig
from engine.sampling_params import SamplingParams
from handlers.errors import BadRequestError, InternalServerError, from_engine_error
from handlers.protocol.base import UsageInfo
from handlers.protocol.embedding import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PooledInputRequest,
)
from handlers.serving.base import PromptInput, ServingBase
from handlers.serving.chat_template import choose_chat_template
from handlers.serving.context import RequestContext
from handlers.serving.render import render_chat

logger = logging.getLogger(__name__)

_NO_SAMPLING = SamplingParams(max_tokens=0)
"""What an embedding request carries as sampling parameters: nothing is sampled."""


class ServingEmbedding(ServingBase):
    """`POST /v1/embeddings` (and `/invocations` bodies marked as embeddings), and the
    base of every pooling API (`/pooling`, `/classify`, `/score` and `/rerank`, Cohere's
    `/v2/embed`): `embed` turns a request's inputs or messages into pooled vectors,
    `pool` runs prompts already tokenized.

    Shares ServingBase's model check, request ids, all-or-none admission, deadline and
    request stats with the generating endpoints; it has no choices to stream.
    """

    kind = "embedding"
    id_prefix = "embd"

    async def create(self, request: EmbeddingRequest, ctx: RequestContext) -> EmbeddingResponse:
        model_name = self.model_name(request.model)
        pooling = self.pooling_params(request.dimensions, normalize=request.use_activation)
        pooled = await self.embed(request, ctx, pooling)
        encode = vector_encoder(request)
        data = [
            EmbeddingData(index=i, embedding=encode(vector))
            for i, vector in enumerate(pooled.vectors)
        ]
        return EmbeddingResponse(
            id=pooled.response_id, model=model_name, data=data, usage=pooled.usage()
        )

    async def embed(
        self, request: PooledInputRequest, ctx: RequestContext, pooling: PoolingParams
    ) -> PooledBatch:
        """The pooled vectors of a pooling request (its model checked by the caller):
        its inputs, or its messages rendered by the chat template as one input."""
        truncation = self.served.truncation(request.truncate_prompt_tokens, request.truncation_side)
        if request.messages is not None:
            text = await render_chat(
                self.served, request, choose_chat_template(self.served, request)
            )
            prompts: list[str | list[int]] = [text]
            field = "messages"
        else:
            prompts, field = request.inputs(), "input"
        inputs = await self.tokenize_prompts(
            prompts, add_special_tokens=request.special_tokens, field=field, truncation=truncation
        )
        return await self.pool(inputs, pooling, ctx, request)

    def id_prefix_for(self, request: PoolScheduling) -> str:
        """The response id's prefix for `request` (one per route family, as vLLM's)."""
        return self.id_prefix

    async def pool(
        self,
        inputs: list[PromptInput],
        pooling: PoolingParams,
        ctx: RequestContext,
        request: PoolScheduling,
    ) -> PooledBatch:
        """Run each input as one prefill-only engine request, admitted all or none, and
        collect its pooled vector (float32 bytes, little endian), in input order;
        `request` names it (`request_id`), orders it (`priority`) and salts its cache."""
        request_id, priority, cache_salt = request.request_id, request.priority, request.cache_salt
        for prompt in inputs:
            self.served.check_input_len(len(prompt.token_ids), prompt.param)
        response_id, engine_id = self.request_ids(self.id_prefix_for(request), ctx, request_id)
        for prompt in inputs:
            self.served.log_prompt(response_id, prompt.logged)
        tracker = self.tracker(response_id, ctx)
        # the adapter named by SageMaker's header, or by `model` (as for generation)
        adapter = ctx.adapter or self.served.adapter_for(self.served.resolve_name(request.model))
        tracker.record.adapter = adapter
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
                lora_name=adapter,
                session_id=ctx.session_id,  # checked (400 if gone), not pinned: engine/core.py
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

    def pooling_params(
        self, dimensions: int | None = None, *, normalize: bool | None = None
    ) -> PoolingParams:
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
        return PoolingParams(dimensions=dimensions, normalize=normalize)

    def classifier(self, route: str) -> ClassifierConfig:
        """The served sequence classifier's head; 400 naming `route` for any other model."""
        config = self.served.info().pooling
        if config is None or config.classifier is None:
            raise BadRequestError(
                f"{route} needs a sequence-classification model (a *ForSequenceClassification "
                "checkpoint); this server's model has no classifier head.",
                param="model",
            )
        return config.classifier


class PoolScheduling(Protocol):
    """The fields of a pooling request (embeddings, score, classify) that schedule it."""

    model: str | None
    """The model named (a LoRA adapter's name runs on that adapter)."""
    request_id: str | None
    priority: int
    cache_salt: str | None


@dataclass(frozen=True, slots=True)
class PooledBatch:
    """What `ServingEmbedding.pool` returns."""

    response_id: str
    vectors: list[bytes]
    """Each input's vector: float32, little endian, in input order."""
    num_prompt_tokens: int

    def matrix(self) -> np.ndarray:
        """The vectors as one float32 array, a row each."""
        return np.stack([pooled_values(vector) for vector in self.vectors])

    def usage(self) -> UsageInfo:
        """OpenAI's usage of a pooling answer: every prompt token, none generated."""
        return UsageInfo(prompt_tokens=self.num_prompt_tokens, total_tokens=self.num_prompt_tokens)


def pooled_values(vector: bytes) -> np.ndarray:
    """A pooled vector's float32 values (the engine sends them little endian)."""
    return np.frombuffer(vector, dtype="<f4")


def _vector_of(output: RequestOutput) -> bytes:
    if output.finish_reason == "error" or output.embedding is None:
        logger.error("engine failed embedding request %r: %s", output.request_id, output.error)
        raise InternalServerError("The engine failed while computing this embedding.")
    return output.embedding


def vector_encoder(request: EmbeddingRequest) -> Callable[[bytes], list[float] | str]:
    """How a request wants each vector: JSON numbers, or base64 of its values in
    `embed_dtype` and `endianness` (vLLM's)."""
    if request.encoding_format != "base64":
        return _floats
    dtype = request.embed_dtype
    order = sys.byteorder if request.endianness == "native" else request.endianness

    def encode(vector: bytes) -> str:
        return _base64(_as_bytes(vector, dtype, order))

    return encode


def _floats(vector: bytes) -> list[float]:
    return pooled_values(vector).tolist()


def _as_bytes(vector: bytes, dtype: str, order: str) -> bytes:
    """The engine's float32 little-endian vector as `dtype` elements in byte `order`;
    bfloat16 rounds to nearest even, as torch's conversion does."""
    values = pooled_values(vector)
    if dtype == "float16":
        out = values.astype(np.float16)
    elif dtype == "bfloat16":
        bits = values.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out = rounded.astype(np.uint16)
        nan = np.isnan(values)
        out[nan] = 0x7FC0
    else:
        out = values
    return out.astype(out.dtype.newbyteorder("<" if order == "little" else ">")).tobytes()


def _base64(vector: bytes) -> str:
    return base64.b64encode(vector).decode("ascii")
