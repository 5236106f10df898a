"""Structured-output request fields: OpenAI's `response_format`, vLLM's
`structured_outputs` and its older `guided_*` names, resolved into one engine constraint.

Shape and size are checked here, so the 400 names the field; whether a schema, regex or
grammar compiles is decided by the engine's grammar library (xgrammar), whose refusal
comes back as a 400 naming the same field (`StructuredOutputSpec.param`). Structural
tags have their own module (`structural_tag.py`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, field_validator, model_validator

from engine.sampling_params import StructuredOutputSpec
from handlers.protocol.base import FieldError, OpenAIBaseModel
from handlers.protocol.json_schema import check_text, parse_schema, schema_text
from handlers.protocol.structural_tag import StructuralTagFields, parse_structural_tag

MAX_CHOICES = 256

NO_WHITESPACE_SEPARATORS = (",", ":")
WHITESPACE_PATTERNS: dict[str, tuple[bool, tuple[str, str] | None]] = {
    "": (False, NO_WHITESPACE_SEPARATORS),
    "[ ]?": (False, None),
    " ?": (False, None),
    r"\s*": (True, None),
    r"[ \t\n\r]*": (True, None),
}
"""The `whitespace_pattern`s xgrammar can honour, as (any_whitespace, separators).

xgrammar lays JSON out from options, not from a regex: no whitespace at all (separators
`,` and `:`); its one-line default (one space after `,` and `:`, nothing elsewhere),
which every output of outlines' default `[ ]?` also matches; or any JSON whitespace.
Any other pattern is refused rather than silently not enforced."""


def _check_whitespace_pattern(value: str | None) -> str | None:
    if value is not None and value not in WHITESPACE_PATTERNS:
        raise FieldError(
            None,
            f"whitespace pattern {value!r} cannot be enforced: the grammar library "
            '(xgrammar) lays JSON out from options, not from a regex. Use "" (no '
            "whitespace), \"[ ]?\" (one space after ',' and ':', the default when unset) "
            'or "\\\\s*" (any JSON whitespace)',
        )
    return value


def whitespace_pattern(any_whitespace: bool, separators: tuple[str, str] | None) -> str | None:
    """The first of `WHITESPACE_PATTERNS` that gives a JSON constraint this layout back
    (None: the default layout, which needs none)."""
    layout = (any_whitespace, tuple(separators) if separators is not None else None)
    if layout == (False, None):
        return None
    for pattern, gives in WHITESPACE_PATTERNS.items():
        if gives == layout:
            return pattern
    raise ValueError(f"no whitespace_pattern gives the layout {layout!r}")


def _json_layout(pattern: str | None) -> dict[str, Any]:
    """any_whitespace and separators of a JSON constraint (defaults when unset)."""
    if pattern is None:
        return {}
    any_whitespace, separators = WHITESPACE_PATTERNS[pattern]
    return {"any_whitespace": any_whitespace, "separators": separators}


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


SchemaField = Annotated[Any, BeforeValidator(lambda v: None if v is None else parse_schema(v))]
"""A JSON schema, as an object or (vLLM accepts this) as JSON text."""
RegexField = Annotated[str | None, AfterValidator(lambda v: check_text(v, "regex"))]
GrammarField = Annotated[str | None, AfterValidator(lambda v: check_text(v, "grammar"))]
ChoicesField = Annotated[list[str] | None, AfterValidator(_check_choices)]
WhitespacePatternField = Annotated[str | None, AfterValidator(_check_whitespace_pattern)]
"""The checked types of the constraint fields `structured_outputs` and the top-level
`guided_*` names share, so each rule is written once for both spellings."""


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


class ResponseFormat(StructuralTagFields):
    """OpenAI's response_format, plus vLLM's `structural_tag` type (whose members,
    `structures` and `triggers` or `format`, sit beside `type`)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_when_needed(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise FieldError("json_schema", "response_format type 'json_schema' needs json_schema")
        if self.type == "structural_tag":
            self.check_structural_tag()
        return self


class StructuredOutputsParams(OpenAIBaseModel):
    """vLLM's `structured_outputs` object (exactly one constraint)."""

    json_: SchemaField = Field(default=None, alias="json")
    regex: RegexField = None
    choice: ChoicesField = None
    grammar: GrammarField = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    """Accepted: hearth's JSON grammars are compact unless `whitespace_pattern` says otherwise."""
    structural_tag: Any = None
    """vLLM's type is a JSON string of the response_format object; an object is accepted
    too. Held as xgrammar's canonical tag once validated."""
    whitespace_pattern: WhitespacePatternField = None
    """JSON only, and only the patterns of WHITESPACE_PATTERNS."""

    @field_validator("structural_tag", mode="before")
    @classmethod
    def _check_structural_tag(cls, value: Any) -> Any:
        return None if value is None else parse_structural_tag(value)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsParams:
        given = [n for n in CONSTRAINT_NAMES if self.get(n) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise FieldError(
                None,
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"structural_tag or json_object (got {', '.join(given) or 'none'})",
            )
        if self.whitespace_pattern is not None and given[0] not in ("json", "json_object"):
            raise FieldError(
                "whitespace_pattern", "whitespace_pattern applies only to json and json_object"
            )
        return self

    def json_layout(self) -> dict[str, Any]:
        return _json_layout(self.whitespace_pattern)

    def get(self, name: str) -> Any:
        return self.json_ if name == "json" else getattr(self, name)


CONSTRAINT_NAMES = ("json", "regex", "choice", "grammar", "structural_tag")
"""The members of `structured_outputs` that carry a constraint (besides json_object)."""


def _spec(kind: str, value: Any, param: str, **layout: Any) -> StructuredOutputSpec:
    if kind == "json":
        text = value if isinstance(value, str) else schema_text(value)
        return StructuredOutputSpec(kind="json", value=text, param=param, **layout)
    if kind == "choice":
        return StructuredOutputSpec(kind="choice", value=json.dumps(value), param=param)
    if kind == "json_object":
        return StructuredOutputSpec(kind="json_object", param=param, **layout)
    if kind == "structural_tag":
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        return StructuredOutputSpec(kind="structural_tag", value=text, param=param)
    return StructuredOutputSpec(kind=kind, value=value, param=param)


class StructuredOutputFields(OpenAIBaseModel):
    """The request fields that constrain the output; at most one may be set."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: SchemaField = None
    guided_regex: RegexField = None
    guided_choice: ChoicesField = None
    guided_grammar: GrammarField = None
    guided_whitespace_pattern: WhitespacePatternField = None
    """vLLM's older spelling of `structured_outputs.whitespace_pattern`: the layout of a
    JSON constraint given by `guided_json` or `response_format`."""

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputFields:
        given = self._constraint_fields()
        if len(given) > 1:
            raise FieldError(
                given[1],
                f"only one output constraint is allowed per request; got {', '.join(given)}",
            )
        if self.guided_whitespace_pattern is not None and not self._json_constraint_given():
            raise FieldError(
                "guided_whitespace_pattern",
                "guided_whitespace_pattern applies only to a JSON constraint (guided_json, "
                "or response_format json_schema / json_object); with structured_outputs, "
                "set structured_outputs.whitespace_pattern",
            )
        return self

    def _json_constraint_given(self) -> bool:
        rf = self.response_format
        return self.guided_json is not None or (
            rf is not None and rf.type in ("json_schema", "json_object")
        )

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
        layout = _json_layout(self.guided_whitespace_pattern)
        if rf is not None and rf.type == "json_object":
            return _spec("json_object", None, "response_format", **layout)
        if rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
            schema = rf.json_schema.json_schema
            return _spec("json", schema, "response_format.json_schema.schema", **layout)
        if rf is not None and rf.type == "structural_tag":
            return _spec("structural_tag", rf.canonical(), "response_format")
        so = self.structured_outputs
        if so is not None:
            for name in CONSTRAINT_NAMES:
                value = so.get(name)
                if value is not None:
                    return _spec(name, value, f"structured_outputs.{name}", **so.json_layout())
            return _spec("json_object", None, "structured_outputs.json_object", **so.json_layout())
        if self.guided_json is not None:
            return _spec("json", self.guided_json, "guided_json", **layout)
        for name in ("regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                return _spec(name, value, f"guided_{name}")
        return None
