"""SageMaker's `POST /invocations`: one route, the API chosen by the body's shape.

`messages` means chat, `prompt` means completion, `inputs` means TGI's generate (what
clients of HF's TGI containers send), `input` means the Responses API. An embeddings
body is marked, because its `input` is also the Responses API's: `"task": "embeddings"`
(dropped before validation), or an `encoding_format` field, which only the embeddings
API has. A body marker rather than a header, because SageMaker forwards no custom
headers to the container. Dispatching on the key rather than on "the first model that
validates" (vLLM's way) keeps the precise 400 of the intended API instead of a generic
"matches nothing".

vLLM's score and rerank bodies are known by their keys: `query` with `documents` is a
rerank request, `text_1`, `data_1` or `queries` (their second sides too) a score request.
When the served model is a sequence classifier (it generates nothing), an `input` body
is a `/classify` request. A body with `texts` is Cohere's embed request (`/v2/embed`).

The rules are tried in order: the embeddings marker, Cohere's embed, rerank, score,
classify, then an Anthropic Messages body (`is_anthropic_body`): one with
`anthropic_version` (what Bedrock and Vertex bodies carry), or one with `messages` and a
field only Anthropic's API has at the top level (`system`, `stop_sequences`,
`thinking`); then `input` (Responses), then `messages`, `prompt` and `inputs`. A body
with only `messages` and `max_tokens` stays chat, as it always was.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from handlers.errors import BadRequestError
from handlers.protocol.base import parse_request
from handlers.protocol.chat import ChatCompletionRequest
from handlers.protocol.cohere_embed import CohereEmbedRequest
from handlers.protocol.completion import CompletionRequest
from handlers.protocol.embedding import ClassificationRequest, EmbeddingRequest
from handlers.protocol.responses import ResponsesRequest
from handlers.protocol.score import RerankRequest, ScoreRequest
from handlers.protocol.tgi import TGIRequest
from handlers.serving.chat import ServingChat
from handlers.serving.classification import ServingClassification
from handlers.serving.cohere_embed import ServingCohereEmbed
from handlers.serving.completion import ServingCompletion
from handlers.serving.context import RequestContext
from handlers.serving.embedding import ServingEmbedding
from handlers.serving.messages import ServingMessages
from handlers.serving.responses import ServingResponses
from handlers.serving.score import ServingScores
from handlers.serving.sse import SSEStream
from handlers.serving.tgi import ServingTGI

ANTHROPIC_ONLY_FIELDS = ("system", "stop_sequences", "thinking")
"""Top-level fields of an Anthropic Messages body that no chat completion body has."""

ACCEPTED_KINDS = (
    "an embeddings request (with 'input' and \"task\": \"embeddings\" or 'encoding_format')",
    "a Cohere embed request (with 'texts')",
    "a rerank request (with 'query' and 'documents')",
    "a score request (with 'text_1' and 'text_2', 'queries' and 'documents' or 'items', "
    "or 'data_1' and 'data_2')",
    "an Anthropic Messages request (with 'anthropic_version', or 'messages' and 'system', "
    "'stop_sequences' or 'thinking')",
    "a Responses request (with 'input')",
    "a chat completion request (with 'messages')",
    "a completion request (with 'prompt')",
    "a TGI generate request (with 'inputs')",
)

EMBEDDINGS_TASK = "embeddings"
"""The `task` value that marks an /invocations body as an embeddings request."""


def is_embeddings_body(body: dict[str, Any]) -> bool:
    return body.get("task") == EMBEDDINGS_TASK or "encoding_format" in body


SCORE_KEYS = ("text_1", "text_2", "data_1", "data_2", "queries")
"""Keys only vLLM's score request has (its `documents` and `items` come with `queries`)."""


def is_rerank_body(body: dict[str, Any]) -> bool:
    return "query" in body and "documents" in body


def is_score_body(body: dict[str, Any]) -> bool:
    return any(key in body for key in SCORE_KEYS)


def is_anthropic_body(body: dict[str, Any]) -> bool:
    """Whether an `/invocations` body is an Anthropic Messages request (module doc)."""
    if "anthropic_version" in body:
        return True
    return "messages" in body and any(name in body for name in ANTHROPIC_ONLY_FIELDS)


class ServingInvocations:
    def __init__(
        self,
        chat: ServingChat,
        completion: ServingCompletion,
        tgi: ServingTGI,
        embedding: ServingEmbedding,
        *,
        messages: ServingMessages | None = None,
        responses: ServingResponses | None = None,
        scores: ServingScores | None = None,
    ) -> None:
        self.chat = chat
        self.completion = completion
        self.tgi = tgi
        self.embedding = embedding
        self.messages = messages or ServingMessages(chat)
        self.responses = responses
        self.scores = scores or ServingScores(embedding.served, embedding.stats)
        self.classification = ServingClassification(embedding.served, embedding.stats)
        self.cohere_embed = ServingCohereEmbed(embedding.served, embedding.stats)

    def _serves_classifier(self) -> bool:
        pooling = self.embedding.served.info().pooling
        return pooling is not None and pooling.classifier is not None

    async def invoke(self, body: Any, ctx: RequestContext) -> BaseModel | SSEStream:
        """Streams iff the body says `"stream": true`, whatever the API."""
        limits = self.chat.served.limits
        if isinstance(body, dict):
            if is_embeddings_body(body):
                fields = {key: value for key, value in body.items() if key != "task"}
                embed = parse_request(EmbeddingRequest, fields, limits)
                return await self.embedding.create(embed, ctx)
            if "texts" in body:
                cohere = parse_request(CohereEmbedRequest, body, limits)
                return await self.cohere_embed.create_cohere(cohere, ctx)
            if is_rerank_body(body):
                rerank = parse_request(RerankRequest, body, limits)
                return await self.scores.rerank(rerank, ctx)
            if is_score_body(body):
                score = parse_request(ScoreRequest, body, limits)
                return await self.scores.score(score, ctx)
            if "input" in body and self._serves_classifier():
                classify = parse_request(ClassificationRequest, body, limits)
                return await self.classification.create_classification(classify, ctx)
            if is_anthropic_body(body):
                return await self.messages.create_from_body(body, ctx)
            if "input" in body and self.responses is not None:
                request = parse_request(ResponsesRequest, body, limits)
                return await self.responses.create(request, ctx)
            if "messages" in body:
                chat = parse_request(ChatCompletionRequest, body, limits)
                return await self.chat.create(chat, ctx)
            if "prompt" in body:
                completion = parse_request(CompletionRequest, body, limits)
                return await self.completion.create(completion, ctx)
            if "inputs" in body:
                return await self.tgi.generate(parse_request(TGIRequest, body, limits), ctx)
        raise BadRequestError(
            "The /invocations body must be a JSON object: " + "; ".join(ACCEPTED_KINDS) + ".",
            param=None,
        )
