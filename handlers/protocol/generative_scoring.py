"""vLLM's generative scoring (`POST /generative_scoring`): the probability that a
generative model's next token, after `query` + each item, is the first of
`label_token_ids` (an LLM used as a classifier: "yes" / "no"); see docs/api.md."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from handlers.protocol.base import FieldError, OpenAIBaseModel, limits_from, reject_negative_ids
from handlers.protocol.completion import check_prompts
from handlers.protocol.sampling import INT64_MAX, MAX_LOGPROB_TOKEN_IDS


class GenerativeScoringRequest(OpenAIBaseModel):
    model: str | None = None
    query: str | list[int]
    """Text, or token ids."""
    items: list[str] | list[list[int]]
    """Texts or token-id lists (one kind), each scored after (or before) the query."""
    label_token_ids: list[int] = Field(min_length=1, max_length=MAX_LOGPROB_TOKEN_IDS)
    apply_softmax: bool = True
    """True: the labels' probabilities renormalised over the labels alone; false: their
    probabilities over the whole vocabulary."""
    item_first: bool = False
    """Put each item before the query instead of after it."""
    add_special_tokens: bool = True
    """For the query's text (an item's text never gets special tokens: no second BOS)."""
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    priority: int = Field(default=0, ge=-INT64_MAX - 1, le=INT64_MAX)
    request_id: str | None = Field(default=None, min_length=1, max_length=256)

    @field_validator("query", mode="before")
    @classmethod
    def _check_query(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise FieldError(None, "must not be empty")
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
                raise FieldError(None, "token ids must be integers >= 0")
        return value

    @field_validator("items", mode="before")
    @classmethod
    def _check_items(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
            raise FieldError(None, "must be a list of texts or of token-id lists")
        return check_prompts(value, limits_from(info.context).max_sequences_per_request)

    @field_validator("label_token_ids")
    @classmethod
    def _non_negative(cls, value: list[int]) -> list[int]:
        reject_negative_ids(value)
        return value
