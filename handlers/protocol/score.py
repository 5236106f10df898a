"""vLLM's score and rerank APIs (`POST /score`, `/v1/score`; `/rerank`, `/v1/rerank`,
`/v2/rerank`, the Jina / Cohere shape): request and response models; see docs/api.md.

A score request names its two sides in one of vLLM's four spellings (`text_1`/`text_2`,
`queries`/`documents`, `queries`/`items`, `data_1`/`data_2`); a rerank request has one
`query` and its `documents`. Inputs are texts: vLLM's multimodal `{"content": [...]}`
parts are refused, and a rerank document may also be Cohere's and Jina's `{"text": ...}`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from handlers.protocol.base import (
    ACTIVATION_ALIASES,
    FieldError,
    OpenAIBaseModel,
    PooledListResponse,
    TruncatePromptTokens,
    TruncationSide,
    WireModel,
    limits_from,
    reject_unsupported,
)
from handlers.protocol.sampling import INT64_MAX

_UNSUPPORTED_SCORE_FIELDS: Mapping[str, str] = {
    "mm_processor_kwargs": "multimodal inputs are not supported; this server scores text",
}

SCORE_PAIR_NAMES: tuple[tuple[str, str], ...] = (
    ("text_1", "text_2"),
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
)
"""vLLM's spellings of a score request's two sides, in the order they are tried."""


def _text_of(value: Any, field: str | int | None, *, text_objects: bool) -> str:
    """One input as text: a string, or (rerank documents) an object `{"text": ...}`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        if "content" in value:
            raise FieldError(field, "multimodal content is not supported; send text")
        if text_objects and isinstance(value.get("text"), str):
            return value["text"]
    shape = "a string or an object with a string 'text'" if text_objects else "a string"
    raise FieldError(field, f"must be {shape}")


def score_inputs(value: Any, max_inputs: int, *, text_objects: bool = False) -> list[str]:
    """One side of a score or rerank request as a list of texts (one text or a
    non-empty list of them, at most `max_inputs`)."""
    if not isinstance(value, list):
        return [_text_of(value, None, text_objects=text_objects)]
    if not value:
        raise FieldError(None, "must not be empty")
    if len(value) > max_inputs:
        raise FieldError(None, f"at most {max_inputs} inputs per request")
    return [_text_of(item, i, text_objects=text_objects) for i, item in enumerate(value)]


