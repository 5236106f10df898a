"""Structured-output request fields: OpenAI's `response_format`, vLLM's
`structured_outputs` and its older `guided_*` names, resolved into one engine constraint.

Shape and size are checked here, so the 400 names the field; whether a schema, regex or
grammar compiles is decided by the engine's grammar library (xgrammar), whose refusal
comes back as a 400 naming the same field (`StructuredOutputSpec.param`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from engine.sampling_params import StructuredOutputSpec
from handlers.protocol.base import FieldError, OpenAIBaseModel

MAX_SCHEMA_BYTES = 64 * 1024
"""A JSON schema (or tool parameter schemas together) as compact JSON, at most."""
MAX_PATTERN_CHARS = 16 * 1024
"""A regex or a grammar, at most."""
MAX_CHOICES = 256

UNSUPPORTED_SCHEMA_KEYWORDS = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "dependentSchemas",
        "dependentRequired",
        "dependencies",
        "unevaluatedProperties",
        "unevaluatedItems",
        "contains",
        "minContains",
        "maxContains",
        "propertyNames",
    }
)
"""JSON-schema keywords the grammar cannot enforce; refused rather than ignored."""

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("additionalProperties", "items")


def check_json_schema(schema: Any, where: str = "") -> None:
    """Raise FieldError unless `schema` is an object (or bool) schema without keywords
    the grammar cannot honour; `where` is the path below the field, for the message."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise FieldError(None, f"{where or 'the schema'} must be a JSON object")
    for key in schema:
        if key in UNSUPPORTED_SCHEMA_KEYWORDS:
            raise FieldError(
                None,
                f"JSON schema keyword {key!r} at {where or 'the top level'} is not supported "
                "for structured outputs",
            )
    for key in _SCHEMA_MAPS:
        sub = schema.get(key)
        if isinstance(sub, dict):
            for name, value in sub.items():
                check_json_schema(value, f"{where}/{key}/{name}")
    for key in _SCHEMA_LISTS:
        sub = schema.get(key)
        if isinstance(sub, list):
            for i, value in enumerate(sub):
                check_json_schema(value, f"{where}/{key}/{i}")
    for key in _SCHEMA_VALUES:
        sub = schema.get(key)
        if isinstance(sub, dict | bool):
            check_json_schema(sub, f"{where}/{key}")
        elif isinstance(sub, list):
            for i, value in enumerate(sub):
                check_json_schema(value, f"{where}/{key}/{i}")


def schema_text(schema: Any) -> str:
    """Compact JSON of a schema, within the size cap."""
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise FieldError(None, f"the schema is larger than {MAX_SCHEMA_BYTES} bytes")
    return text


