"""Bad input of every kind: the right status, the OpenAI error shape, the field named,
and nothing left running in the engine. The table is `tests/bad_input_cases.py`'s (the
real-server suite runs it too) built for the scripted engine's tiny model, plus the cases
only this side runs."""

from __future__ import annotations

from typing import Any

import falcon.testing
import orjson
import pytest
from handlers_testing import MAX_MODEL_LEN, assert_anthropic_error, assert_openai_error

from engine.tokenizer import Tokenizer
from tests.bad_input_cases import (
    CHAT,
    COMPLETIONS,
    COUNT_TOKENS,
    EMBEDDINGS,
    FUNCTION_TOOL,
    INVOCATIONS,
    MESSAGES,
    RESPONSES,
    TOOL,
    USER,
    Case,
    Target,
    anthropic_cases,
    blocks,
    openai_cases,
    tag,
)

TARGET = Target(model="tiny", max_model_len=MAX_MODEL_LEN, out_of_vocab=100_000)
chat, resp, msgs = TARGET.chat, TARGET.resp, TARGET.msgs

# The shared table, and what only the handlers' own checks show here.
CASES = [
    *openai_cases(TARGET),
    # -- transport ------------------------------------------------------------------------
    # -- messages ------------------------------------------------------------------------
    # -- sampling ranges -------------------------------------------------------------------
    # -- stop ---------------------------------------------------------------------------------
    # -- logit bias, logprobs ------------------------------------------------------------------
    # -- structured outputs ----------------------------------------------------------------
    Case(
        "structural-tag-not-json",
        chat(structured_outputs={"structural_tag": "{nope"}),
        400,
        "structured_outputs.structural_tag",
    ),
    Case(
        "structural-tag-text-missing-end",
        chat(structured_outputs={"structural_tag": orjson.dumps(tag(end=None)).decode()}),
        400,
        "structured_outputs.structural_tag",
    ),
    Case(
        "structural-tag-missing-begin",
        chat(response_format=tag(begin=None)),
        400,
        "response_format.structures[0].begin",
    ),
    Case(
        "structural-tag-empty-end",
        chat(response_format=tag(end="")),
        400,
        "response_format.structures[0].end",
    ),
    Case(
        "structural-tag-schema-missing",
        chat(response_format=tag(schema=None)),
        400,
        "response_format.structures[0].schema",
    ),
    Case(
        "structural-tag-schema-not-object",
        chat(response_format=tag(schema=5)),
        400,
        "response_format.structures[0].schema",
    ),
    Case(
        "structural-tag-schema-unsupported-keyword",
        chat(response_format=tag(schema={"type": "object", "not": {}})),
        400,
        "response_format.structures[0].schema",
    ),
    Case(
        "structural-tag-no-structures",
        chat(response_format={"type": "structural_tag", "triggers": ["<f"]}),
        400,
        "response_format.structures",
    ),
    Case(
        "structural-tag-empty-triggers",
        chat(response_format={**tag(), "triggers": []}),
        400,
        "response_format.triggers",
    ),
    Case(
        "structural-tag-empty-trigger",
        chat(response_format={**tag(), "triggers": [""]}),
        400,
        "response_format.triggers[0]",
    ),
    Case(
        "structural-tag-begin-without-trigger",
        chat(
            response_format={
                **tag(),
                "triggers": ["<func"],
                "structures": [
                    tag()["structures"][0],
                    {"begin": "[call]", "schema": {}, "end": "[/call]"},
                ],
            }
        ),
        400,
        "response_format.structures[1].begin",
    ),
    Case(
        "structural-tag-format-and-structures",
        chat(response_format={**tag(), "format": {"type": "any_text"}}),
        400,
        "response_format.format",
    ),
    Case(
        "structural-tag-format-without-type",
        chat(response_format={"type": "structural_tag", "format": {"tags": []}}),
        400,
        "response_format.format.type",
    ),
    Case(
        "whitespace-pattern-with-regex",
        chat(structured_outputs={"regex": "a+", "whitespace_pattern": ""}),
        400,
        "structured_outputs.whitespace_pattern",
    ),
    Case(
        "guided-whitespace-pattern-unsupported",
        chat(guided_json={"type": "object"}, guided_whitespace_pattern="\\s+"),
        400,
        "guided_whitespace_pattern",
    ),
    Case(
        "guided-whitespace-pattern-with-regex",
        chat(guided_regex="a+", guided_whitespace_pattern=""),
        400,
        "guided_whitespace_pattern",
    ),
    Case(
        "guided-whitespace-pattern-with-structured-outputs",
        chat(structured_outputs={"json": {"type": "object"}}, guided_whitespace_pattern=""),
        400,
        "guided_whitespace_pattern",
    ),
    Case(
        "guided-whitespace-pattern-alone",
        chat(guided_whitespace_pattern=""),
        400,
        "guided_whitespace_pattern",
    ),
    # -- model, routes -----------------------------------------------------------------------
    # -- completions -------------------------------------------------------------------------
    # -- scoring (prompt logprobs) ----------------------------------------------------------
    Case(
        "max-tokens-zero-without-echo",
        {"prompt": "a", "max_tokens": 0},
        400,
        "max_tokens",
        path=COMPLETIONS,
    ),
    Case(
        "prompt-logprobs-string",
        {"prompt": "a", "prompt_logprobs": "1"},
        400,
        "prompt_logprobs",
        path=COMPLETIONS,
    ),
    Case(
        "prompt-logprobs-stream",
        {"prompt": "a", "prompt_logprobs": 1, "stream": True},
        400,
        "prompt_logprobs",
        path=COMPLETIONS,
    ),
    Case("chat-prompt-logprobs-high", chat(prompt_logprobs=21), 400, "prompt_logprobs"),
    # -- tokenize, TGI --------------------------------------------------------------------
    # -- responses ------------------------------------------------------------------------
    Case("responses-input-empty-list", resp(input=[]), 400, "input", path=RESPONSES),
    Case("responses-input-number", resp(input=5), 400, "input", path=RESPONSES),
    Case("responses-item-not-object", resp(input=["hi"]), 400, "input[0]", path=RESPONSES),
    Case(
        "responses-item-role",
        resp(input=[{"role": "robot", "content": "x"}]),
        400,
        "input[0].role",
        path=RESPONSES,
    ),
    Case(
        "responses-part-without-text",
        resp(input=[{"role": "user", "content": [{"type": "input_text"}]}]),
        400,
        "input[0].content[0].text",
        path=RESPONSES,
    ),
    Case(
        "responses-output-without-output",
        resp(input=[{"type": "function_call_output", "call_id": "c"}]),
        400,
        "input[0].output",
        path=RESPONSES,
    ),
    Case(
        "responses-tool-name",
        resp(tools=[{"type": "function", "name": "bad name"}]),
        400,
        "tools[0].name",
        path=RESPONSES,
    ),
    Case(
        "responses-tool-twice",
        resp(tools=[FUNCTION_TOOL, FUNCTION_TOOL]),
        400,
        "tools[1].name",
        path=RESPONSES,
    ),
    Case(
        "responses-tool-choice-no-tools",
        resp(tool_choice="required"),
        400,
        "tool_choice",
        path=RESPONSES,
    ),
    Case(
        "responses-tool-choice-hosted",
        resp(tools=[FUNCTION_TOOL], tool_choice={"type": "web_search"}),
        400,
        "tool_choice.type",
        path=RESPONSES,
    ),
    Case(
        "responses-format-type",
        resp(text={"format": {"type": "xml"}}),
        400,
        "text.format.type",
        path=RESPONSES,
    ),
    Case(
        "responses-forced-call-and-format",
        resp(
            tools=[FUNCTION_TOOL], tool_choice="required", text={"format": {"type": "json_object"}}
        ),
        400,
        "tool_choice",
        path=RESPONSES,
    ),
    Case(
        "responses-max-output-tokens-zero",
        resp(max_output_tokens=0),
        400,
        "max_output_tokens",
        path=RESPONSES,
    ),
    Case("responses-top-p", resp(top_p=0), 400, "top_p", path=RESPONSES),
    Case(
        "responses-effort",
        resp(reasoning={"effort": "max"}),
        400,
        "reasoning.effort",
        path=RESPONSES,
    ),
    Case("responses-stream-string", resp(stream="yes"), 400, "stream", path=RESPONSES),
    Case("responses-truncation-auto", resp(truncation="auto"), 400, "truncation", path=RESPONSES),
    Case("responses-list-method", None, 405, None, path=RESPONSES, method="GET"),
    Case("invocations-responses-input", {"input": 5}, 400, "input", path=INVOCATIONS),
    # -- embeddings --------------------------------------------------------------------------
    Case("embed-input-object", {"input": {"text": "a"}}, 400, "input", path=EMBEDDINGS),
    Case("embed-input-negative-id", {"input": [1, -1]}, 400, "input", path=EMBEDDINGS),
    Case("embed-input-bool-id", {"input": [1, True]}, 400, "input", path=EMBEDDINGS),
    Case("embed-input-empty-inner", {"input": [[1], []]}, 400, "input[1]", path=EMBEDDINGS),
    Case("embed-input-float-ids", {"input": [[1.5]]}, 400, "input[0]", path=EMBEDDINGS),
    Case(
        "embed-too-long", {"input": "word " * (MAX_MODEL_LEN + 10)}, 400, "input", path=EMBEDDINGS
    ),
    Case(
        "embed-dimensions-string",
        {"input": "a", "dimensions": "8"},
        400,
        "dimensions",
        path=EMBEDDINGS,
    ),
    Case(
        "embed-truncate-prompt-tokens-past-context",
        {"input": "a", "truncate_prompt_tokens": 100_000},
        400,
        "truncate_prompt_tokens",
        path=EMBEDDINGS,
    ),
    Case("embed-body-array", ["a"], 400, None, path=EMBEDDINGS),
    Case(
        "invocations-embed-bad-input",
        {"task": "embeddings", "input": []},
        400,
        "input",
        path=INVOCATIONS,
    ),
]


