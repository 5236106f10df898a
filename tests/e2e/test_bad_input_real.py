"""Bad input of every kind against the real default server over raw HTTP: each case gets
its 4xx in OpenAI's error shape naming the field, never a 500; after the whole matrix
the server is healthy, still answers, and holds no KV blocks.

The case list follows `tests/handlers/test_handlers_bad_input.py` (which runs it on a
scripted engine), adapted to the real model: vocabulary 49152, max_model_len 2048.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest

from tests.e2e.clients import assert_anthropic_error, assert_openai_error, wait_metric
from tests.e2e.server import Server

pytestmark = pytest.mark.slow

VOCAB = 49152
MAX_MODEL_LEN = 2048
USER = [{"role": "user", "content": "Hello"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
INVOCATIONS = "/invocations"
EMBEDDINGS = "/v1/embeddings"
MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
RESPONSES = "/v1/responses"


@dataclass(frozen=True)
class Case:
    id: str
    body: Any
    status: int
    param: Any
    """The expected `param`; `...` when the case does not pin one."""
    path: str = CHAT
    method: str = "POST"
    headers: tuple[tuple[str, str], ...] = ()


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "smollm2", "messages": USER, "max_tokens": 4, **fields}


def comp(**fields: Any) -> dict[str, Any]:
    return {"model": "smollm2", "prompt": "Hello", "max_tokens": 4, **fields}


def resp(**fields: Any) -> dict[str, Any]:
    return {"model": "smollm2", "input": "Hello", "max_output_tokens": 4, **fields}


FUNCTION_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}


def tgi(**parameters: Any) -> dict[str, Any]:
    return {"inputs": "Hello", "parameters": {"max_new_tokens": 4, **parameters}}


def tag(**item: Any) -> dict[str, Any]:
    """A structural-tag response_format; `item` overrides (None drops) structure keys."""
    structure = {"begin": "<function=f>", "schema": {"type": "object"}, "end": "</function>"}
    structure.update(item)
    structure = {k: v for k, v in structure.items() if v is not None}
    return {"type": "structural_tag", "structures": [structure], "triggers": ["<function="]}


def nested(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


LONG_TEXT = "word " * (MAX_MODEL_LEN + 100)

CASES = [
    # -- transport --------------------------------------------------------------------------
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
    Case("nan", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, None),
    Case("body-too-large", b'{"prompt": "' + b"a" * (7 * 1024 * 1024) + b'"}', 413, None),
    # -- messages ---------------------------------------------------------------------------
    Case("messages-missing", {"model": "smollm2"}, 400, "messages"),
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
        "part-not-object",
        chat(messages=[{"role": "user", "content": ["hi"]}]),
        400,
        "messages[0].content[0]",
    ),
    Case(
        "tool-without-id",
        chat(messages=[*USER, {"role": "tool", "content": "42"}]),
        400,
        "messages[1].tool_call_id",
    ),
    Case(
        "name-number",
        chat(messages=[{"role": "user", "content": "x", "name": 5}]),
        400,
        "messages[0].name",
    ),
    Case(
        "too-long-prompt",
        chat(messages=[{"role": "user", "content": LONG_TEXT}]),
        400,
        "messages",
    ),
    # -- sampling ranges and types ------------------------------------------------------------
    Case("temperature-negative", chat(temperature=-0.1), 400, "temperature"),
    Case("temperature-high", chat(temperature=2.5), 400, "temperature"),
    Case("temperature-string", chat(temperature="0.5"), 400, "temperature"),
    Case("top-p-zero", chat(top_p=0), 400, "top_p"),
    Case("top-p-high", chat(top_p=1.5), 400, "top_p"),
    Case("top-k-low", chat(top_k=-2), 400, "top_k"),
    Case("top-k-float", chat(top_k=1.5), 400, "top_k"),
    Case("min-p-high", chat(min_p=1.5), 400, "min_p"),
    Case("presence-high", chat(presence_penalty=3), 400, "presence_penalty"),
    Case("frequency-low", chat(frequency_penalty=-3), 400, "frequency_penalty"),
    Case("repetition-zero", chat(repetition_penalty=0), 400, "repetition_penalty"),
    Case("repetition-high", chat(repetition_penalty=2.5), 400, "repetition_penalty"),
    Case("n-zero", chat(n=0), 400, "n"),
    Case("n-over-max", chat(n=17), 400, "n"),
    Case("n-bool", chat(n=True), 400, "n"),
    Case("n-string", chat(n="2"), 400, "n"),
    Case("seed-negative", chat(seed=-1), 400, "seed"),
    Case("seed-over-int64", chat(seed=2**63), 400, "seed"),
    Case("seed-string", chat(seed="1"), 400, "seed"),
    Case("min-tokens-negative", chat(min_tokens=-1), 400, "min_tokens"),
    Case("min-tokens-over-max", chat(min_tokens=10, max_tokens=5), 400, "min_tokens"),
    Case("max-tokens-zero", chat(max_tokens=0), 400, "max_tokens"),
    Case("max-tokens-negative", chat(max_tokens=-5), 400, "max_tokens"),
    Case("max-tokens-over-context", chat(max_tokens=MAX_MODEL_LEN), 400, "max_tokens"),
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
    Case(
        "stream-options-not-object",
        chat(stream=True, stream_options="usage"),
        400,
        "stream_options",
    ),
    Case("model-number", chat(model=5), 400, "model"),
    Case("priority-string", chat(priority="high"), 400, "priority"),
    Case("logprobs-string", chat(logprobs="yes"), 400, "logprobs"),
    Case("echo-number", chat(echo=1), 400, "echo"),
    # -- stop ----------------------------------------------------------------------------------
    Case("stop-empty", chat(stop=""), 400, "stop[0]"),
    Case("stop-empty-in-list", chat(stop=["a", ""]), 400, "stop[1]"),
    Case("stop-5000", chat(stop=[f"s{i}" for i in range(5000)]), 400, "stop"),
    Case("stop-number", chat(stop=5), 400, "stop"),
    Case("stop-list-of-numbers", chat(stop=[5]), 400, "stop[0]"),
    Case("stop-token-ids-out-of-vocab", chat(stop_token_ids=[VOCAB]), 400, "stop_token_ids"),
    Case("stop-token-ids-negative", chat(stop_token_ids=[-1]), 400, "stop_token_ids"),
    Case("stop-token-ids-strings", chat(stop_token_ids=["2"]), 400, "stop_token_ids[0]"),
    # -- logit bias, logprobs ----------------------------------------------------------------
    Case("logit-bias-key-text", chat(logit_bias={"hello": 1}), 400, "logit_bias"),
    Case("logit-bias-key-out-of-vocab", chat(logit_bias={str(VOCAB): 1}), 400, "logit_bias"),
    Case("logit-bias-key-negative", chat(logit_bias={"-3": 1}), 400, "logit_bias"),
    Case("logit-bias-value-high", chat(logit_bias={"5": 101}), 400, "logit_bias"),
    Case("logit-bias-value-string", chat(logit_bias={"5": "1"}), 400, "logit_bias"),
    Case("logit-bias-not-object", chat(logit_bias=[1, 2]), 400, "logit_bias"),
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
        "structural-tag-missing-end",
        chat(response_format=tag(end=None)),
        400,
        "response_format.structures[0].end",
    ),
    Case(
        "structural-tag-trigger-not-a-prefix",
        chat(response_format={**tag(), "triggers": ["<tool>"]}),
        400,
        "response_format.triggers[0]",
    ),
    Case(
        "structural-tag-unknown-format",
        chat(response_format={"type": "structural_tag", "format": {"type": "no_such_format"}}),
        400,
        "response_format",
    ),
    Case(
        "structural-tag-text-invalid-schema",
        chat(
            structured_outputs={
                "structural_tag": orjson.dumps(tag(schema={"type": "foo"})).decode()
            }
        ),
        400,
        "structured_outputs.structural_tag",
    ),
    Case(
        "whitespace-pattern-unsupported",
        chat(structured_outputs={"json": {"type": "object"}, "whitespace_pattern": "[ ]*"}),
        400,
        "structured_outputs.whitespace_pattern",
    ),
    Case(
        "json-schema-invalid-type",
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": {"type": "foo"}},
            }
        ),
        400,
        "response_format.json_schema.schema",
    ),
    Case("bad-regex", chat(structured_outputs={"regex": "(abc"}), 400, "structured_outputs.regex"),
    Case(
        "grammar-syntax-error",
        chat(structured_outputs={"grammar": 'root ::= ("a"'}),
        400,
        "structured_outputs.grammar",
    ),
    Case(
        "tgi-grammar-bad-regex",
        tgi(grammar={"type": "regex", "value": "[a-"}),
        400,
        "parameters.grammar.value",
        path=INVOCATIONS,
    ),
    Case(
        "tgi-grammar-bad-type",
        tgi(grammar={"type": "xml", "value": "a"}),
        400,
        "parameters.grammar.type",
        path=INVOCATIONS,
    ),
    Case("tool-choice-auto", chat(tool_choice="auto"), 400, "tool_choice"),
    Case("tool-choice-required", chat(tool_choice="required"), 400, "tool_choice"),
    Case(
        "tool-choice-named",
        chat(tool_choice={"type": "function", "function": {"name": "f"}}),
        400,
        "tool_choice",
    ),
    Case("functions", chat(functions=[{"name": "f"}]), 400, "functions"),
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
    Case(
        "continue-without-assistant",
        chat(continue_final_message=True, add_generation_prompt=False),
        400,
        "continue_final_message",
    ),
    # -- streaming requests refused before the status line: JSON, never SSE ------------------
    Case("stream-temperature", chat(stream=True, temperature=-1), 400, "temperature"),
    Case("stream-unknown-model", chat(stream=True, model="gpt-4o"), 404, "model"),
    Case(
        "stream-too-long",
        chat(stream=True, messages=[{"role": "user", "content": LONG_TEXT}]),
        400,
        "messages",
    ),
    Case(
        "stream-completion-out-of-vocab",
        comp(stream=True, prompt=[1, VOCAB]),
        400,
        "prompt",
        path=COMPLETIONS,
    ),
    # -- model, routes --------------------------------------------------------------------------
    Case("unknown-model", chat(model="gpt-4o"), 404, "model"),
    Case("unknown-route", chat(), 404, None, path="/v1/audio/speech"),
    Case("unknown-route-root", None, 404, None, path="/nothing", method="GET"),
    Case("wrong-method", None, 405, None, path=CHAT, method="GET"),
    Case("wrong-method-models", chat(), 405, None, path="/v1/models"),
    Case("wrong-method-delete", None, 405, None, path=COMPLETIONS, method="DELETE"),
    Case("wrong-method-tokenize", None, 405, None, path="/tokenize", method="GET"),
    # -- completions ----------------------------------------------------------------------------
    Case("prompt-missing", {"max_tokens": 5}, 400, "prompt", path=COMPLETIONS),
    Case("prompt-empty-list", comp(prompt=[]), 400, "prompt", path=COMPLETIONS),
    Case("prompt-empty-string", comp(prompt=""), 400, "prompt", path=COMPLETIONS),
    Case("prompt-ids-out-of-vocab", comp(prompt=[1, VOCAB]), 400, "prompt", path=COMPLETIONS),
    Case("prompt-ids-negative", comp(prompt=[1, -5]), 400, "prompt", path=COMPLETIONS),
    Case(
        "prompt-lists-out-of-vocab",
        comp(prompt=[[1], [VOCAB]]),
        400,
        "prompt[1]",
        path=COMPLETIONS,
    ),
    Case("prompt-empty-inner-list", comp(prompt=[[1], []]), 400, "prompt[1]", path=COMPLETIONS),
    Case("prompt-mixed", comp(prompt=["a", 1]), 400, "prompt", path=COMPLETIONS),
    Case("prompt-number", comp(prompt=5), 400, "prompt", path=COMPLETIONS),
    Case(
        "prompt-too-long",
        comp(prompt=[1] * MAX_MODEL_LEN),
        400,
        "prompt",
        path=COMPLETIONS,
    ),
    Case(
        "prompt-300-prompts",
        comp(prompt=["a"] * 300),
        400,
        "prompt",
        path=COMPLETIONS,
    ),
    Case("suffix", comp(suffix="b"), 400, "suffix", path=COMPLETIONS),
    Case("best-of", comp(best_of=2), 400, "best_of", path=COMPLETIONS),
    Case("completion-logprobs-high", comp(logprobs=21), 400, "logprobs", path=COMPLETIONS),
    Case("completion-logprobs-negative", comp(logprobs=-1), 400, "logprobs", path=COMPLETIONS),
    Case("max-tokens-zero-no-echo", comp(max_tokens=0), 400, "max_tokens", path=COMPLETIONS),
    Case(
        "prompt-logprobs-negative",
        comp(prompt_logprobs=-1),
        400,
        "prompt_logprobs",
        path=COMPLETIONS,
    ),
    Case(
        "prompt-logprobs-high", comp(prompt_logprobs=21), 400, "prompt_logprobs", path=COMPLETIONS
    ),
    Case(
        "chat-prompt-logprobs-stream", chat(prompt_logprobs=1, stream=True), 400, "prompt_logprobs"
    ),
    Case(
        "completion-max-tokens",
        comp(max_tokens=MAX_MODEL_LEN),
        400,
        "max_tokens",
        path=COMPLETIONS,
    ),
    Case(
        "completion-response-format-schema-missing",
        comp(response_format={"type": "json_schema", "json_schema": {"name": "a"}}),
        400,
        "response_format.json_schema.schema",
        path=COMPLETIONS,
    ),
    Case(
        "completion-bad-regex",
        comp(guided_regex="a{2,"),
        400,
        "guided_regex",
        path=COMPLETIONS,
    ),
    Case("completion-unknown-model", comp(model="x"), 404, "model", path=COMPLETIONS),
    # -- embeddings ------------------------------------------------------------------------------
    Case("embed-input-missing", {"model": "smollm2"}, 400, "input", path=EMBEDDINGS),
    Case("embed-input-empty-list", {"input": []}, 400, "input", path=EMBEDDINGS),
    Case("embed-input-empty-string", {"input": ""}, 400, "input", path=EMBEDDINGS),
    Case("embed-input-empty-in-batch", {"input": ["a", ""]}, 400, "input[1]", path=EMBEDDINGS),
    Case("embed-input-number", {"input": 5}, 400, "input", path=EMBEDDINGS),
    Case("embed-input-mixed", {"input": ["a", [1]]}, 400, "input", path=EMBEDDINGS),
    Case("embed-ids-out-of-vocab", {"input": [1, VOCAB]}, 400, "input", path=EMBEDDINGS),
    Case("embed-lists-out-of-vocab", {"input": [[1], [VOCAB]]}, 400, "input[1]", path=EMBEDDINGS),
    Case("embed-ids-negative", {"input": [1, -1]}, 400, "input", path=EMBEDDINGS),
    Case("embed-empty-inner-list", {"input": [[1], []]}, 400, "input[1]", path=EMBEDDINGS),
    Case("embed-too-many-inputs", {"input": ["a"] * 1025}, 400, "input", path=EMBEDDINGS),
    Case("embed-text-too-long", {"input": LONG_TEXT}, 400, "input", path=EMBEDDINGS),
    Case("embed-ids-too-long", {"input": [1] * (MAX_MODEL_LEN + 1)}, 400, "input", path=EMBEDDINGS),
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
        "embed-dimensions-not-matryoshka",
        {"input": "a", "dimensions": 64},
        400,
        "dimensions",
        path=EMBEDDINGS,
    ),
    Case("embed-unknown-model", {"input": "a", "model": "x"}, 404, "model", path=EMBEDDINGS),
    Case("embed-wrong-method", None, 405, None, path=EMBEDDINGS, method="GET"),
    Case(
        "invocations-embed-bad",
        {"task": "embeddings", "input": [1, VOCAB]},
        400,
        "input",
        path=INVOCATIONS,
    ),
    # -- tokenize, detokenize --------------------------------------------------------------------
    Case("tokenize-nothing", {}, 400, "prompt", path="/tokenize"),
    Case("tokenize-empty-messages", {"messages": []}, 400, "messages", path="/tokenize"),
    Case("tokenize-unknown-model", {"prompt": "a", "model": "x"}, 404, "model", path="/tokenize"),
    Case("detokenize-negative", {"tokens": [-1]}, 400, "tokens", path="/detokenize"),
    Case("detokenize-out-of-vocab", {"tokens": [VOCAB]}, 400, "tokens", path="/detokenize"),
    Case("detokenize-strings", {"tokens": ["a"]}, 400, "tokens[0]", path="/detokenize"),
    Case("detokenize-missing", {}, 400, "tokens", path="/detokenize"),
    # -- responses ----------------------------------------------------------------------------
    Case("responses-input-missing", {"model": "smollm2"}, 400, "input", path=RESPONSES),
    Case("responses-input-empty", resp(input=[]), 400, "input", path=RESPONSES),
    Case(
        "responses-item-type",
        resp(input=[{"type": "computer_call", "id": "x"}]),
        400,
        "input[0].type",
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
        "responses-call-without-call-id",
        resp(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]),
        400,
        "input[0].call_id",
        path=RESPONSES,
    ),
    Case(
        "responses-hosted-tool",
        resp(tools=[{"type": "file_search"}], stream=True),
        400,
        "tools[0].type",
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
        "responses-format-without-schema",
        resp(text={"format": {"type": "json_schema", "name": "x"}}),
        400,
        "text.format.schema",
        path=RESPONSES,
    ),
    Case(
        "responses-bad-schema",
        resp(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}),
        400,
        "text.format.schema",
        path=RESPONSES,
    ),
    Case(
        "responses-max-output-tokens-huge",
        resp(max_output_tokens=10**6, stream=True),
        400,
        "max_output_tokens",
        path=RESPONSES,
    ),
    Case("responses-temperature", resp(temperature=-1), 400, "temperature", path=RESPONSES),
    Case(
        "responses-background-unstored",
        resp(background=True, store=False),
        400,
        "background",
        path=RESPONSES,
    ),
    Case(
        "responses-too-long",
        resp(input=LONG_TEXT, stream=True),
        400,
        "input",
        path=RESPONSES,
    ),
    Case("responses-unknown-model", resp(model="x"), 404, "model", path=RESPONSES),
    Case(
        "responses-previous-unknown",
        resp(previous_response_id="resp_nope", stream=True),
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
    Case("responses-cancel-unknown", {}, 404, "response_id", path=RESPONSES + "/resp_nope/cancel"),
    Case("invocations-responses-bad", {"input": 5}, 400, "input", path=INVOCATIONS),
    # -- /invocations: every kind, TGI -----------------------------------------------------------
    Case("invocations-garbage", {"hello": "world"}, 400, None, path=INVOCATIONS),
    Case("invocations-bad-json", b"{nope", 400, None, path=INVOCATIONS),
    Case("invocations-array", [1], 400, None, path=INVOCATIONS),
    Case("invocations-chat-bad", chat(temperature=9), 400, "temperature", path=INVOCATIONS),
    Case("invocations-completion-bad", comp(n=0), 400, "n", path=INVOCATIONS),
    Case("tgi-empty-inputs", {"inputs": ""}, 400, "inputs", path=INVOCATIONS),
    Case("tgi-inputs-number", {"inputs": 5}, 400, "inputs", path=INVOCATIONS),
    Case(
        "tgi-parameters-list",
        {"inputs": "x", "parameters": []},
        400,
        "parameters",
        path=INVOCATIONS,
    ),
    Case(
        "tgi-temperature-zero",
        tgi(temperature=0),
        400,
        "parameters.temperature",
        path=INVOCATIONS,
    ),
    Case(
        "tgi-max-new-tokens",
        tgi(max_new_tokens=10**6),
        400,
        "parameters.max_new_tokens",
        path=INVOCATIONS,
    ),
    Case("tgi-top-k-zero", tgi(top_k=0), 400, "parameters.top_k", path=INVOCATIONS),
    Case("tgi-top-p-high", tgi(top_p=1.5), 400, "parameters.top_p", path=INVOCATIONS),
    Case("tgi-seed-negative", tgi(seed=-1), 400, "parameters.seed", path=INVOCATIONS),
    Case("tgi-stop-string", tgi(stop="x"), 400, "parameters.stop", path=INVOCATIONS),
    Case("tgi-best-of", tgi(best_of=2), 400, "parameters.best_of", path=INVOCATIONS),
    Case(
        "tgi-too-long",
        {"inputs": LONG_TEXT, "stream": True},
        400,
        "inputs",
        path=INVOCATIONS,
    ),
]


def msgs(**fields: Any) -> dict[str, Any]:
    """An Anthropic Messages body; a field set to None is dropped."""
    body = {"model": "smollm2", "max_tokens": 4, "messages": USER, **fields}
    return {k: v for k, v in body.items() if v is not None}


def blocks(*content: Any, role: str = "user") -> list[dict[str, Any]]:
    return [{"role": role, "content": list(content)}]


TOOL = {"name": "f", "input_schema": {"type": "object"}}
TOOL_USE = {"type": "tool_use", "id": "t", "name": "f", "input": {}}

# Anthropic's routes (and an Anthropic body on /invocations): Anthropic's error shape.
ANTHROPIC_CASES = [
    Case("a-invalid-json", b'{"messages": [', 400, ..., path=MESSAGES),
    Case("a-body-array", [1], 400, ..., path=MESSAGES),
    Case(
        "a-body-too-large", b'{"x": "' + b"a" * (7 * 1024 * 1024) + b'"}', 413, ..., path=MESSAGES
    ),
    Case(
        "a-wrong-content-type", b"{}", 415, ..., MESSAGES, "POST", (("content-type", "text/plain"),)
    ),
    Case("a-wrong-method", None, 405, ..., path=MESSAGES, method="GET"),
    Case("a-unknown-route", None, 404, ..., path=MESSAGES + "/batches", method="GET"),
    Case("a-model-missing", msgs(model=None), 400, ..., path=MESSAGES),
    Case("a-unknown-model", msgs(model="claude-sonnet-4-5"), 404, ..., path=MESSAGES),
    Case("a-max-tokens-missing", msgs(max_tokens=None), 400, ..., path=MESSAGES),
    Case("a-max-tokens-zero", msgs(max_tokens=0), 400, ..., path=MESSAGES),
    Case("a-max-tokens-over-context", msgs(max_tokens=MAX_MODEL_LEN), 400, ..., path=MESSAGES),
    Case("a-messages-empty", msgs(messages=[]), 400, ..., path=MESSAGES),
    Case(
        "a-role-system",
        msgs(messages=[{"role": "system", "content": "x"}]),
        400,
        ...,
        path=MESSAGES,
    ),
    Case(
        "a-image-block",
        msgs(messages=blocks({"type": "image", "source": {}})),
        400,
        ...,
        path=MESSAGES,
    ),
    Case("a-block-not-object", msgs(messages=blocks("hi")), 400, ..., path=MESSAGES),
    Case("a-tool-use-in-user", msgs(messages=blocks(TOOL_USE)), 400, ..., path=MESSAGES),
    Case(
        "a-tool-use-input-not-object",
        msgs(messages=[*blocks({**TOOL_USE, "input": [1]}, role="assistant"), *USER]),
        400,
        ...,
        path=MESSAGES,
    ),
    Case(
        "a-prefill-with-tool-use",
        msgs(messages=[*USER, *blocks(TOOL_USE, role="assistant")]),
        400,
        ...,
        path=MESSAGES,
    ),
    Case("a-system-image", msgs(system=[{"type": "image"}]), 400, ..., path=MESSAGES),
    Case("a-temperature-high", msgs(temperature=1.5), 400, ..., path=MESSAGES),
    Case("a-top-k-negative", msgs(top_k=-1), 400, ..., path=MESSAGES),
    Case("a-stop-sequence-empty", msgs(stop_sequences=[""]), 400, ..., path=MESSAGES),
    Case("a-stream-string", msgs(stream="yes"), 400, ..., path=MESSAGES),
    Case(
        "a-server-tool",
        msgs(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
        400,
        ...,
        path=MESSAGES,
    ),
    Case(
        "a-tool-schema-not-object",
        msgs(tools=[{**TOOL, "input_schema": {"type": "string"}}]),
        400,
        ...,
        path=MESSAGES,
    ),
    Case("a-tool-names-twice", msgs(tools=[TOOL, TOOL]), 400, ..., path=MESSAGES),
    Case(
        "a-tool-choice-unknown-tool",
        msgs(tools=[TOOL], tool_choice={"type": "tool", "name": "g"}),
        400,
        ...,
        path=MESSAGES,
    ),
    Case(
        "a-tool-choice-any-without-tools",
        msgs(tool_choice={"type": "any"}),
        400,
        ...,
        path=MESSAGES,
    ),
    Case(
        "a-forced-tool-and-output-format",
        msgs(
            tools=[TOOL],
            tool_choice={"type": "any"},
            output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}},
        ),
        400,
        ...,
        path=MESSAGES,
    ),
    Case(
        "a-output-format-bad-schema",
        msgs(output_config={"format": {"type": "json_schema", "schema": 5}}),
        400,
        ...,
        path=MESSAGES,
    ),
    Case(
        "a-thinking-budget-over-max",
        msgs(thinking={"type": "enabled", "budget_tokens": 2000}),
        400,
        ...,
        path=MESSAGES,
    ),
    Case(
        "a-mcp-servers",
        msgs(mcp_servers=[{"type": "url", "url": "http://x"}]),
        400,
        ...,
        path=MESSAGES,
    ),
    Case(
        "a-too-long-prompt",
        msgs(messages=[{"role": "user", "content": LONG_TEXT}], stream=True),
        400,
        ...,
        path=MESSAGES,
    ),
    Case("a-count-model-missing", {"messages": USER}, 400, ..., path=COUNT_TOKENS),
    Case("a-count-unknown-model", {"model": "x", "messages": USER}, 404, ..., path=COUNT_TOKENS),
    Case(
        "a-count-image",
        {"model": "smollm2", "messages": blocks({"type": "image"})},
        400,
        ...,
        path=COUNT_TOKENS,
    ),
    Case(
        "a-invocations-bad",
        {"anthropic_version": "bedrock-2023-05-31", "max_tokens": 0, "messages": USER},
        400,
        ...,
        path=INVOCATIONS,
    ),
]


def send(http: httpx.Client, server: Server, case: Case) -> httpx.Response:
    headers = dict(case.headers)
    headers.setdefault("content-type", "application/json")
    body = case.body if isinstance(case.body, bytes) else orjson.dumps(case.body)
    if case.method == "GET" and case.body is None:
        body = b""
    return http.request(case.method, server.url + case.path, content=body, headers=headers)


@pytest.fixture(scope="module")
def http() -> httpx.Client:
    with httpx.Client(timeout=120) as client:
        yield client


def test_matrix_is_broad() -> None:
    assert len(CASES) >= 50
    every = CASES + ANTHROPIC_CASES
    assert len({c.id for c in every}) == len(every)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_real_server(default_server: Server, http: httpx.Client, case: Case) -> None:
    response = send(http, default_server, case)
    assert response.status_code < 500, response.text[:500]
    assert_openai_error(response, case.status, case.param)
    assert not response.content.startswith(b"data:")
    if case.status == 405:
        assert response.headers.get("allow"), response.headers


@pytest.mark.parametrize("case", ANTHROPIC_CASES, ids=[c.id for c in ANTHROPIC_CASES])
def test_bad_input_anthropic_real_server(
    default_server: Server, http: httpx.Client, case: Case
) -> None:
    response = send(http, default_server, case)
    assert response.status_code < 500, response.text[:500]
    assert_anthropic_error(response, case.status)
    assert not response.content.startswith((b"data:", b"event:"))


def test_server_is_whole_after_the_matrix(default_server: Server, http: httpx.Client) -> None:
    """Run last in this module (pytest keeps file order): the matrix left nothing behind."""
    for case in CASES + ANTHROPIC_CASES:  # once more, back to back, on one connection
        assert send(http, default_server, case).status_code == case.status, case.id
    assert http.get(default_server.url + "/health").status_code == 200
    reply = http.post(
        default_server.v1 + "/chat/completions",
        json={"model": "smollm2", "messages": USER, "max_tokens": 4, "temperature": 0},
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] >= 1
    assert wait_metric(default_server, "hearth:kv_cache_used_blocks", 0) == 0
    assert wait_metric(default_server, "hearth:num_requests_running", 0) == 0
    assert wait_metric(default_server, "hearth:num_requests_waiting", 0) == 0
