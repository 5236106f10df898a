"""Structural tags (vLLM's `response_format: {"type": "structural_tag", ...}`): free text
in which every `begin ... end` span must hold JSON matching its schema.

Two shapes are accepted, as in vLLM. The OpenAI-style one lists `structures` (begin,
schema, end) and `triggers` (prefixes of the begins that switch the grammar on); the
newer one passes xgrammar's own `format` object through. Both become one canonical
xgrammar structural tag (JSON text), so equal tags share one compiled grammar, and the
engine only ever sees xgrammar's format.

The legacy shape is checked here so that the 400 names the member at fault; a `format`
object is checked for size and JSON-schema keywords only, and otherwise left to
xgrammar, whose refusal comes back naming the field (`StructuredOutputSpec.param`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from handlers.protocol.base import FieldError, OpenAIBaseModel, bad_request_from
from handlers.protocol.json_schema import (
    MAX_PATTERN_CHARS,
    check_depth,
    check_json_schema,
    check_text,
    parse_json_text,
    parse_schema,
    schema_text,
)

MAX_STRUCTURES = 128
"""Structures, and triggers, per tag at most."""


class StructuralTagItem(OpenAIBaseModel):
    """One `begin <JSON matching schema> end` span."""

    begin: str
    json_schema: Any = Field(alias="schema")
    end: str

    @field_validator("begin", "end")
    @classmethod
    def _check_tag(cls, value: str) -> str:
        checked = check_text(value, "tag")
        assert checked is not None
        return checked

    @field_validator("json_schema", mode="before")
    @classmethod
    def _check_schema(cls, value: Any) -> Any:
        if value is None:
            raise FieldError(None, "each structure needs a schema")
        return parse_schema(value)


class StructuralTagFields(OpenAIBaseModel):
    """The members of a structural tag, shared by `response_format` and
    `structured_outputs.structural_tag`."""

    structures: list[StructuralTagItem] | None = Field(default=None, max_length=MAX_STRUCTURES)
    triggers: list[str] | None = Field(default=None, max_length=MAX_STRUCTURES)
    format: dict[str, Any] | None = None
    """xgrammar's structural-tag format object, passed through (vLLM's newer shape)."""

    def check_structural_tag(self) -> None:
        """Raise FieldError (relative to this model) unless the tag is usable."""
        if self.format is not None:
            if self.structures is not None or self.triggers is not None:
                raise FieldError("format", "give either format or structures and triggers")
            if not isinstance(self.format.get("type"), str):
                raise FieldError("format.type", "the format needs a type")
            _check_format_schemas(self.format, "format")
            schema_text(self.canonical())
            return
        if not self.structures:
            raise FieldError("structures", "structural_tag needs a non-empty list of structures")
        if not self.triggers:
            raise FieldError("triggers", "structural_tag needs a non-empty list of triggers")
        begins = [s.begin for s in self.structures]
        for i, trigger in enumerate(self.triggers):
            if not trigger or len(trigger) > MAX_PATTERN_CHARS:
                raise FieldError(("triggers", i), "a trigger must be a non-empty string")
            if not any(begin.startswith(trigger) for begin in begins):
                raise FieldError(
                    ("triggers", i), f"trigger {trigger!r} is not a prefix of any structure's begin"
                )
        for i, begin in enumerate(begins):
            if not any(begin.startswith(trigger) for trigger in self.triggers):
                raise FieldError(
                    ("structures", i, "begin"), f"begin {begin!r} starts with none of the triggers"
                )
        schema_text(self.canonical())

    def canonical(self) -> dict[str, Any]:
        """xgrammar's structural tag for this request (checked first)."""
        if self.format is not None:
            return {"type": "structural_tag", "format": self.format}
        assert self.structures is not None and self.triggers is not None
        tags = [
            {
                "type": "tag",
                "begin": s.begin,
                "content": {"type": "json_schema", "json_schema": s.json_schema},
                "end": s.end,
            }
            for s in self.structures
        ]
        return {
            "type": "structural_tag",
            "format": {"type": "triggered_tags", "triggers": self.triggers, "tags": tags},
        }


class StructuralTag(StructuralTagFields):
    """vLLM's `structured_outputs.structural_tag`: the response_format object as JSON
    text (vLLM's type is `str`); an object is accepted too."""

    type: Literal["structural_tag"] = "structural_tag"

    @model_validator(mode="after")
    def _check(self) -> StructuralTag:
        self.check_structural_tag()
        return self


def parse_structural_tag(value: Any) -> dict[str, Any]:
    """The canonical xgrammar tag of a `structured_outputs.structural_tag` value; raises
    FieldError naming the member at fault in its message."""
    value = parse_json_text(value, "structural_tag") if isinstance(value, str) else value
    check_depth(value, "structural_tag")
    if not isinstance(value, dict):
        raise FieldError(None, "structural_tag must be a JSON object")
    try:
        return StructuralTag.model_validate(value).canonical()
    except ValidationError as exc:
        raise FieldError(None, bad_request_from(exc).message) from None


def _check_format_schemas(node: Any, where: str) -> None:
    """The JSON-schema keyword check for every `json_schema` content of a format."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and "json_schema" in node:
            try:
                check_json_schema(node["json_schema"], f"{where}/json_schema")
            except FieldError as exc:
                raise FieldError("format", exc.message) from None
        for key, value in node.items():
            if isinstance(value, dict | list):
                _check_format_schemas(value, f"{where}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _check_format_schemas(value, f"{where}/{i}")
