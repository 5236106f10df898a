"""Shared pieces of the wire schema: base models, validation-error mapping, usage, errors.

Request models ignore unknown fields, as vLLM and OpenAI do (clients send vendor extras
all the time); each unknown field name is logged once per process so that a misspelt
parameter is still discoverable in the logs. Request models are strict about types
(no "0.7" for a float, no 1 for a bool) and reject NaN/inf: what OpenAI itself refuses.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from handlers.errors import BadRequestError

logger = logging.getLogger(__name__)

_logged_unknown_fields: set[str] = set()

_INDEX_OR_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")


ACTIVATION_ALIASES = AliasChoices("use_activation", "normalize", "activation", "softmax")
"""vLLM's switch of a pooled output's activation under its names old and new: silently
dropping `normalize: false` (an unknown field) would return normalised vectors."""


class FieldError(ValueError):
    """A validator's complaint about one field; `field` is relative to the validated model."""

    def __init__(self, field: str | int | tuple[str | int, ...] | None, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def reject_negative_ids(
    ids: Iterable[int], field: str | None = None, message: str = "token ids must be >= 0"
) -> None:
    """The one check of request fields that name token ids: none may be negative (the
    vocabulary's upper bound needs the model and is checked when params are built)."""
    if any(t < 0 for t in ids):
        raise FieldError(field, message)


class OpenAIBaseModel(BaseModel):
    """Base of request models: strict types, unknown fields ignored and logged once."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _log_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            aliases = {f.alias for f in cls.model_fields.values() if f.alias}
            for name in data:
                if name not in cls.model_fields and name not in aliases and isinstance(name, str):
                    key = f"{cls.__name__}.{name}"
                    if key not in _logged_unknown_fields and len(_logged_unknown_fields) < 1000:
                        _logged_unknown_fields.add(key)
                        logger.warning("ignoring unknown request field %r (%s)", name, cls.__name__)
        return data


def _not_zero(value: int) -> int:
    if value == 0:
        raise FieldError(None, "must be -1 (the context length) or at least 1")
    return value


TruncatePromptTokens = Annotated[int, Field(ge=-1), AfterValidator(_not_zero)]
"""vLLM's `truncate_prompt_tokens`: keep only k of a prompt's tokens (-1: as many as the
context holds); `ServedModel.truncation` resolves it against the model."""
TruncationSide = Literal["left", "right"]
"""vLLM's `truncation_side`: "left" drops a prompt's first tokens (the default), "right"
its last."""
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
"""vLLM's chat `reasoning_effort` values, passed to the chat template as a variable."""


def reject_unsupported(data: Any, table: Mapping[str, str], *, beam_search: bool = False) -> None:
    """Raise for any parameter of `table` present with a meaningful (non-empty) value,
    and for vLLM's `use_beam_search` where the request type (`beam_search`) has none."""
    if not isinstance(data, dict):
        return
    for name, why in table.items():
        value = data.get(name)
        if value not in (None, [], {}, False, ""):
            raise FieldError(name, why)
    if not beam_search and data.get("use_beam_search") is True:
        raise FieldError(
            "use_beam_search",
            "beam search is not supported here; /v1/chat/completions and /v1/completions run it",
        )


class WireModel(BaseModel):
    """Base of response models (what we send): plain pydantic, nothing extra."""

    model_config = ConfigDict(extra="forbid")


class ChunkModel(WireModel):
    """A streamed chunk: serialized with `exclude_unset` (only what was set), except
    `object`, which every chunk carries."""

    def model_post_init(self, context: Any, /) -> None:
        self.__pydantic_fields_set__.add("object")


ModelT = TypeVar("ModelT", bound=BaseModel)


def parse_request(model: type[ModelT], data: Any, limits: RequestLimits | None = None) -> ModelT:
    """Validate a decoded JSON body into a request model, or raise a 400 naming the field."""
    if not isinstance(data, dict):
        raise BadRequestError(
            f"The request body must be a JSON object, not {_json_type(data)}.", param=None
        )
    try:
        return model.model_validate(data, context=limits or DEFAULT_LIMITS)
    except ValidationError as exc:
        raise bad_request_from(exc) from None


def bad_request_from(exc: ValidationError) -> BadRequestError:
    """The most specific error of a pydantic failure as an OpenAI 400.

    With unions pydantic reports one error per member; the deepest location is the one
    that explains what is wrong (`content[1].type`, not "content should be a string").
    """
    errors = exc.errors(include_url=False)
    best = max(errors, key=lambda e: len(_clean_loc(e["loc"])))
    loc = _clean_loc(best["loc"])
    ctx = best.get("ctx") or {}
    original = ctx.get("error")
    if isinstance(original, FieldError):
        if isinstance(original.field, int):
            loc = [*loc, original.field]
        elif isinstance(original.field, tuple):
            loc = [*loc, *original.field]
        elif original.field:
            loc = [*loc, *original.field.split(".")]
        message = original.message
    else:
        message = best["msg"]
        if message.startswith("Value error, "):
            message = message[len("Value error, ") :]
    param = format_param(loc) if loc else None
    return BadRequestError(f"{param}: {message}" if param else message, param=param)


def _clean_loc(loc: tuple[int | str, ...]) -> list[int | str]:
    """Drop pydantic's union-member tags ('str', 'list[int]', 'function-after[...]')."""
    cleaned: list[int | str] = []
    for part in loc:
        if isinstance(part, int) or (_INDEX_OR_NAME.match(part) and part not in _TYPE_TAGS):
            cleaned.append(part)
    return cleaned


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "tuple", "set"})


def format_param(loc: list[int | str]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return type(value).__name__


# -- shared response pieces ----------------------------------------------------------
class PromptTokensDetails(WireModel):
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""


class UsageInfo(WireModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class PooledListResponse(WireModel):
    """What the pooling APIs' answers share (embeddings, /pooling, /classify, /score):
    OpenAI's list envelope; each subclass adds its `data` items. `usage.prompt_tokens`
    (= total_tokens) counts every prompt run; completion_tokens is 0."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: UsageInfo


class PromptLogprob(WireModel):
    """vLLM's `Logprob`: one entry of a `prompt_logprobs` position, keyed by token id."""

    logprob: float
    rank: int | None = None
    """1 for the most likely token."""
    decoded_token: str | None = None


class ErrorInfo(WireModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(WireModel):
    error: ErrorInfo


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    """Send a last chunk with `choices: []` and the request's usage."""
    continuous_usage_stats: bool | None = False
    """vLLM: put the usage so far in every chunk."""


class RequestLimits(BaseModel):
    """Server limits that request validation enforces (pydantic validation context)."""

    model_config = ConfigDict(frozen=True)

    max_n: int = 16
    max_logprobs: int = 20
    max_stop_strings: int = 64
    max_sequences_per_request: int = 1024
    """prompts x n of one request: each is an engine request; 256 x 16 would queue 4096
    at once and starve everyone else."""
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024
    """Entries of logit_bias (OpenAI's limit is of the same order; the full vocabulary is not)."""


DEFAULT_LIMITS = RequestLimits()


def limits_from(context: Any) -> RequestLimits:
    """The limits passed as validation context, or the defaults."""
    return context if isinstance(context, RequestLimits) else DEFAULT_LIMITS
