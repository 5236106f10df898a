"""Hugging Face TGI's generate API, as SageMaker clients of TGI containers send it to
/invocations: `{"inputs": str, "parameters": {...}, "stream": bool}`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, RootModel, field_validator, model_validator

from engine.sampling_params import StructuredOutputSpec
from handlers.protocol.base import FieldError, OpenAIBaseModel, WireModel, reject_unsupported
from handlers.protocol.json_schema import check_text, parse_schema, schema_text
from handlers.protocol.sampling import INT64_MAX

DEFAULT_MAX_NEW_TOKENS = 100
"""TGI's default when `max_new_tokens` is not given."""


_UNSUPPORTED_TGI_PARAMETERS: Mapping[str, str] = {
    "top_n_tokens": "top_n_tokens is not supported yet",
    "decoder_input_details": "decoder_input_details needs prompt logprobs (not supported yet)",
}
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
    do_sample: bool = False
    details: bool = False
    return_full_text: bool = False
    best_of: int | None = Field(default=None, ge=1, le=1)
    grammar: TGIGrammar | None = None

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        reject_unsupported(data, _UNSUPPORTED_TGI_PARAMETERS)
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        if value is None:
            return []
        if not isinstance(value, list):
            raise FieldError(None, "must be a list of strings")
        if len(value) > 64:
            raise FieldError(None, "at most 64 stop sequences are allowed")
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


class TGIToken(WireModel):
    id: int
    text: str
    logprob: float | None = None
    special: bool = False


class TGIDetails(WireModel):
    finish_reason: str
    """'length', 'eos_token' or 'stop_sequence'."""
    generated_tokens: int
    seed: int | None = None
    prefill: list[TGIToken] = Field(default_factory=list)
    tokens: list[TGIToken] = Field(default_factory=list)


class TGIResponse(WireModel):
    generated_text: str
    details: TGIDetails | None = None


class TGIResponses(RootModel[list[TGIResponse]]):
    """SageMaker TGI containers answer a list with one entry."""


class TGIStreamDetails(WireModel):
    finish_reason: str
    generated_tokens: int
    seed: int | None = None


class TGIStreamResponse(WireModel):
    index: int
    token: TGIToken
    generated_text: str | None = None
    details: TGIStreamDetails | None = None