ANTHROPIC_CASES = [
    *anthropic_cases(TARGET),
    Case(
        "a-content-number",
        msgs(messages=[{"role": "user", "content": 5}]),
        400,
        None,
        path=MESSAGES,
    ),
    Case("a-unknown-block", msgs(messages=blocks({"type": "nope"})), 400, None, path=MESSAGES),
    Case(
        "a-tool-result-in-assistant",
        msgs(
            messages=[*USER, *blocks({"type": "tool_result", "tool_use_id": "t"}, role="assistant")]
        ),
        400,
        None,
        path=MESSAGES,
    ),
    Case(
        "a-tool-result-without-id",
        msgs(messages=blocks({"type": "tool_result", "content": "x"})),
        400,
        None,
        path=MESSAGES,
    ),
    Case(
        "a-tool-result-image",
        msgs(
            messages=blocks(
                {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}
            )
        ),
        400,
        None,
        path=MESSAGES,
    ),
    Case("a-system-number", msgs(system=5), 400, None, path=MESSAGES),
    Case("a-temperature-string", msgs(temperature="0.5"), 400, None, path=MESSAGES),
    Case("a-top-p-zero", msgs(top_p=0), 400, None, path=MESSAGES),
    Case(
        "a-stop-sequences-5000",
        msgs(stop_sequences=[f"s{i}" for i in range(5000)]),
        400,
        None,
        path=MESSAGES,
    ),
    Case("a-stop-sequences-string", msgs(stop_sequences="x"), 400, None, path=MESSAGES),
    Case("a-tool-name-bad", msgs(tools=[{**TOOL, "name": "a b"}]), 400, None, path=MESSAGES),
    Case("a-tool-schema-missing", msgs(tools=[{"name": "f"}]), 400, None, path=MESSAGES),
    Case(
        "a-tool-schema-unsupported-keyword",
        msgs(tools=[{**TOOL, "input_schema": {"type": "object", "not": {}}}]),
        400,
        None,
        path=MESSAGES,
    ),
    Case(
        "a-tool-choice-tool-without-name",
        msgs(tools=[TOOL], tool_choice={"type": "tool"}),
        400,
        None,
        path=MESSAGES,
    ),
    Case(
        "a-tool-choice-openai-string",
        msgs(tools=[TOOL], tool_choice="auto"),
        400,
        None,
        path=MESSAGES,
    ),
    Case("a-thinking-without-budget", msgs(thinking={"type": "enabled"}), 400, None, path=MESSAGES),
    Case(
        "a-thinking-budget-low",
        msgs(max_tokens=200, thinking={"type": "enabled", "budget_tokens": 10}),
        400,
        None,
        path=MESSAGES,
    ),
    Case("a-thinking-type", msgs(thinking={"type": "sometimes"}), 400, None, path=MESSAGES),
    Case(
        "a-count-messages-empty",
        {"model": TARGET.model, "messages": []},
        400,
        None,
        path=COUNT_TOKENS,
    ),
    Case("a-count-wrong-method", None, 405, None, path=COUNT_TOKENS, method="GET"),
    Case(
        "a-invocations-bad-block",
        {"system": "s", "max_tokens": 8, "messages": blocks({"type": "image"})},
        400,
        None,
        path=INVOCATIONS,
    ),
]


