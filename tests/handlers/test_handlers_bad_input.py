"""Bad input of every kind: the right status, the OpenAI error shape, the field named,
and nothing left running in the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import falcon.testing
import orjson
import pytest
from handlers_testing import assert_openai_error

from engine.tokenizer import Tokenizer

USER = [{"role": "user", "content": "Hello"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"


@dataclass(frozen=True)
class Case:
    id: str
    body: Any
    status: int
    param: str | None
    path: str = CHAT
    method: str = "POST"
    headers: tuple[tuple[str, str], ...] = ()


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": USER, **fields}


def resp(**fields: Any) -> dict[str, Any]:
    return {"input": "Hello", **fields}


FUNCTION_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}


def tag(**item: Any) -> dict[str, Any]:
    """A structural-tag response_format; `item` overrides (None drops) structure keys."""
    structure = {"begin": "<function=f>", "schema": {"type": "object"}, "end": "</function>"}
    structure.update(item)
    structure = {k: v for k, v in structure.items() if v is not None}
    return {"type": "structural_tag", "structures": [structure], "triggers": ["<function="]}


def nested(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


CASES = [
    # -- transport ------------------------------------------------------------------------
    Case("invalid-json", b'{"messages": [', 400, None),
    Case("non-utf8", b'{"messages": "\xff\xfe"}', 400, None),
    Case("wrong-content-type", b"{}", 415, None, headers=(("content-type", "text/plain"),)),
    Case(
        "form-content-type",
        b"a=b",
        415,
        None,
        headers=(("content-type", "application/x-www-form-urlencoded"),),
    ),
    Case("empty-body", b"", 400, None),
    Case("whitespace-body", b"  \n ", 400, None),
    Case("nested-10k", b"[" * 10_000 + b"]" * 10_000, 400, None),
    Case("nested-500-in-field", nested(500), 400, None),
    Case("body-array", [1, 2], 400, None),
    Case("body-string", "hello", 400, None),
    Case("body-null", None, 400, None),
    Case("huge-int", b'{"messages": [], "n": 123456789012345678901234567890}', 400, "n"),
    # -- messages ------------------------------------------------------------------------
    Case("messages-missing", {}, 400, "messages"),
    Case("messages-empty", chat(messages=[]), 400, "messages"),
    Case("messages-not-list", chat(messages="hi"), 400, "messages"),
    Case("message-not-object", chat(messages=["hi"]), 400, "messages[0]"),
    Case(
        "unknown-role", chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role"
    ),
    Case("role-missing", chat(messages=[{"content": "x"}]), 400, "messages[0].role"),
    Case(
        "content-number",
        chat(messages=[{"role": "user", "content": 5}]),
        400,
        "messages[0].content",
    ),
    Case("content-missing", chat(messages=[{"role": "user"}]), 400, "messages[0].content"),
    Case(
        "image-part",
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "messages[0].content[0].type",
    ),
    Case(
        "part-without-text",
        chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        400,
        "messages[0].content[0].text",
    ),
    Case(
        "tool-without-id",
        chat(messages=[*USER, {"role": "tool", "content": "42"}]),
        400,
        "messages[1].tool_call_id",
    ),
    Case(
        "too-long-prompt",
        chat(messages=[{"role": "user", "content": "word " * 400}]),
        400,
        "messages",
    ),
    # -- sampling ranges -------------------------------------------------------------------
    Case("temperature-negative", chat(temperature=-0.1), 400, "temperature"),
    Case("temperature-high", chat(temperature=2.5), 400, "temperature"),
    Case("temperature-string", chat(temperature="0.5"), 400, "temperature"),
    Case("top-p-zero", chat(top_p=0), 400, "top_p"),
    Case("top-p-high", chat(top_p=1.5), 400, "top_p"),
    Case("top-k-low", chat(top_k=-2), 400, "top_k"),
    Case("min-p-high", chat(min_p=1.5), 400, "min_p"),
    Case("presence-high", chat(presence_penalty=3), 400, "presence_penalty"),
    Case("frequency-low", chat(frequency_penalty=-3), 400, "frequency_penalty"),
    Case("repetition-zero", chat(repetition_penalty=0), 400, "repetition_penalty"),
    Case("repetition-high", chat(repetition_penalty=2.5), 400, "repetition_penalty"),
    Case("n-zero", chat(n=0), 400, "n"),
    Case("n-over-max", chat(n=17), 400, "n"),
    Case("n-bool", chat(n=True), 400, "n"),
    Case("seed-negative", chat(seed=-1), 400, "seed"),
    Case("seed-over-int64", chat(seed=2**63), 400, "seed"),
    Case("min-tokens-negative", chat(min_tokens=-1), 400, "min_tokens"),
    Case("min-tokens-over-max", chat(min_tokens=10, max_tokens=5), 400, "min_tokens"),
    Case("max-tokens-zero", chat(max_tokens=0), 400, "max_tokens"),
    Case("max-tokens-over-context", chat(max_tokens=250), 400, "max_tokens"),
    Case(
        "max-completion-over-context",
        chat(max_completion_tokens=10_000),
        400,
        "max_completion_tokens",
    ),
    Case("max-tokens-float", chat(max_tokens=1.5), 400, "max_tokens"),
    Case("stream-string", chat(stream="yes"), 400, "stream"),
    Case(
        "stream-options-without-stream",
        chat(stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
    Case("model-number", chat(model=5), 400, "model"),
    Case("priority-string", chat(priority="high"), 400, "priority"),
    # -- stop ---------------------------------------------------------------------------------
    Case("stop-empty", chat(stop=""), 400, "stop[0]"),
    Case("stop-empty-in-list", chat(stop=["a", ""]), 400, "stop[1]"),
    Case("stop-5000", chat(stop=[f"s{i}" for i in range(5000)]), 400, "stop"),
    Case("stop-number", chat(stop=5), 400, "stop"),
    Case("stop-list-of-numbers", chat(stop=[5]), 400, "stop[0]"),
    Case("stop-token-ids-out-of-vocab", chat(stop_token_ids=[100_000]), 400, "stop_token_ids"),
    Case("stop-token-ids-negative", chat(stop_token_ids=[-1]), 400, "stop_token_ids"),
    # -- logit bias, logprobs ------------------------------------------------------------------
    Case("logit-bias-key-text", chat(logit_bias={"hello": 1}), 400, "logit_bias"),
    Case("logit-bias-key-out-of-vocab", chat(logit_bias={"100000": 1}), 400, "logit_bias"),
    Case("logit-bias-value-high", chat(logit_bias={"5": 101}), 400, "logit_bias"),
    Case("top-logprobs-over-max", chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    Case("top-logprobs-without-logprobs", chat(top_logprobs=2), 400, "top_logprobs"),
    Case("top-logprobs-negative", chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs"),
    # -- unsupported features ---------------------------------------------------------------
    # -- structured outputs ----------------------------------------------------------------
    Case(
        "json-schema-missing",
        chat(response_format={"type": "json_schema", "json_schema": {}}),
        400,
        "response_format.json_schema.schema",
    ),
    Case(
        "json-schema-not-object",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": 5}}),
        400,
        "response_format.json_schema.schema",
    ),
    Case(
        "json-schema-unsupported-keyword",
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": {"type": "object", "not": {}}},
            }
        ),
        400,
        "response_format.json_schema.schema",
    ),
    Case(
        "json-schema-too-large",
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": {"description": "x" * 70_000}},
            }
        ),
        400,
        "response_format.json_schema.schema",
    ),
    Case("response-format-xml", chat(response_format={"type": "xml"}), 400, "response_format.type"),
    Case(
        "two-constraints",
        chat(guided_regex="a+", response_format={"type": "json_object"}),
        400,
        "guided_regex",
    ),
    Case(
        "structured-outputs-two-kinds",
        chat(structured_outputs={"regex": "a", "choice": ["b"]}),
        400,
        "structured_outputs",
    ),
    Case("choice-empty", chat(structured_outputs={"choice": []}), 400, "structured_outputs.choice"),
    Case("guided-json-bad-text", chat(guided_json="{nope"), 400, "guided_json"),
    Case(
        "structural-tag",
        chat(structured_outputs={"structural_tag": {"a": 1}}),
        400,
        "structured_outputs.structural_tag",
    ),
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
        "structural-tag-missing-end",
        chat(response_format=tag(end=None)),
        400,
        "response_format.structures[0].end",
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
        "structural-tag-trigger-not-a-prefix",
        chat(response_format={**tag(), "triggers": ["<function=", "<tool>"]}),
        400,
        "response_format.triggers[1]",
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
        "whitespace-pattern-unsupported",
        chat(structured_outputs={"json": {"type": "object"}, "whitespace_pattern": "[ \\n]{0,4}"}),
        400,
        "structured_outputs.whitespace_pattern",
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
    Case("tool-choice-auto", chat(tool_choice="auto"), 400, "tool_choice"),
    Case("tool-choice-required", chat(tool_choice="required"), 400, "tool_choice"),
    Case(
        "tool-choice-named",
        chat(tool_choice={"type": "function", "function": {"name": "f"}}),
        400,
        "tool_choice",
    ),
    Case("beam-search", chat(use_beam_search=True), 400, "use_beam_search"),
    Case("untrusted-template", chat(chat_template="{{ messages }}"), 400, "chat_template"),
    Case(
        "untrusted-template-kwarg",
        chat(chat_template_kwargs={"chat_template": "x"}),
        400,
        "chat_template",
    ),
    Case(
        "continue-and-generation-prompt",
        chat(continue_final_message=True),
        400,
        "continue_final_message",
    ),
    # -- model, routes -----------------------------------------------------------------------
    Case("unknown-model", chat(model="gpt-4o"), 404, "model"),
    Case("unknown-route", chat(), 404, None, path="/v1/embeddings"),
    Case("wrong-method", None, 405, None, path=CHAT, method="GET"),
    Case("wrong-method-models", chat(), 405, None, path="/v1/models"),
    # -- completions -------------------------------------------------------------------------
    Case("prompt-missing", {"max_tokens": 5}, 400, "prompt", path=COMPLETIONS),
    Case("prompt-empty-list", {"prompt": []}, 400, "prompt", path=COMPLETIONS),
    Case("prompt-empty-string", {"prompt": ""}, 400, "prompt", path=COMPLETIONS),
    Case("prompt-ids-out-of-vocab", {"prompt": [1, 100_000]}, 400, "prompt", path=COMPLETIONS),
    Case("prompt-ids-negative", {"prompt": [1, -5]}, 400, "prompt", path=COMPLETIONS),
    Case(
        "prompt-lists-out-of-vocab",
        {"prompt": [[1], [100_000]]},
        400,
        "prompt[1]",
        path=COMPLETIONS,
    ),
    Case("prompt-mixed", {"prompt": ["a", 1]}, 400, "prompt", path=COMPLETIONS),
    Case("prompt-number", {"prompt": 5}, 400, "prompt", path=COMPLETIONS),
    Case("suffix", {"prompt": "a", "suffix": "b"}, 400, "suffix", path=COMPLETIONS),
    Case("best-of", {"prompt": "a", "best_of": 2}, 400, "best_of", path=COMPLETIONS),
    Case(
        "completion-logprobs-high",
        {"prompt": "a", "logprobs": 21},
        400,
        "logprobs",
        path=COMPLETIONS,
    ),
    # -- scoring (prompt logprobs) ----------------------------------------------------------
    Case(
        "max-tokens-zero-without-echo",
        {"prompt": "a", "max_tokens": 0},
        400,
        "max_tokens",
        path=COMPLETIONS,
    ),
    Case(
        "prompt-logprobs-negative",
        {"prompt": "a", "prompt_logprobs": -1},
        400,
        "prompt_logprobs",
        path=COMPLETIONS,
    ),
    Case(
        "prompt-logprobs-high",
        {"prompt": "a", "prompt_logprobs": 21},
        400,
        "prompt_logprobs",
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
    Case(
        "chat-prompt-logprobs-stream", chat(prompt_logprobs=2, stream=True), 400, "prompt_logprobs"
    ),
    Case(
        "completion-max-tokens",
        {"prompt": "a", "max_tokens": 300},
        400,
        "max_tokens",
        path=COMPLETIONS,
    ),
    Case("completion-unknown-model", {"prompt": "a", "model": "x"}, 404, "model", path=COMPLETIONS),
    # -- tokenize, TGI --------------------------------------------------------------------
    Case("tokenize-nothing", {}, 400, "prompt", path="/tokenize"),
    Case("detokenize-negative", {"tokens": [-1]}, 400, "tokens", path="/detokenize"),
    Case("detokenize-strings", {"tokens": ["a"]}, 400, "tokens[0]", path="/detokenize"),
    Case("tgi-empty-inputs", {"inputs": ""}, 400, "inputs", path="/invocations"),
    Case(
        "tgi-temperature-zero",
        {"inputs": "x", "parameters": {"temperature": 0}},
        400,
        "parameters.temperature",
        path="/invocations",
    ),
    Case(
        "tgi-max-new-tokens",
        {"inputs": "x", "parameters": {"max_new_tokens": 10**6}},
        400,
        "parameters.max_new_tokens",
        path="/invocations",
    ),
    Case(
        "tgi-top-k-zero",
        {"inputs": "x", "parameters": {"top_k": 0}},
        400,
        "parameters.top_k",
        path="/invocations",
    ),
    # -- responses ------------------------------------------------------------------------
    Case("responses-input-missing", {}, 400, "input", path=RESPONSES),
    Case("responses-input-empty", resp(input=""), 400, "input", path=RESPONSES),
    Case("responses-input-empty-list", resp(input=[]), 400, "input", path=RESPONSES),
    Case("responses-input-number", resp(input=5), 400, "input", path=RESPONSES),
    Case("responses-item-not-object", resp(input=["hi"]), 400, "input[0]", path=RESPONSES),
    Case(
        "responses-item-type",
        resp(input=[{"type": "web_search_call", "id": "x"}]),
        400,
        "input[0].type",
        path=RESPONSES,
    ),
    Case(
        "responses-item-role",
        resp(input=[{"role": "robot", "content": "x"}]),
        400,
        "input[0].role",
        path=RESPONSES,
    ),
    Case(
        "responses-image-part",
        resp(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
        400,
        "input[0].content[0].type",
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
        "responses-call-without-call-id",
        resp(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]),
        400,
        "input[0].call_id",
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
        "responses-hosted-tool",
        resp(tools=[{"type": "web_search"}]),
        400,
        "tools[0].type",
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
        "responses-tool-choice-unknown",
        resp(tools=[FUNCTION_TOOL], tool_choice={"type": "function", "name": "g"}),
        400,
        "tool_choice.name",
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
        "responses-format-without-schema",
        resp(text={"format": {"type": "json_schema", "name": "x"}}),
        400,
        "text.format.schema",
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
    Case(
        "responses-max-output-tokens-huge",
        resp(max_output_tokens=10**6),
        400,
        "max_output_tokens",
        path=RESPONSES,
    ),
    Case("responses-temperature", resp(temperature=2.5), 400, "temperature", path=RESPONSES),
    Case("responses-top-p", resp(top_p=0), 400, "top_p", path=RESPONSES),
    Case(
        "responses-effort",
        resp(reasoning={"effort": "max"}),
        400,
        "reasoning.effort",
        path=RESPONSES,
    ),
    Case("responses-stream-string", resp(stream="yes"), 400, "stream", path=RESPONSES),
    Case("responses-background", resp(background=True), 400, "background", path=RESPONSES),
    Case("responses-truncation-auto", resp(truncation="auto"), 400, "truncation", path=RESPONSES),
    Case("responses-too-long", resp(input="word " * 400), 400, "input", path=RESPONSES),
    Case("responses-unknown-model", resp(model="x"), 404, "model", path=RESPONSES),
    Case(
        "responses-previous-unknown",
        resp(previous_response_id="resp_nope"),
        404,
        "previous_response_id",
        path=RESPONSES,
    ),
    Case(
        "responses-get-unknown",
        None,
        404,
        "response_id",
        path=RESPONSES + "/resp_nope",
        method="GET",
    ),
    Case(
        "responses-delete-unknown",
        None,
        404,
        "response_id",
        path=RESPONSES + "/resp_nope",
        method="DELETE",
    ),
    Case(
        "responses-cancel-unknown",
        {},
        404,
        "response_id",
        path=RESPONSES + "/resp_nope/cancel",
    ),
    Case("responses-list-method", None, 405, None, path=RESPONSES, method="GET"),
    Case("invocations-responses-input", {"input": 5}, 400, "input", path="/invocations"),
    Case("invocations-garbage", {"hello": "world"}, 400, None, path="/invocations"),
    Case("invocations-bad-json", b"{nope", 400, None, path="/invocations"),
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


def test_matrix_is_broad() -> None:
    assert len(CASES) >= 50
    assert len({c.id for c in CASES}) == len(CASES)


def test_one_engine_survives_the_whole_matrix(client, engine, tokenizer: Tokenizer) -> None:
    for case in CASES:
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