def parse_schema(value: Any) -> Any:
    """A schema given as an object, or (vLLM accepts this) as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise FieldError(None, "the schema is not valid JSON") from None
    check_json_schema(value)
    schema_text(value)
    return value


def check_text(value: str | None, what: str) -> str | None:
    if value is None:
        return None
    if not value:
        raise FieldError(None, f"the {what} must not be empty")
    if len(value) > MAX_PATTERN_CHARS:
        raise FieldError(None, f"the {what} is longer than {MAX_PATTERN_CHARS} characters")
    return value


def _check_choices(value: list[str] | None) -> list[str] | None:
    if value is None:
        return None
    if not value:
        raise FieldError(None, "choice needs at least one string")
    if len(value) > MAX_CHOICES:
        raise FieldError(None, f"at most {MAX_CHOICES} choices are allowed")
    if any(not c for c in value):
        raise FieldError(None, "choices must be non-empty strings")
    return value


class JsonSchemaFormat(OpenAIBaseModel):
    name: str = Field(default="schema", max_length=64)
    description: str | None = None
    json_schema: Any = Field(alias="schema")
    strict: bool | None = None

    @field_validator("json_schema", mode="before")
    @classmethod
    def _check_schema(cls, value: Any) -> Any:
        if value is None:
            raise FieldError(None, "json_schema needs a schema")
        return parse_schema(value)


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_when_needed(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise FieldError("json_schema", "response_format type 'json_schema' needs json_schema")
        return self


class StructuredOutputsParams(OpenAIBaseModel):
    """vLLM's `structured_outputs` object (exactly one constraint)."""

    json_: Any = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    """Accepted: hearth's JSON grammars are always compact (no free whitespace)."""
    structural_tag: Any = None
    whitespace_pattern: str | None = None

    @field_validator("json_", mode="before")
    @classmethod
    def _check_json(cls, value: Any) -> Any:
        return None if value is None else parse_schema(value)

    @field_validator("regex")
    @classmethod
    def _check_regex(cls, value: str | None) -> str | None:
        return check_text(value, "regex")

    @field_validator("grammar")
    @classmethod
    def _check_grammar(cls, value: str | None) -> str | None:
        return check_text(value, "grammar")

    @field_validator("choice")
    @classmethod
    def _check_choice(cls, value: list[str] | None) -> list[str] | None:
        return _check_choices(value)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsParams:
        if self.structural_tag is not None:
            raise FieldError("structural_tag", "structural_tag is not supported")
        if self.whitespace_pattern is not None:
            raise FieldError("whitespace_pattern", "whitespace_pattern is not supported")
        given = [n for n in ("json", "regex", "choice", "grammar") if self.get(n) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise FieldError(
                None,
                "structured_outputs needs exactly one of json, regex, choice, grammar or "
                f"json_object (got {', '.join(given) or 'none'})",
            )
        return self

    def get(self, name: str) -> Any:
        return self.json_ if name == "json" else getattr(self, name)


def _spec(kind: str, value: Any, param: str) -> StructuredOutputSpec:
    if kind == "json":
        text = value if isinstance(value, str) else schema_text(value)
        return StructuredOutputSpec(kind="json", value=text, param=param)
    if kind == "choice":
        return StructuredOutputSpec(kind="choice", value=json.dumps(value), param=param)
    if kind == "json_object":
        return StructuredOutputSpec(kind="json_object", param=param)
    return StructuredOutputSpec(kind=kind, value=value, param=param)


class StructuredOutputFields(OpenAIBaseModel):
    """The request fields that constrain the output; at most one may be set."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("guided_json", mode="before")
    @classmethod
    def _check_guided_json(cls, value: Any) -> Any:
        return None if value is None else parse_schema(value)

    @field_validator("guided_regex")
    @classmethod
    def _check_guided_regex(cls, value: str | None) -> str | None:
        return check_text(value, "regex")

    @field_validator("guided_grammar")
    @classmethod
    def _check_guided_grammar(cls, value: str | None) -> str | None:
        return check_text(value, "grammar")

    @field_validator("guided_choice")
    @classmethod
    def _check_guided_choice(cls, value: list[str] | None) -> list[str] | None:
        return _check_choices(value)

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputFields:
        given = self._constraint_fields()
        if len(given) > 1:
            raise FieldError(
                given[1],
                f"only one output constraint is allowed per request; got {', '.join(given)}",
            )
        return self

    def _constraint_fields(self) -> list[str]:
        given = []
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        if self.structured_outputs is not None:
            given.append("structured_outputs")
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, name) is not None:
                given.append(name)
        return given

    def structured_spec(self) -> StructuredOutputSpec | None:
        """The request's one constraint for the engine, or None."""
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            return _spec("json_object", None, "response_format")
        if rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
            return _spec("json", rf.json_schema.json_schema, "response_format.json_schema.schema")
        so = self.structured_outputs
        if so is not None:
            for name in ("json", "regex", "choice", "grammar"):
                value = so.get(name)
                if value is not None:
                    return _spec(name, value, f"structured_outputs.{name}")
            return _spec("json_object", None, "structured_outputs.json_object")
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                return _spec(name, value, f"guided_{name}")
        return None
