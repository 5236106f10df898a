"""Bad input of every kind: the right status, the OpenAI error shape, the field named,
and nothing left running in the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import falcon.testing
import orjson
import pytest
from handlers_testing import MAX_MODEL_LEN, assert_anthropic_error, assert_openai_error

from engine.tokenizer import Tokenizer

USER = [{"role": "user", "content": "Hello"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
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
    Case("beam-search-too-wide", chat(use_beam_search=True, n=11), 400, "n"),
    Case("beam-search-with-stop", chat(use_beam_search=True, stop=["x"]), 400, "stop"),
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
    Case("unknown-route", chat(), 404, None, path="/v1/audio/speech"),
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
    Case(
        "responses-background-unstored",
        resp(background=True, store=False),
        400,
        "background",
        path=RESPONSES,
    ),
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
    # -- embeddings --------------------------------------------------------------------------
    Case("embed-input-missing", {"model": "tiny"}, 400, "input", path=EMBEDDINGS),
    Case("embed-input-empty-list", {"input": []}, 400, "input", path=EMBEDDINGS),
    Case("embed-input-empty-string", {"input": ""}, 400, "input", path=EMBEDDINGS),
    Case("embed-input-empty-in-batch", {"input": ["a", ""]}, 400, "input[1]", path=EMBEDDINGS),
    Case("embed-input-number", {"input": 5}, 400, "input", path=EMBEDDINGS),
    Case("embed-input-object", {"input": {"text": "a"}}, 400, "input", path=EMBEDDINGS),
    Case("embed-input-mixed", {"input": ["a", [1]]}, 400, "input", path=EMBEDDINGS),
    Case("embed-input-negative-id", {"input": [1, -1]}, 400, "input", path=EMBEDDINGS),
    Case("embed-input-bool-id", {"input": [1, True]}, 400, "input", path=EMBEDDINGS),
    Case("embed-input-empty-inner", {"input": [[1], []]}, 400, "input[1]", path=EMBEDDINGS),
    Case("embed-input-float-ids", {"input": [[1.5]]}, 400, "input[0]", path=EMBEDDINGS),
    Case("embed-too-many-inputs", {"input": ["a"] * 1025}, 400, "input", path=EMBEDDINGS),
    Case(
        "embed-too-long", {"input": "word " * (MAX_MODEL_LEN + 10)}, 400, "input", path=EMBEDDINGS
    ),
    Case("embed-ids-too-long", {"input": [5] * (MAX_MODEL_LEN + 1)}, 400, "input", path=EMBEDDINGS),
    Case(
        "embed-encoding-format",
        {"input": "a", "encoding_format": "int8"},
        400,
        "encoding_format",
        path=EMBEDDINGS,
    ),
    Case(
        "embed-dimensions-zero", {"input": "a", "dimensions": 0}, 400, "dimensions", path=EMBEDDINGS
    ),
    Case(
        "embed-dimensions-string",
        {"input": "a", "dimensions": "8"},
        400,
        "dimensions",
        path=EMBEDDINGS,
    ),
    Case(
        "embed-dimensions-not-matryoshka",
        {"input": "a", "dimensions": 4},
        400,
        "dimensions",
        path=EMBEDDINGS,
    ),
    Case("embed-unknown-model", {"input": "a", "model": "gpt-4o"}, 404, "model", path=EMBEDDINGS),
    Case(
        "embed-truncate-prompt-tokens-past-context",
        {"input": "a", "truncate_prompt_tokens": 100_000},
        400,
        "truncate_prompt_tokens",
        path=EMBEDDINGS,
    ),
    Case("embed-wrong-method", None, 405, None, path=EMBEDDINGS, method="GET"),
    Case("embed-body-array", ["a"], 400, None, path=EMBEDDINGS),
    Case(
        "invocations-embed-bad-input",
        {"task": "embeddings", "input": []},
        400,
        "input",
        path="/invocations",
    ),
    Case("invocations-bad-json", b"{nope", 400, None, path="/invocations"),
]


def msgs(**fields: Any) -> dict[str, Any]:
    """An Anthropic Messages body; a field set to None is dropped."""
    body = {"model": "tiny", "max_tokens": 8, "messages": USER, **fields}
    return {k: v for k, v in body.items() if v is not None}


def blocks(*content: dict[str, Any], role: str = "user") -> list[dict[str, Any]]:
    return [{"role": role, "content": list(content)}]


TOOL = {"name": "f", "input_schema": {"type": "object"}}

# Anthropic's routes: the same kinds of bad input, answered in Anthropic's error shape.
ANTHROPIC_CASES = [
    Case("a-invalid-json", b'{"messages": [', 400, None, path=MESSAGES),
    Case("a-body-array", [1], 400, None, path=MESSAGES),
    Case(
        "a-wrong-content-type",
        b"{}",
        415,
        None,
        MESSAGES,
        "POST",
        (("content-type", "text/plain"),),
    ),
    Case("a-wrong-method", None, 405, None, path=MESSAGES, method="GET"),
    Case("a-model-missing", msgs(model=None), 400, None, path=MESSAGES),
    Case("a-unknown-model", msgs(model="claude-sonnet-4-5"), 404, None, path=MESSAGES),
    Case("a-max-tokens-missing", msgs(max_tokens=None), 400, None, path=MESSAGES),
    Case("a-max-tokens-zero", msgs(max_tokens=0), 400, None, path=MESSAGES),
    Case("a-max-tokens-over-context", msgs(max_tokens=300), 400, None, path=MESSAGES),
    Case("a-messages-empty", msgs(messages=[]), 400, None, path=MESSAGES),
    Case(
        "a-role-system",
        msgs(messages=[{"role": "system", "content": "x"}]),
        400,
        None,
        path=MESSAGES,
    ),
    Case(
        "a-content-number",
        msgs(messages=[{"role": "user", "content": 5}]),
        400,
        None,
        path=MESSAGES,
    ),
    Case(
        "a-image-block",
        msgs(messages=blocks({"type": "image", "source": {}})),
        400,
        None,
        path=MESSAGES,
    ),
    Case("a-unknown-block", msgs(messages=blocks({"type": "nope"})), 400, None, path=MESSAGES),
    Case("a-block-not-object", msgs(messages=blocks("hi")), 400, None, path=MESSAGES),  # type: ignore[arg-type]
    Case(
        "a-tool-use-in-user",
        msgs(messages=blocks({"type": "tool_use", "id": "t", "name": "f", "input": {}})),
        400,
        None,
        path=MESSAGES,
    ),
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
        "a-tool-use-input-not-object",
        msgs(
            messages=[
                *blocks({"type": "tool_use", "id": "t", "name": "f", "input": 5}, role="assistant"),
                *USER,
            ]
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
    Case(
        "a-prefill-with-tool-use",
        msgs(
            messages=[
                *USER,
                *blocks(
                    {"type": "tool_use", "id": "t", "name": "f", "input": {}}, role="assistant"
                ),
            ]
        ),
        400,
        None,
        path=MESSAGES,
    ),
    Case("a-system-image", msgs(system=[{"type": "image"}]), 400, None, path=MESSAGES),
    Case("a-system-number", msgs(system=5), 400, None, path=MESSAGES),
    Case("a-temperature-high", msgs(temperature=1.5), 400, None, path=MESSAGES),
    Case("a-temperature-string", msgs(temperature="0.5"), 400, None, path=MESSAGES),
    Case("a-top-p-zero", msgs(top_p=0), 400, None, path=MESSAGES),
    Case("a-top-k-negative", msgs(top_k=-1), 400, None, path=MESSAGES),
    Case("a-stream-string", msgs(stream="yes"), 400, None, path=MESSAGES),
    Case("a-stop-sequence-empty", msgs(stop_sequences=[""]), 400, None, path=MESSAGES),
    Case(
        "a-stop-sequences-5000",
        msgs(stop_sequences=[f"s{i}" for i in range(5000)]),
        400,
        None,
        path=MESSAGES,
    ),
    Case("a-stop-sequences-string", msgs(stop_sequences="x"), 400, None, path=MESSAGES),
    Case(
        "a-server-tool",
        msgs(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
        400,
        None,
        path=MESSAGES,
    ),
    Case("a-tool-name-bad", msgs(tools=[{**TOOL, "name": "a b"}]), 400, None, path=MESSAGES),
    Case("a-tool-schema-missing", msgs(tools=[{"name": "f"}]), 400, None, path=MESSAGES),
    Case(
        "a-tool-schema-not-object",
        msgs(tools=[{**TOOL, "input_schema": {"type": "string"}}]),
        400,
        None,
        path=MESSAGES,
    ),
    Case(
        "a-tool-schema-unsupported-keyword",
        msgs(tools=[{**TOOL, "input_schema": {"type": "object", "not": {}}}]),
        400,
        None,
        path=MESSAGES,
    ),
    Case("a-tool-names-twice", msgs(tools=[TOOL, TOOL]), 400, None, path=MESSAGES),
    Case(
        "a-tool-choice-unknown-tool",
        msgs(tools=[TOOL], tool_choice={"type": "tool", "name": "g"}),
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
        "a-tool-choice-any-without-tools",
        msgs(tool_choice={"type": "any"}),
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
    Case(
        "a-thinking-budget-over-max",
        msgs(thinking={"type": "enabled", "budget_tokens": 2000}),
        400,
        None,
        path=MESSAGES,
    ),
    Case("a-thinking-type", msgs(thinking={"type": "sometimes"}), 400, None, path=MESSAGES),
    Case(
        "a-forced-tool-and-output-format",
        msgs(
            tools=[TOOL],
            tool_choice={"type": "tool", "name": "f"},
            output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}},
        ),
        400,
        None,
        path=MESSAGES,
    ),
    Case(
        "a-output-format-bad-schema",
        msgs(output_config={"format": {"type": "json_schema", "schema": 5}}),
        400,
        None,
        path=MESSAGES,
    ),
    Case(
        "a-mcp-servers",
        msgs(mcp_servers=[{"type": "url", "url": "http://x"}]),
        400,
        None,
        path=MESSAGES,
    ),
    Case(
        "a-too-long-prompt",
        msgs(messages=[{"role": "user", "content": "word " * 400}]),
        400,
        None,
        path=MESSAGES,
    ),
    Case("a-count-model-missing", {"messages": USER}, 400, None, path=COUNT_TOKENS),
    Case("a-count-messages-empty", {"model": "tiny", "messages": []}, 400, None, path=COUNT_TOKENS),
    Case("a-count-unknown-model", {"model": "x", "messages": USER}, 404, None, path=COUNT_TOKENS),
    Case("a-count-wrong-method", None, 405, None, path=COUNT_TOKENS, method="GET"),
    Case(
        "a-invocations-bad",
        {"anthropic_version": "bedrock-2023-05-31", "max_tokens": 0, "messages": USER},
        400,
        None,
        path="/invocations",
    ),
    Case(
        "a-invocations-bad-block",
        {"system": "s", "max_tokens": 8, "messages": blocks({"type": "image"})},
        400,
        None,
        path="/invocations",
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