class ScoringRequestBase(OpenAIBaseModel):
    """The fields vLLM's score and rerank requests share."""

    unsupported_fields: ClassVar[Mapping[str, str]] = _UNSUPPORTED_SCORE_FIELDS

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    """Each input (query or document) keeps its last k tokens (-1: the context length)."""
    truncation_side: TruncationSide | None = None
    """"right": each input keeps its first k tokens instead."""
    max_tokens_per_query: int = Field(default=0, ge=0)
    """Each query keeps its first n tokens (special tokens not counted); 0: all."""
    max_tokens_per_doc: int = Field(default=0, ge=0)
    """Each document keeps its first n tokens (special tokens not counted); 0: all."""
    padding: Literal["do_not_pad"] | None = None
    """vLLM's; inputs are never padded here, so "max_length" is refused."""
    use_activation: bool | None = Field(default=None, validation_alias=ACTIVATION_ALIASES)
    """vLLM's (also as `activation` / `softmax` / `normalize`); no effect on a cosine
    similarity, which is scale-free."""
    instruction: str | None = None
    """vLLM's, for cross-encoder (reranker) chat templates: refused (service docstring)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """As `instruction`."""
    priority: int = Field(default=0, ge=-INT64_MAX - 1, le=INT64_MAX)
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        reject_unsupported(data, cls.unsupported_fields)
        return data


class ScoreRequest(ScoringRequestBase):
    """vLLM's score request: texts of side 1 against texts of side 2, 1:1, 1:N or N:N.
    `model_validate` fills `first` and `second` from whichever spelling the body uses."""

    text_1: Any = None
    text_2: Any = None
    queries: Any = None
    documents: Any = None
    items: Any = None
    data_1: Any = None
    data_2: Any = None
    _first: list[str] = PrivateAttr(default_factory=list)
    _second: list[str] = PrivateAttr(default_factory=list)
    _sides: tuple[str, str] = PrivateAttr(default=("text_1", "text_2"))

    @property
    def first(self) -> list[str]:
        """Side 1's texts."""
        return self._first

    @property
    def second(self) -> list[str]:
        """Side 2's texts."""
        return self._second

    @property
    def sides(self) -> tuple[str, str]:
        """The names the body gave its two sides (a bad input is reported under them)."""
        return self._sides

    @model_validator(mode="after")
    def _pick_sides(self, info: ValidationInfo) -> ScoreRequest:
        given = {
            name for pair in SCORE_PAIR_NAMES for name in pair if getattr(self, name) is not None
        }
        complete = [pair for pair in SCORE_PAIR_NAMES if set(pair) <= given]
        if len(complete) != 1 or given != set(complete[0]):
            raise FieldError(
                sorted(given)[0] if given else "text_1",
                "a score request names its two sides in one of vLLM's spellings: text_1 and "
                "text_2, queries and documents, queries and items, or data_1 and data_2 "
                f"(got {', '.join(sorted(given)) or 'none'})",
            )
        name_1, name_2 = self._sides = complete[0]
        max_inputs = limits_from(info.context).max_sequences_per_request
        try:
            self._first = score_inputs(getattr(self, name_1), max_inputs)
        except FieldError as exc:
            raise _under(name_1, exc) from None
        try:
            self._second = score_inputs(getattr(self, name_2), max_inputs)
        except FieldError as exc:
            raise _under(name_2, exc) from None
        if len(self.first) > 1 and len(self.first) != len(self.second):
            raise FieldError(
                name_2,
                f"input lengths must be 1:1, 1:N or N:N; got {len(self.first)} {name_1} "
                f"and {len(self.second)} {name_2}",
            )
        if len(self.first) + len(self.second) > max_inputs:
            raise FieldError(name_2, f"at most {max_inputs} inputs (both sides) per request")
        return self


class RerankRequest(ScoringRequestBase):
    """vLLM's rerank request (Jina's and Cohere's shape): one query, its documents."""

    query: str
    documents: Any
    top_n: int = Field(default=0, ge=0)
    """Return the n most relevant documents; 0 (default): all of them."""
    return_documents: bool = True
    """Jina's and Cohere's: false leaves each result's `document` out."""
    _texts: list[str] = PrivateAttr(default_factory=list)

    @property
    def texts(self) -> list[str]:
        """The documents as texts."""
        return self._texts

    @model_validator(mode="after")
    def _read_documents(self, info: ValidationInfo) -> RerankRequest:
        max_inputs = limits_from(info.context).max_sequences_per_request - 1
        try:
            self._texts = score_inputs(self.documents, max_inputs, text_objects=True)
        except FieldError as exc:
            raise _under("documents", exc) from None
        return self

    @field_validator("query", mode="before")
    @classmethod
    def _query_text(cls, value: Any) -> Any:
        if isinstance(value, dict) and "content" in value:
            raise FieldError(None, "multimodal content is not supported; send text")
        return value


def _under(name: str, exc: FieldError) -> FieldError:
    """`exc` (about one side's input, or its i-th) as an error at `name` or `name[i]`."""
    field: str | tuple[str | int, ...] = name if exc.field is None else (name, exc.field)
    return FieldError(field, exc.message)


class ScoreData(WireModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(PooledListResponse):
    data: list[ScoreData]


class RerankDocument(WireModel):
    text: str


class RerankResult(WireModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(WireModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(WireModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
    """Most relevant first; `top_n` of them when given."""
