"""Hugging Face TGI's generate API, as SageMaker clients of TGI containers send it to
/invocations: `{"inputs": str, "parameters": {...}, "stream": bool}`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    Field,
    RootModel,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from engine.sampling_params import SamplingParams, StructuredOutputSpec
from handlers.protocol.base import (
    FieldError,
    OpenAIBaseModel,
    WireModel,
    limits_from,
    reject_unsupported,
)
from handlers.protocol.json_schema import check_text, parse_schema, schema_text
from handlers.protocol.sampling import (
    INT64_MAX,
    SamplingBounds,
    make_sampling_params,
    resolve_max_tokens,
)

DEFAULT_MAX_NEW_TOKENS = 100
"""TGI's default when `max_new_tokens` is not given."""


_UNSUPPORTED_TGI_PARAMETERS: Mapping[str, str] = {}
"""TGI parameters that would change the answer if honoured: a 400, never ignored."""


class TGIGrammar(OpenAIBaseModel):
    """TGI's guidance: `{"type": "json", "value": <schema>}` or `{"type": "regex", ...}`."""

    type: Literal["json", "regex"]
    value: Any

    @model_validator(mode="after")
    def _check_value(self) -> TGIGrammar:
        try:
            if self.type == "json":
                self.value = parse_schema(self.value)
            elif not isinstance(self.value, str):
                raise FieldError(None, "a regex grammar's value must be a string")
            else:
                check_text(self.value, "regex")
        except FieldError as exc:
            raise FieldError("value", exc.message) from None
        return self

    def spec(self) -> StructuredOutputSpec:
        if self.type == "json":
            return StructuredOutputSpec(
                kind="json", value=schema_text(self.value), param="parameters.grammar.value"
            )
        return StructuredOutputSpec(
            kind="regex", value=self.value, param="parameters.grammar.value"
        )


class TGIParameters(OpenAIBaseModel):
    max_new_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, gt=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, gt=0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    stop: list[str] = Field(default_factory=list)
    seed: int | None = Field(default=None, ge=0, le=INT64_MAX)
    truncate: int | None = Field(default=None, ge=1)
    """Keep the input's last `truncate` tokens (TGI's left truncation)."""
    do_sample: bool = False
    details: bool = False
    return_full_text: bool = False
    best_of: int | None = Field(default=None, ge=1, le=1)
    grammar: TGIGrammar | None = None
    top_n_tokens: int | None = Field(default=None, ge=0)
    """TGI's: the n most likely tokens at each generated position (`details.top_tokens`,
    streamed: each event's `top_tokens`); at most `max_logprobs`."""
    decoder_input_details: bool = False
    """TGI's: with `details`, each prompt token with its logprob (`details.prefill`; the
    first has none). Not with a stream, as TGI."""

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        reject_unsupported(data, _UNSUPPORTED_TGI_PARAMETERS)
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return []
        if not isinstance(value, list):
            raise FieldError(None, "must be a list of strings")
        limit = limits_from(info.context).max_stop_strings
        if len(value) > limit:
            raise FieldError(None, f"at most {limit} stop sequences are allowed")
        for i, item in enumerate(value):
            if not isinstance(item, str) or not item:
                raise FieldError(i, "stop sequences must be non-empty strings")
        return value

    @property
    def is_sampling(self) -> bool:
        """TGI samples when asked to, or when any sampling warper is set."""
        return self.do_sample or any(
            v is not None and v != neutral
            for v, neutral in ((self.temperature, 1.0), (self.top_p, 1.0), (self.top_k, 0))
        )


class TGIRequest(OpenAIBaseModel):
    inputs: str = Field(min_length=1)
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: bool = False

    @model_validator(mode="after")
    def _check_details(self, info: ValidationInfo) -> TGIRequest:
        p = self.parameters
        limit = limits_from(info.context).max_logprobs
        if p.top_n_tokens is not None and p.top_n_tokens > limit:
            raise FieldError(
                "parameters.top_n_tokens",
                f"top_n_tokens must be at most {limit}, got {p.top_n_tokens}",
            )
        if p.decoder_input_details and self.stream:
            raise FieldError(
                "parameters.decoder_input_details",
                "decoder_input_details == true is not supported when streaming tokens",
            )
        return self

    @property
    def wants_prefill(self) -> bool:
        return self.parameters.details and self.parameters.decoder_input_details

    def to_sampling_params(self, bounds: SamplingBounds) -> SamplingParams:
        """TGI's parameters in the engine's terms (greedy unless sampling was asked for;
        a stream or `details` needs each token's logprob). TGI has no model defaults."""
        p = self.parameters
        return make_sampling_params(
            max_tokens=resolve_max_tokens(
                p.max_new_tokens,
                param="parameters.max_new_tokens",
                prompt_len=bounds.prompt_len,
                max_model_len=bounds.max_model_len,
                default=DEFAULT_MAX_NEW_TOKENS,
            ),
            vocab_size=bounds.vocab_size,
            temperature=(p.temperature or 1.0) if p.is_sampling else 0.0,
            top_p=p.top_p or 1.0,
            top_k=p.top_k or -1,
            repetition_penalty=p.repetition_penalty or 1.0,
            frequency_penalty=p.frequency_penalty or 0.0,
            seed=p.seed,
            logprobs=p.top_n_tokens or (0 if self.stream or p.details else None),
            structured=p.grammar.spec() if p.grammar is not None else None,
            prompt_logprobs=0 if self.wants_prefill else None,
        )


class TGIToken(WireModel):
    id: int
    text: str
    logprob: float | None = None
    special: bool = False


class _WithTopTokens(WireModel):
    """A TGI answer with `top_tokens`, left out when empty (TGI's `skip_serializing_if =
    "Vec::is_empty"`)."""

    @model_serializer(mode="wrap")
    def _drop_empty_top_tokens(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if not data.get("top_tokens"):
            data.pop("top_tokens", None)
        return data


class TGIPrefillToken(WireModel):
    id: int
    text: str
    logprob: float | None = None
    """None for the first prompt token (nothing precedes it)."""


class TGIDetails(_WithTopTokens):
    finish_reason: str
    """'length', 'eos_token' or 'stop_sequence'."""
    generated_tokens: int
    seed: int | None = None
    prefill: list[TGIPrefillToken] = Field(default_factory=list)
    tokens: list[TGIToken] = Field(default_factory=list)
    top_tokens: list[list[TGIToken]] = Field(default_factory=list)
    """With `top_n_tokens`: the n most likely tokens at each generated position (left out
    when empty, as TGI)."""


class TGIResponse(WireModel):
    generated_text: str
    details: TGIDetails | None = None


class TGIResponses(RootModel[list[TGIResponse]]):
    """SageMaker TGI containers answer a list with one entry."""


class TGIStreamDetails(WireModel):
    finish_reason: str
    generated_tokens: int
    seed: int | None = None


class TGIStreamResponse(_WithTopTokens):
    index: int
    token: TGIToken
    top_tokens: list[TGIToken] = Field(default_factory=list)
    """With `top_n_tokens`: this token's position's n most likely (left out when empty,
    as TGI)."""
    generated_text: str | None = None
    details: TGIStreamDetails | None = None
