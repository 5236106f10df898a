"""vLLM's score and rerank APIs, in vLLM's two ways:

- **Cross-encoder**, when the served model is a sequence classifier with one label (a
  reranker: `engine/models/classifier.py`): each pair is one prompt (the query and the
  document composed by the score template, or joined), and its score is the head's
  logit through the model's activation (a sigmoid by default).
- **Bi-encoder**, for any other model: every distinct text (each query, each document)
  is embedded once, as `/v1/embeddings` would embed it, and a pair's score is the cosine
  similarity of its two vectors. `instruction` and `chat_template_kwargs`, which fill a
  cross-encoder's template, are refused rather than ignored here (an embedding model's
  instruction is part of the query text: send it there).
"""

from __future__ import annotations

import numpy as np

from engine.messages import PoolingParams
from engine.pooling_config import ClassifierConfig
from engine.tokenizer import Tokenizer
from handlers.errors import BadRequestError
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
from handlers.serving.classification import activate, logits_of
from handlers.serving.context import RequestContext
from handlers.serving.embedding import PooledBatch, PoolScheduling, ServingEmbedding
from handlers.serving.render import template_variables
from handlers.serving.served_model import Truncation, offloads

RERANK_SIDES = ("query", "documents")

COSINE_EPS = 1e-8
"""The smallest vector norm a cosine divides by (torch's `cosine_similarity` default),
so a zero vector scores 0 instead of NaN."""


