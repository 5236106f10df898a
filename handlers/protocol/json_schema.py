"""JSON-schema checks shared by every field that takes a schema (structured outputs,
structural tags, tool parameters, TGI grammars): shape, refused keywords, size caps.

Whether a schema compiles is the grammar library's call (in the engine); what is checked
here is what the 400 can name precisely before anything reaches the engine.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from handlers.protocol.base import FieldError

MAX_SCHEMA_BYTES = 64 * 1024
"""A JSON schema (or tool parameter schemas together) as compact JSON, at most."""
MAX_PATTERN_CHARS = 16 * 1024
"""A regex or a grammar, at most."""
MAX_JSON_DEPTH = 64
"""Nesting of a request body, and of a schema or tag however it is given (an object in
the body, or JSON text inside a string). Text schemas once skipped the body's cap: 900
nested `items` (22.5 KB) took xgrammar ~37 s to compile; 64 levels take ~0.05 s."""

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


def depth_exceeds(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether `value` nests deeper than `limit` (a schema: at most 64 KB, so small)."""
    return json_shape(value, limit, None)[0] > limit


def json_shape(value: Any, depth_limit: int, container_limit: int | None) -> tuple[int, int]:
    """(depth, containers) of a decoded JSON value, each counted only until it passes its
    limit (the walk stops there). Level by level over the containers alone, with exact
    type checks (orjson only makes plain dicts and lists): the tuple-stack walk this
    replaces took 2.0 s over a 6 MB body of 2,000,000 empty objects, this one 0.2 s,
    and the container budget stops it after the first `container_limit` of them."""
    if type(value) is not dict and type(value) is not list:
        return 0, 0
    level: list[Any] = [value]
    depth = containers = 0
    while level:
        depth += 1
        containers += len(level)
        if depth > depth_limit or (container_limit is not None and containers > container_limit):
            break
        below: list[Any] = []
        for item in level:
            for child in item.values() if type(item) is dict else item:
                kind = type(child)
                if kind is dict or kind is list:
                    below.append(child)
        level = below
    return depth, containers


def check_depth(value: Any, what: str = "the schema") -> None:
    if depth_exceeds(value):
        raise FieldError(None, f"{what} nests deeper than {MAX_JSON_DEPTH} levels")


def parse_json_text(text: str, what: str = "the schema") -> Any:
    """JSON given as text inside a request: the size cap before parsing (orjson, which
    never recurses past 1024 levels), then the depth cap of request bodies."""
    if len(text) > MAX_SCHEMA_BYTES or len(text.encode()) > MAX_SCHEMA_BYTES:
        raise FieldError(None, f"{what} is larger than {MAX_SCHEMA_BYTES} bytes")
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        if "depth" in str(exc) or "recursion" in str(exc).lower():
            raise FieldError(None, f"{what} nests deeper than {MAX_JSON_DEPTH} levels") from None
        raise FieldError(None, f"{what} is not valid JSON") from None
    check_depth(value, what)
    return value


def schema_text(schema: Any) -> str:
    """Compact JSON of a schema, within the size cap."""
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise FieldError(None, f"the schema is larger than {MAX_SCHEMA_BYTES} bytes")
    return text


def parse_schema(value: Any) -> Any:
    """A schema given as an object, or (vLLM accepts this) as JSON text."""
    if isinstance(value, str):
        value = parse_json_text(value)
    else:
        check_depth(value)
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