def send(client: falcon.testing.TestClient, case: Case) -> falcon.testing.Result:
    headers = dict(case.headers)
    if isinstance(case.body, bytes):
        body = case.body
    else:
        body = orjson.dumps(case.body)
    headers.setdefault("content-type", "application/json")
    return client.simulate_request(case.method, case.path, body=body, headers=headers)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(client, engine, case: Case) -> None:
    result = send(client, case)
    assert_openai_error(result, case.status, case.param)
    assert engine.added == [], "refused before admission"
    assert engine.live == set()


@pytest.mark.parametrize("case", ANTHROPIC_CASES, ids=[c.id for c in ANTHROPIC_CASES])
def test_bad_input_anthropic(client, engine, case: Case) -> None:
    result = send(client, case)
    assert_anthropic_error(result, case.status)
    assert engine.added == [], "refused before admission"
    assert engine.live == set()


def test_matrix_is_broad() -> None:
    assert len(CASES) >= 50
    assert len({c.id for c in CASES + ANTHROPIC_CASES}) == len(CASES) + len(ANTHROPIC_CASES)


def test_one_engine_survives_the_whole_matrix(client, engine, tokenizer: Tokenizer) -> None:
    for case in CASES + ANTHROPIC_CASES:
        send(client, case)
    assert engine.live == set() and engine.num_in_flight == 0
    # ... and still serves.
    result = client.simulate_post(CHAT, json=chat())
    assert result.status_code == 200
    assert engine.live == set()