class ServingScores(ServingEmbedding):
    """`POST /score` (`/v1/score`) and `/rerank` (`/v1/rerank`, `/v2/rerank`), and the
    /invocations bodies of their shapes."""

    kind = "score"
    id_prefix = "score"

    def id_prefix_for(self, request: PoolScheduling) -> str:
        """`rerank-` for a rerank, as vLLM's; `score-` for a score."""
        return "rerank" if isinstance(request, RerankRequest) else self.id_prefix

    async def score(self, request: ScoreRequest, ctx: RequestContext) -> ScoreResponse:
        """Side 1 against side 2: 1:1, 1:N (the one text against each) or N:N (pairwise)."""
        model_name = self.model_name(request.model)
        scores, pooled = await self._scores(
            request, (request.first, request.second), request.sides, ctx
        )
        return ScoreResponse(
            id=pooled.response_id,
            model=model_name,
            data=[ScoreData(index=i, score=score) for i, score in enumerate(scores)],
            usage=pooled.usage(),
        )

    async def rerank(self, request: RerankRequest, ctx: RequestContext) -> RerankResponse:
        """The documents by relevance to the query, most relevant first (ties keep the
        documents' order); the first `top_n` when it is set."""
        model_name = self.model_name(request.model)
        scores, pooled = await self._scores(
            request, ([request.query], request.texts), RERANK_SIDES, ctx
        )
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

    async def _scores(
        self,
        request: ScoringRequestBase,
        texts: tuple[list[str], list[str]],
        sides: tuple[str, str],
        ctx: RequestContext,
    ) -> tuple[list[float], PooledBatch]:
        """Each pair's score: a sequence classifier's (cross-encoder) where the model is
        one, else the cosine of the two texts' embeddings (bi-encoder)."""
        head = self._cross_encoder()
        if head is None:
            pooled = await self._embed(request, texts, sides, ctx)
            return _pair_scores(pooled.matrix(), len(texts[0])), pooled
        pooled = await self._cross_encode(request, texts, sides, ctx)
        scores = [
            float(activate(logits_of(raw), head, request.use_activation)[0])
            for raw in pooled.vectors
        ]
        return scores, pooled

    def _cross_encoder(self) -> ClassifierConfig | None:
        """The served classifier's head when the model is one (it must have one label:
        a pair's score is that label's value); None for an embedding model."""
        config = self.served.info().pooling
        if config is None or config.classifier is None:
            return None
        if config.classifier.num_labels != 1:
            raise BadRequestError(
                f"score and rerank need a classifier with one label (a relevance score); "
                f"this model has {config.classifier.num_labels}: use /classify.",
                param="model",
            )
        return config.classifier

    async def _cross_encode(
        self,
        request: ScoringRequestBase,
        texts: tuple[list[str], list[str]],
        sides: tuple[str, str],
        ctx: RequestContext,
    ) -> PooledBatch:
        """One engine request per pair, its prompt the query and the document composed
        as vLLM composes them for a decoder reranker: through the server's
        `--chat-template` (the score template: messages of roles "query" and
        "document", with `chat_template_kwargs` and `instruction`) when one is set,
        else the two texts joined; each text first cut to `max_tokens_per_query` /
        `max_tokens_per_doc` tokens."""
        firsts, seconds = texts
        template = self.served.config.chat_template
        if template is None:
            _refuse_template_fields(
                request,
                "this server has none (start it with --chat-template, e.g. the model's "
                "reranker template)",
            )
        queries = await self._leading(firsts, request.max_tokens_per_query, "max_tokens_per_query")
        documents = await self._leading(seconds, request.max_tokens_per_doc, "max_tokens_per_doc")
        if len(queries) == 1:
            queries = queries * len(documents)
        pairs = zip(queries, documents, strict=True)
        prompts = [
            _compose(self.served.tokenizer(), template, query, document, request)
            for query, document in pairs
        ]
        truncation = self.served.truncation(request.truncate_prompt_tokens, request.truncation_side)
        inputs = await self.tokenize_prompts(
            prompts, add_special_tokens=True, field=sides[1], truncation=truncation
        )
        return await self.pool(inputs, PoolingParams(), ctx, request)

    async def _leading(self, texts: list[str], limit: int, param: str) -> list[str]:
        if not limit:
            return texts
        self._check_limit(limit, param)
        offload = offloads(texts)
        return [await self.served.leading_text(text, limit, offload=offload) for text in texts]

    def _check_limit(self, limit: int, param: str) -> None:
        max_model_len = self.served.info().max_model_len
        if limit >= max_model_len:
            raise BadRequestError(
                f"{param} ({limit}) must be less than max_model_len ({max_model_len}).",
                param=param,
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
        _refuse_template_fields(
            request,
            "this server scores by embedding similarity, with no template: put an "
            "instruction in the query text",
        )
        pooling = self.pooling_params()
        inputs = await self._tokenize(
            request, texts[0], sides[0], request.max_tokens_per_query, "max_tokens_per_query"
        )
        inputs += await self._tokenize(
            request, texts[1], sides[1], request.max_tokens_per_doc, "max_tokens_per_doc"
        )
        return await self.pool(inputs, pooling, ctx, request)

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
            self._check_limit(head, head_param)
            max_model_len = self.served.info().max_model_len
            truncation = (
                Truncation(max_model_len, "left", head)
                if truncation is None
                else Truncation(truncation.size, truncation.side, head)
            )
        return await self.tokenize_prompts(
            texts, add_special_tokens=True, field=field, truncation=truncation
        )


def _compose(
    tokenizer: Tokenizer,
    template: str | None,
    query: str,
    document: str,
    request: ScoringRequestBase,
) -> str:
    """A cross-encoder's prompt for one pair (see `_cross_encode`)."""
    if template is None:
        return query + document
    kwargs = template_variables(request.chat_template_kwargs)
    kwargs.pop("tokenize", None)  # vLLM's reserved name for its own renderer's switch
    if request.instruction is not None:
        kwargs.setdefault("instruction", request.instruction)
    messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=False, chat_template=template, **kwargs
        )
    except Exception as exc:  # a template error is the request's (its kwargs) or the flag's
        raise BadRequestError(
            f"the score template (--chat-template) failed to render this pair: {exc}",
            param="chat_template_kwargs",
        ) from None


def _refuse_template_fields(request: ScoringRequestBase, why: str) -> None:
    """`instruction` (even empty) and a non-empty `chat_template_kwargs` fill a score
    template: a 400 naming the field where there is none to fill, the one rule for a
    bi-encoder and for a cross-encoder started without --chat-template."""
    if request.instruction is not None:
        raise BadRequestError(
            f"instruction fills a cross-encoder's score template; {why}.", param="instruction"
        )
    if request.chat_template_kwargs:
        raise BadRequestError(
            f"chat_template_kwargs fill a cross-encoder's score template; {why}.",
            param="chat_template_kwargs",
        )


def _pair_scores(vectors: np.ndarray, num_first: int) -> list[float]:
    """Cosine similarity of each pair: the first `num_first` rows are side 1, the rest
    side 2; one side-1 vector is paired with every side-2 vector, else pairwise."""
    matrix = vectors.astype(np.float64)
    norms = np.maximum(np.linalg.norm(matrix, axis=1), COSINE_EPS)
    unit = matrix / norms[:, None]
    first, second = unit[:num_first], unit[num_first:]
    if num_first == 1:
        return (second @ first[0]).tolist()
    return np.einsum("ij,ij->i", first, second).tolist()
