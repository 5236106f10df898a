"""Cohere's embed API v2 (`POST /v2/embed`) on the embeddings path: each text is one
embedding request, answered in Cohere's shape with the `embedding_types` asked for.

Where vLLM's version is stricter than clients allow, this one follows Cohere's contract:
the Cohere SDK always sends `input_type`, and vLLM refuses it for a model that defines no
task prefixes; here it then selects nothing. For a model that does define prefixes
(sentence-transformers' `prompts`, `task_instructions`), `input_type` picks one by name,
Cohere's names matching the usual sentence-transformers ones (`search_query` → `query`,
`search_document` → `document` or `passage`), and the prefix is put before each text as
sentence-transformers puts it; an input type the model does not define is a 400.
"""

from __future__ import annotations

import base64

import numpy as np

from handlers.errors import BadRequestError
from handlers.protocol.cohere_embed import (
    CohereBilledUnits,
    CohereEmbeddings,
    CohereEmbedRequest,
    CohereEmbedResponse,
    CohereMeta,
)
from handlers.serving.context import RequestContext
from handlers.serving.embedding import ServingEmbedding
from handlers.serving.served_model import Truncation

INPUT_TYPE_ALIASES: dict[str, tuple[str, ...]] = {
    "search_query": ("query",),
    "search_document": ("document", "passage"),
}
"""Cohere input types → the sentence-transformers prompt names they mean."""

SIGNED_BINARY_OFFSET = 128
"""Cohere's `binary` is `ubinary` shifted into int8."""


class ServingCohereEmbed(ServingEmbedding):
    kind = "embedding"
    id_prefix = "embd"

    async def create_cohere(
        self, request: CohereEmbedRequest, ctx: RequestContext
    ) -> CohereEmbedResponse:
        self.model_name(request.model)  # 404 first
        pooling = self.pooling_params(request.output_dimension)
        prefix = self._prefix(request.input_type)
        field = "texts" if request.texts is not None else "inputs"
        inputs = await self.tokenize_prompts(
            [prefix + text for text in request.input_texts()],
            add_special_tokens=True,
            field=field,
            truncation=self._truncation(request),
        )
        if request.truncate == "NONE" and request.max_tokens is not None:
            for prompt in inputs:
                if len(prompt.token_ids) > request.max_tokens:
                    raise BadRequestError(
                        f"{prompt.param} has {len(prompt.token_ids)} tokens, more than "
                        f"max_tokens={request.max_tokens} with truncate=NONE; set truncate "
                        "to END or START to allow truncation.",
                        param=prompt.param,
                    )
        pooled = await self.pool(inputs, pooling, ctx, request)
        vectors = pooled.matrix()
        return CohereEmbedResponse(
            id=pooled.response_id,
            embeddings=_typed(vectors, request.embedding_types or ["float"]),
            texts=request.texts,
            meta=CohereMeta(billed_units=CohereBilledUnits(input_tokens=pooled.num_prompt_tokens)),
        )

    def _prefix(self, input_type: str | None) -> str:
        pooling = self.served.info().pooling
        prompts = pooling.prompts if pooling is not None else None
        if input_type is None or not prompts:
            return ""
        for name in (input_type, *INPUT_TYPE_ALIASES.get(input_type, ())):
            if name in prompts:
                return prompts[name]
        raise BadRequestError(
            f"Unsupported input_type {input_type!r}: this model's task prefixes are "
            f"{', '.join(sorted(prompts))}.",
            param="input_type",
        )

    def _truncation(self, request: CohereEmbedRequest) -> Truncation | None:
        """END keeps an input's first tokens, START its last (at most max_tokens, else
        the context); NONE keeps every token (a too-long input is a 400)."""
        if request.truncate == "NONE":
            return None
        side = "right" if request.truncate == "END" else "left"
        return self.served.truncation(request.max_tokens or -1, side, "max_tokens")


def _typed(vectors: np.ndarray, kinds: list[str]) -> CohereEmbeddings:
    """The vectors in each asked type: float (JSON numbers), base64 (float32 little
    endian), ubinary / binary (one bit per value, set where it is >= 0, eight to a byte,
    most significant first; binary as int8). The binary types need a length that is a
    multiple of 8."""
    out = CohereEmbeddings()
    for kind in dict.fromkeys(kinds):
        if kind == "float":
            out.float = vectors.astype(np.float64).tolist()
        elif kind == "base64":
            out.base64 = [
                base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors
            ]
        else:
            if vectors.shape[1] % 8:
                raise BadRequestError(
                    f"{kind} embeddings need a length that is a multiple of 8; this one is "
                    f"{vectors.shape[1]}.",
                    param="embedding_types",
                )
            packed = np.packbits(vectors >= 0, axis=-1).astype(np.int16)
            if kind == "binary":
                out.binary = (packed - SIGNED_BINARY_OFFSET).tolist()
            else:
                out.ubinary = packed.tolist()
    return out
