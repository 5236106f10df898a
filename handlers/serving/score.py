"""vLLM's score and rerank APIs over the embedding path: every distinct input (each query,
each document) is embedded once, as `/v1/embeddings` would embed it, and a pair's score
is the cosine similarity of its two vectors (vLLM's bi-encoder scoring, what it does for
an embedding model).

hearth serves decoder models, whose embeddings are the model's pooled hidden states
(`engine/pooling_config.py`); it has no cross-encoder (sequence-classification) heads,
so vLLM's cross-encoder-only fields are refused rather than ignored: `instruction` and
`chat_template_kwargs` fill a reranker's pair template, and a bi-encoder has none (an
embedding model's instruction is part of the query text: send it there).
"""

from __future__ import annotations

import numpy as np

from handlers.errors import BadRequestError
from handlers.protocol.base import UsageInfo
from handlers.protocol.score import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    ScoringRequestBase,
)
from handlers.serving.base import PromptInput
from handlers.serving.context import RequestContext
from handlers.serving.embedding import PooledBatch, ServingEmbedding
from handlers.serving.served_model import Truncation

RERANK_SIDES = ("query", "documents")

COSINE_EPS = 1e-8
"""The smallest vector norm a cosine divides by (torch's `cosine_similarity` default),
so a zero vector scores 0 instead of NaN."""


class ServingScores(ServingEmbedding):
    """`POST /score` (`/v1/score`) and `/rerank` (`/v1/rerank`, `/v2/rerank`), and the
    /invocations bodies of their shapes."""

    kind = "score"
    id_prefix = "score"

    async def score(self, request: ScoreRequest, ctx: RequestContext) -> ScoreResponse:
        """Side 1 against side 2: 1:1, 1:N (the one text against each) or N:N (pairwise)."""
        model_name = self.model_name(request.model)
        pooled = await self._embed(request, (request.first, request.second), request.sides, ctx)
        scores = _pair_scores(pooled.vectors, len(request.first))
        tokens = pooled.num_prompt_tokens
        return ScoreResponse(
            id=pooled.response_id,
            model=model_name,
            data=[ScoreData(index=i, score=score) for i, score in enumerate(scores)],
            usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens),
        )

    async def rerank(self, request: RerankRequest, ctx: RequestContext) -> RerankResponse:
        """The documents by relevance to the query, most relevant first (ties keep the
        documents' order); the first `top_n` when it is set."""
        model_name = self.model_name(request.model)
        pooled = await self._embed(request, ([request.query], request.texts), RERANK_SIDES, ctx)
        scores = _pair_scores(pooled.vectors, 1)
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
        if request.top_n:
            ranked = ranked[: request.top_n]
        results = [
            RerankResult(
                index=i,
                document=RerankDocument(text=request.texts[i])
                if request.return_documents
                else None,
                relevance_score=scores[i],
            )
            for i in ranked
        ]
        tokens = pooled.num_prompt_tokens
        return RerankResponse(
            id=pooled.response_id,
            model=model_name,
            usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens),
            results=results,
        )

    async def _embed(
        self,
        request: ScoringRequestBase,
        texts: tuple[list[str], list[str]],
        sides: tuple[str, str],
        ctx: RequestContext,
    ) -> PooledBatch:
        """The queries' then the documents' vectors, each text tokenized under its
        side's truncation (a bad one reported under its side's name in `sides`)."""
        _refuse_cross_encoder_fields(request)
        pooling = self.pooling_params()
        inputs = await self._tokenize(
            request, texts[0], sides[0], request.max_tokens_per_query, "max_tokens_per_query"
        )
        inputs += await self._tokenize(
            request, texts[1], sides[1], request.max_tokens_per_doc, "max_tokens_per_doc"
        )
        return await self.pool(
            inputs,
            pooling,
            ctx,
            request_id=request.request_id,
            priority=request.priority,
            cache_salt=request.cache_salt,
        )

    async def _tokenize(
        self,
        request: ScoringRequestBase,
        texts: list[str],
        field: str,
        head: int,
        head_param: str,
    ) -> list[PromptInput]:
        truncation = self.served.truncation(request.truncate_prompt_tokens, request.truncation_side)
        if head:
            max_model_len = self.served.info().max_model_len
            if head >= max_model_len:
                raise BadRequestError(
                    f"{head_param} ({head}) must be less than max_model_len ({max_model_len}).",
                    param=head_param,
                )
            truncation = (
                Truncation(max_model_len, "left", head)
                if truncation is None
                else Truncation(truncation.size, truncation.side, head)
            )
        return await self.tokenize_prompts(
            texts, add_special_tokens=True, field=field, truncation=truncation
        )


def _refuse_cross_encoder_fields(request: ScoringRequestBase) -> None:
    if request.instruction is not None:
        raise BadRequestError(
            "instruction fills a cross-encoder (reranker) model's pair template; this "
            "server scores by embedding similarity: put the instruction in the query text.",
            param="instruction",
        )
    if request.chat_template_kwargs:
        raise BadRequestError(
            "chat_template_kwargs fill a cross-encoder (reranker) model's pair template; "
            "this server scores by embedding similarity, with no template.",
            param="chat_template_kwargs",
        )


def _pair_scores(vectors: list[bytes], num_first: int) -> list[float]:
    """Cosine similarity of each pair: the first `num_first` vectors are side 1, the rest
    side 2; one side-1 vector is paired with every side-2 vector, else pairwise."""
    matrix = np.stack([np.frombuffer(v, dtype="<f4") for v in vectors]).astype(np.float64)
    norms = np.maximum(np.linalg.norm(matrix, axis=1), COSINE_EPS)
    unit = matrix / norms[:, None]
    first, second = unit[:num_first], unit[num_first:]
    if num_first == 1:
        return (second @ first[0]).tolist()
    return np.einsum("ij,ij->i", first, second).tolist()
