"""Issue 17 (hardening II) on the handler side: schemas given as text meet the same caps
as schemas given as objects (item 1), prompts too long to fit are refused before they are
tokenized (2), message and content-part counts are capped (3). Production app, scripted
engine; the engine-side compile queue is tested in tests/engine/test_structured_isolation.py."""

from __future__ import annotations

import json

import pytest
from handlers_testing import assert_openai_error

USER = [{"role": "user", "content": "Hello"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def nested_items(levels: int) -> str:
    """`levels` nested array schemas, as text (json.dumps would recurse)."""
    return '{"type":"array","items":' * levels + '{"type":"string"}' + "}" * levels


# -- item 1: schemas as text ----------------------------------------------------------
TEXT_SCHEMA_FIELDS = [
    (CHAT, lambda s: {"messages": USER, "guided_json": s}, "guided_json"),
    (COMPLETIONS, lambda s: {"prompt": "hi", "guided_json": s}, "guided_json"),
    (CHAT, lambda s: {"messages": USER, "structured_outputs": {"json": s}}, "structured_outputs"),
    (
        "/invocations",
        lambda s: {"inputs": "hi", "parameters": {"grammar": {"type": "json", "value": s}}},
        "parameters.grammar.value",
    ),
    (
        CHAT,
        lambda s: {
            "messages": USER,
            "structured_outputs": {
                "structural_tag": json.dumps(
                    {
                        "type": "structural_tag",
                        "structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}],
                        "triggers": ["<a>"],
                    }
                ).replace("{}", s)
            },
        },
        "structured_outputs",
    ),
]


@pytest.mark.parametrize("levels", [900, 1500, 5000])
@pytest.mark.parametrize(("path", "body", "param"), TEXT_SCHEMA_FIELDS)
def test_a_deeply_nested_schema_as_text_is_a_400(client, engine, path, body, param, levels) -> None:
    """A schema inside a string skipped the body's 64-level cap: 900 nested `items` took
    xgrammar ~37 s to compile, and ~1,500 levels were a 500 (RecursionError)."""
    text = nested_items(levels)
    error = assert_openai_error(client.simulate_post(path, json=body(text)), 400)
    assert error["param"] is not None and error["param"].startswith(param.split(".")[0])
    assert "64 levels" in error["message"] or "larger than" in error["message"]
    assert engine.added == []


@pytest.mark.parametrize(("path", "body", "param"), TEXT_SCHEMA_FIELDS[:4])
def test_a_schema_as_text_within_the_caps_is_served(client, engine, path, body, param) -> None:
    result = client.simulate_post(path, json=body(nested_items(40)))
    assert result.status_code == 200, result.text
    assert engine.added[0].params.structured is not None


def test_a_schema_text_over_the_size_cap_is_refused_before_parsing(client, engine) -> None:
    text = " " * (64 * 1024) + "{}"
    error = assert_openai_error(
        client.simulate_post(CHAT, json={"messages": USER, "guided_json": text}), 400, "guided_json"
    )
    assert "larger than" in error["message"]
