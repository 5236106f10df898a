"""vLLM's `POST /pooling`: the embeddings path answered in vLLM's pooling shape
(`data[i].object` "pooling", the vector under `data`), for clients written against
vLLM's pooling API. Only the "embed" task exists here (one pooled vector per input);
vLLM's token-level and classifier tasks are refused by the request model."""

from __future__ import annotations

from handlers.protocol.embedding import PoolingData, PoolingRequest, PoolingResponse
from handlers.serving.context import RequestContext
from handlers.serving.embedding import ServingEmbedding, vector_encoder


class ServingPooling(ServingEmbedding):
    kind = "pooling"
    id_prefix = "pool"

    async def create_pooling(self, request: PoolingRequest, ctx: RequestContext) -> PoolingResponse:
        model_name = self.model_name(request.model)
        pooling = self.pooling_params(request.dimensions, normalize=request.use_activation)
        pooled = await self.embed(request, ctx, pooling)
        encode = vector_encoder(request)
        return PoolingResponse(
            id=pooled.response_id,
            model=model_name,
            data=[PoolingData(index=i, data=encode(v)) for i, v in enumerate(pooled.vectors)],
            usage=pooled.usage(),
        )
