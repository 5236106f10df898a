"""Cohere's embed API v2 (`POST /v2/embed`, what `cohere.ClientV2.embed` calls; vLLM
serves it too): request and response models; see docs/api.md."""

from __future__ import annotations

import builtins
from typing import Any, Literal

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from handlers.protocol.base import FieldError, OpenAIBaseModel, WireModel, limits_from
from handlers.protocol.sampling import INT64_MAX

CohereEmbeddingType = Literal["float", "binary", "ubinary", "base64"]
"""The `embedding_types` served (vLLM's set; Cohere's int8 / uint8 need its calibration)."""


class CohereEmbedRequest(OpenAIBaseModel):
    """`texts` (or `inputs` of text content), one embedding each."""

    model: str | None = None
    input_type: str | None = None
    """Selects the model's task prefix (`PoolingConfig.prompts`); see the service."""
    texts: list[str] | None = None
    images: list[Any] | None = None
    inputs: list[dict[str, Any]] | None = None
    """Cohere's mixed inputs: `{"content": [{"type": "text", "text": ...}, ...]}`; only
    text parts are served (joined in order)."""
    output_dimension: int | None = Field(default=None, ge=1)
    embedding_types: list[CohereEmbeddingType] | None = None
    truncate: Literal["NONE", "START", "END"] = "END"
    """END: keep an input's first tokens; START: its last; NONE: refuse a long input."""
    max_tokens: int | None = Field(default=None, ge=1)
    """The longest input kept (or, with truncate NONE, allowed); default: the context."""
    priority: int = Field(default=0, ge=-INT64_MAX - 1, le=INT64_MAX)

    @property
    def request_id(self) -> None:
        """Cohere's API names no request id (ServingEmbedding.pool reads one)."""
        return None

    @property
    def cache_salt(self) -> None:
        """Nor a cache salt."""
        return None

    @field_validator("images")
    @classmethod
    def _no_images(cls, value: list[Any] | None) -> list[Any] | None:
        if value is not None:
            raise FieldError(None, "image embeddings are not supported; this server embeds text")
        return value

    @field_validator("embedding_types", mode="before")
    @classmethod
    def _known_types(cls, value: Any) -> Any:
        if isinstance(value, list):
            for i, kind in enumerate(value):
                if kind in ("int8", "uint8"):
                    raise FieldError(
                        i,
                        f"{kind} needs Cohere's calibration; use float, binary, ubinary or base64",
                    )
        return value

    @model_validator(mode="after")
    def _one_input(self, info: ValidationInfo) -> CohereEmbedRequest:
        given = [name for name in ("texts", "inputs") if getattr(self, name) is not None]
        if len(given) != 1:
            raise FieldError(
                "texts", "send exactly one of texts or inputs (images are not supported)"
            )
        name = given[0]
        values = getattr(self, name)
        limit = limits_from(info.context).max_sequences_per_request
        if not values:
            raise FieldError(name, "must not be empty")
        if len(values) > limit:
            raise FieldError(name, f"at most {limit} inputs per request")
        if self.inputs is not None:
            for i, item in enumerate(self.inputs):
                _input_text(item, i)
        return self

    def input_texts(self) -> list[str]:
        """Each input as one text (an `inputs` entry's text parts joined)."""
        if self.texts is not None:
            return list(self.texts)
        return [_input_text(item, i) for i, item in enumerate(self.inputs or [])]


def _input_text(item: dict[str, Any], index: int) -> str:
    content = item.get("content") if isinstance(item, dict) else None
    if not isinstance(content, list) or not content:
        raise FieldError(("inputs", index, "content"), "must be a non-empty list of parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise FieldError(
                ("inputs", index, "content", j), "only text parts are supported ({'type': 'text'})"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise FieldError(("inputs", index, "content", j, "text"), "must be a string")
        texts.append(text)
    return "".join(texts)


class CohereEmbeddings(WireModel):
    """One list per requested type; the types not asked for are left out."""

    # `float` names a field here, so the element type is spelled `builtins.float`.
    float: list[list[builtins.float]] | None = None
    binary: list[list[int]] | None = None
    ubinary: list[list[int]] | None = None
    base64: list[str] | None = None

    @model_serializer(mode="wrap")
    def _asked_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class CohereApiVersion(WireModel):
    version: str = "2"


class CohereBilledUnits(WireModel):
    input_tokens: int
    image_tokens: int = 0


class CohereMeta(WireModel):
    api_version: CohereApiVersion = Field(default_factory=CohereApiVersion)
    billed_units: CohereBilledUnits


class CohereEmbedResponse(WireModel):
    id: str
    embeddings: CohereEmbeddings
    texts: list[str] | None = None
    meta: CohereMeta
    response_type: Literal["embeddings_by_type"] = "embeddings_by_type"