def test_unknown_fields_are_ignored(client) -> None:
    result = client.simulate_post(
        CHAT, json=chat(some_vendor_extra={"x": 1}, reasoning_effort="low")
    )
    assert result.status_code == 200


def _vocabulary_edge_bodies(token_id: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(path, field, body) naming `token_id` in every place a request can name a token."""
    return [
        (CHAT, "stop_token_ids", chat(stop_token_ids=[token_id])),
        (CHAT, "logit_bias", chat(logit_bias={str(token_id): 1.0})),
        (COMPLETIONS, "prompt", {"prompt": [1, token_id], "max_tokens": 2}),
        (COMPLETIONS, "prompt[1]", {"prompt": [[1], [token_id]], "max_tokens": 2}),
        (EMBEDDINGS, "input", {"input": [1, token_id]}),
        (EMBEDDINGS, "input[1]", {"input": [[1], [token_id]]}),
    ]


def test_a_token_id_equal_to_the_vocabulary_size_is_refused(client, engine) -> None:
    """Ids run from 0 to vocab_size - 1: the first id past the end is the off-by-one a
    `<=` in the vocabulary check would let through (the engine would index out of its
    embedding), so it is tried exactly, next to the last valid id."""
    vocab_size = engine.info.vocab_size
    for path, field, body in _vocabulary_edge_bodies(vocab_size):
        error = assert_openai_error(client.simulate_post(path, json=body), 400, field)
        assert str(vocab_size) in error["message"]
    assert engine.added == []
    for path, _, body in _vocabulary_edge_bodies(vocab_size - 1):
        assert client.simulate_post(path, json=body).status_code == 200, body
