"""The bad-input case table both bad-input suites run: the handlers on a scripted engine
(`tests/handlers/test_handlers_bad_input.py`) and the real default server over raw HTTP
(`tests/e2e/test_bad_input_real.py`). Each case is a request some client will send
sooner or later, and the status and `param` it must get; each suite adds the cases only
its side can answer (a real grammar compile, a body past the size limit, the scripted
engine's admission checks).

A `Target` names what differs between the two: the model's name, limits and vocabulary,
and so the bodies a case is built from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

USER = [{"role": "user", "content": "Hello"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
INVOCATIONS = "/invocations"
EMBEDDINGS = "/v1/embeddings"
MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
RESPONSES = "/v1/responses"
FUNCTION_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
TOOL = {"name": "f", "input_schema": {"type": "object"}}
TOOL_USE = {"type": "tool_use", "id": "t", "name": "f", "input": {}}


@dataclass(frozen=True)
class Case:
    id: str
    body: Any
    status: int
    param: Any
    """The expected `param`; `...` when the case does not pin one (Anthropic's error shape
    has none)."""
    path: str = CHAT
    method: str = "POST"
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Target:
    """The server a table is built for."""

    model: str
    max_model_len: int
    out_of_vocab: int
    """A token id past the vocabulary."""

    @property
    def long_text(self) -> str:
        """A prompt longer than `max_model_len` tokens."""
        return "word " * (self.max_model_len + 100)

    def chat(self, **fields: Any) -> dict[str, Any]:
        return {"model": self.model, "messages": USER, "max_tokens": 4, **fields}

    def comp(self, **fields: Any) -> dict[str, Any]:
        return {"model": self.model, "prompt": "Hello", "max_tokens": 4, **fields}

    def resp(self, **fields: Any) -> dict[str, Any]:
        return {"model": self.model, "input": "Hello", "max_output_tokens": 4, **fields}

    @staticmethod
    def tgi(**parameters: Any) -> dict[str, Any]:
        return {"inputs": "Hello", "parameters": {"max_new_tokens": 4, **parameters}}

    def msgs(self, **fields: Any) -> dict[str, Any]:
        """An Anthropic Messages body; a field set to None is dropped."""
        body = {"model": self.model, "max_tokens": 4, "messages": USER, **fields}
        return {k: v for k, v in body.items() if v is not None}


def tag(**item: Any) -> dict[str, Any]:
    """A structural-tag response_format; `item` overrides (None drops) structure keys."""
    structure = {"begin": "<function=f>", "schema": {"type": "object"}, "end": "</function>"}
    structure.update(item)
    structure = {k: v for k, v in structure.items() if v is not None}
    return {"type": "structural_tag", "structures": [structure], "triggers": ["<function="]}


def nested(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


def blocks(*content: Any, role: str = "user") -> list[dict[str, Any]]:
    return [{"role": role, "content": list(content)}]


def openai_cases(t: Target) -> list[Case]:
    """Bad requests to the OpenAI-shaped routes (and /invocations), answered in OpenAI's
    error shape."""
    return [
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
        # -- messages ---------------------------------------------------------------------------
        Case("messages-missing", {"model": t.model}, 400, "messages"),
        Case("messages-empty", t.chat(messages=[]), 400, "messages"),
        Case("messages-not-list", t.chat(messages="hi"), 400, "messages"),
        Case("message-not-object", t.chat(messages=["hi"]), 400, "messages[0]"),
        Case(
            "unknown-role",
            t.chat(messages=[{"role": "robot", "content": "x"}]),
            400,
            "messages[0].role",
        ),
        Case("role-missing", t.chat(messages=[{"content": "x"}]), 400, "messages[0].role"),
        Case(
            "content-number",
            t.chat(messages=[{"role": "user", "content": 5}]),
            400,
            "messages[0].content",
        ),
        Case("content-missing", t.chat(messages=[{"role": "user"}]), 400, "messages[0].content"),
        Case(
            "image-part",
            t.chat(
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
            ),
            400,
            "messages[0].content[0].type",
        ),
        Case(
            "part-without-text",
            t.chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
            400,
            "messages[0].content[0].text",
        ),
        Case(
            "tool-without-id",
            t.chat(messages=[*USER, {"role": "tool", "content": "42"}]),
            400,
            "messages[1].tool_call_id",
        ),
        Case(
            "too-long-prompt",
            t.chat(messages=[{"role": "user", "content": t.long_text}]),
            400,
            "messages",
        ),
        # -- sampling ranges and types ------------------------------------------------------------
        Case("temperature-negative", t.chat(temperature=-0.1), 400, "temperature"),
        Case("temperature-high", t.chat(temperature=2.5), 400, "temperature"),
        Case("temperature-string", t.chat(temperature="0.5"), 400, "temperature"),
        Case("top-p-zero", t.chat(top_p=0), 400, "top_p"),
        Case("top-p-high", t.chat(top_p=1.5), 400, "top_p"),
        Case("top-k-low", t.chat(top_k=-2), 400, "top_k"),
        Case("min-p-high", t.chat(min_p=1.5), 400, "min_p"),
        Case("presence-high", t.chat(presence_penalty=3), 400, "presence_penalty"),
        Case("frequency-low", t.chat(frequency_penalty=-3), 400, "frequency_penalty"),
        Case("repetition-zero", t.chat(repetition_penalty=0), 400, "repetition_penalty"),
        Case("repetition-high", t.chat(repetition_penalty=2.5), 400, "repetition_penalty"),
        Case("n-zero", t.chat(n=0), 400, "n"),
        Case("n-over-max", t.chat(n=17), 400, "n"),
        Case("n-bool", t.chat(n=True), 400, "n"),
        Case("seed-negative", t.chat(seed=-1), 400, "seed"),
        Case("seed-over-int64", t.chat(seed=2**63), 400, "seed"),
        Case("min-tokens-negative", t.chat(min_tokens=-1), 400, "min_tokens"),
        Case("min-tokens-over-max", t.chat(min_tokens=10, max_tokens=5), 400, "min_tokens"),
        Case("max-tokens-zero", t.chat(max_tokens=0), 400, "max_tokens"),
        Case("max-tokens-over-context", t.chat(max_tokens=t.max_model_len), 400, "max_tokens"),
        Case(
            "max-completion-over-context",
            t.chat(max_completion_tokens=10_000),
            400,
            "max_completion_tokens",
        ),
        Case("max-tokens-float", t.chat(max_tokens=1.5), 400, "max_tokens"),
        Case("stream-string", t.chat(stream="yes"), 400, "stream"),
        Case(
            "stream-options-without-stream",
            t.chat(stream_options={"include_usage": True}),
            400,
            "stream_options",
        ),
        Case("model-number", t.chat(model=5), 400, "model"),
        Case("priority-string", t.chat(priority="high"), 400, "priority"),
        # -- stop ----------------------------------------------------------------------------------
        Case("stop-empty", t.chat(stop=""), 400, "stop[0]"),
        Case("stop-empty-in-list", t.chat(stop=["a", ""]), 400, "stop[1]"),
        Case("stop-5000", t.chat(stop=[f"s{i}" for i in range(5000)]), 400, "stop"),
        Case("stop-number", t.chat(stop=5), 400, "stop"),
        Case("stop-list-of-numbers", t.chat(stop=[5]), 400, "stop[0]"),
        Case(
            "stop-token-ids-out-of-vocab",
            t.chat(stop_token_ids=[t.out_of_vocab]),
            400,
            "stop_token_ids",
        ),
        Case("stop-token-ids-negative", t.chat(stop_token_ids=[-1]), 400, "stop_token_ids"),
        # -- logit bias, logprobs ----------------------------------------------------------------
        Case("logit-bias-key-text", t.chat(logit_bias={"hello": 1}), 400, "logit_bias"),
        Case(
            "logit-bias-key-out-of-vocab",
            t.chat(logit_bias={str(t.out_of_vocab): 1}),
            400,
            "logit_bias",
        ),
        Case("logit-bias-value-high", t.chat(logit_bias={"5": 101}), 400, "logit_bias"),
        Case("top-logprobs-over-max", t.chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
        Case("top-logprobs-without-logprobs", t.chat(top_logprobs=2), 400, "top_logprobs"),
        Case("top-logprobs-negative", t.chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs"),
        # -- structured outputs ----------------------------------------------------------------
        Case(
            "json-schema-missing",
            t.chat(response_format={"type": "json_schema", "json_schema": {}}),
            400,
            "response_format.json_schema.schema",
        ),
        Case(
            "json-schema-not-object",
            t.chat(
                response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": 5}}
            ),
            400,
            "response_format.json_schema.schema",
        ),
        Case(
            "json-schema-unsupported-keyword",
            t.chat(
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
            t.chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"description": "x" * 70_000}},
                }
            ),
            400,
            "response_format.json_schema.schema",
        ),
        Case(
            "response-format-xml",
            t.chat(response_format={"type": "xml"}),
            400,
            "response_format.type",
        ),
        Case(
            "two-constraints",
            t.chat(guided_regex="a+", response_format={"type": "json_object"}),
            400,
            "guided_regex",
        ),
        Case(
            "structured-outputs-two-kinds",
            t.chat(structured_outputs={"regex": "a", "choice": ["b"]}),
            400,
            "structured_outputs",
        ),
        Case(
            "choice-empty",
            t.chat(structured_outputs={"choice": []}),
            400,
            "structured_outputs.choice",
        ),
        Case("guided-json-bad-text", t.chat(guided_json="{nope"), 400, "guided_json"),
        Case(
            "structural-tag",
            t.chat(structured_outputs={"structural_tag": {"a": 1}}),
            400,
            "structured_outputs.structural_tag",
        ),
        Case(
            "structural-tag-missing-end",
            t.chat(response_format=tag(end=None)),
            400,
            "response_format.structures[0].end",
        ),
        Case(
            "structural-tag-trigger-not-a-prefix",
            t.chat(response_format={**tag(), "triggers": ["<function=", "<tool>"]}),
            400,
            "response_format.triggers[1]",
        ),
        Case(
            "whitespace-pattern-unsupported",
            t.chat(structured_outputs={"json": {"type": "object"}, "whitespace_pattern": "[ ]*"}),
            400,
            "structured_outputs.whitespace_pattern",
        ),
        Case("tool-choice-auto", t.chat(tool_choice="auto"), 400, "tool_choice"),
        Case("tool-choice-required", t.chat(tool_choice="required"), 400, "tool_choice"),
        Case(
            "tool-choice-named",
            t.chat(tool_choice={"type": "function", "function": {"name": "f"}}),
            400,
            "tool_choice",
        ),
        Case("beam-search-too-wide", t.chat(use_beam_search=True, n=11), 400, "n"),
        Case("beam-search-with-stop", t.chat(use_beam_search=True, stop=["x"]), 400, "stop"),
        Case("untrusted-template", t.chat(chat_template="{{ messages }}"), 400, "chat_template"),
        Case(
            "untrusted-template-kwarg",
            t.chat(chat_template_kwargs={"chat_template": "x"}),
            400,
            "chat_template",
        ),
        Case(
            "continue-and-generation-prompt",
            t.chat(continue_final_message=True),
            400,
            "continue_final_message",
        ),
        # -- model, routes --------------------------------------------------------------------------
        Case("unknown-model", t.chat(model="gpt-4o"), 404, "model"),
        Case("unknown-route", t.chat(), 404, None, path="/v1/audio/speech"),
        Case("wrong-method", None, 405, None, path=CHAT, method="GET"),
        Case("wrong-method-models", t.chat(), 405, None, path="/v1/models"),
        # -- completions ----------------------------------------------------------------------------
        Case("prompt-missing", {"max_tokens": 5}, 400, "prompt", path=COMPLETIONS),
        Case("prompt-empty-list", t.comp(prompt=[]), 400, "prompt", path=COMPLETIONS),
        Case("prompt-empty-string", t.comp(prompt=""), 400, "prompt", path=COMPLETIONS),
        Case(
            "prompt-ids-out-of-vocab",
            t.comp(prompt=[1, t.out_of_vocab]),
            400,
            "prompt",
            path=COMPLETIONS,
        ),
        Case("prompt-ids-negative", t.comp(prompt=[1, -5]), 400, "prompt", path=COMPLETIONS),
        Case(
            "prompt-lists-out-of-vocab",
            t.comp(prompt=[[1], [t.out_of_vocab]]),
            400,
            "prompt[1]",
            path=COMPLETIONS,
        ),
        Case("prompt-mixed", t.comp(prompt=["a", 1]), 400, "prompt", path=COMPLETIONS),
        Case("prompt-number", t.comp(prompt=5), 400, "prompt", path=COMPLETIONS),
        Case("suffix", t.comp(suffix="b"), 400, "suffix", path=COMPLETIONS),
        Case("best-of", t.comp(best_of=2), 400, "best_of", path=COMPLETIONS),
        Case("completion-logprobs-high", t.comp(logprobs=21), 400, "logprobs", path=COMPLETIONS),
        Case(
            "prompt-logprobs-negative",
            t.comp(prompt_logprobs=-1),
            400,
            "prompt_logprobs",
            path=COMPLETIONS,
        ),
        Case(
            "prompt-logprobs-high",
            t.comp(prompt_logprobs=21),
            400,
            "prompt_logprobs",
            path=COMPLETIONS,
        ),
        Case(
            "chat-prompt-logprobs-stream",
            t.chat(prompt_logprobs=1, stream=True),
            400,
            "prompt_logprobs",
        ),
        Case(
            "completion-max-tokens",
            t.comp(max_tokens=t.max_model_len),
            400,
            "max_tokens",
            path=COMPLETIONS,
        ),
        Case("completion-unknown-model", t.comp(model="x"), 404, "model", path=COMPLETIONS),
        # -- embeddings ------------------------------------------------------------------------------
        Case("embed-input-missing", {"model": t.model}, 400, "input", path=EMBEDDINGS),
        Case("embed-input-empty-list", {"input": []}, 400, "input", path=EMBEDDINGS),
        Case("embed-input-empty-string", {"input": ""}, 400, "input", path=EMBEDDINGS),
        Case("embed-input-empty-in-batch", {"input": ["a", ""]}, 400, "input[1]", path=EMBEDDINGS),
        Case("embed-input-number", {"input": 5}, 400, "input", path=EMBEDDINGS),
        Case("embed-input-mixed", {"input": ["a", [1]]}, 400, "input", path=EMBEDDINGS),
        Case("embed-too-many-inputs", {"input": ["a"] * 1025}, 400, "input", path=EMBEDDINGS),
        Case(
            "embed-ids-too-long",
            {"input": [1] * (t.max_model_len + 1)},
            400,
            "input",
            path=EMBEDDINGS,
        ),
        Case(
            "embed-encoding-format",
            {"input": "a", "encoding_format": "int8"},
            400,
            "encoding_format",
            path=EMBEDDINGS,
        ),
        Case(
            "embed-dimensions-zero",
            {"input": "a", "dimensions": 0},
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
        Case("embed-unknown-model", {"input": "a", "model": "x"}, 404, "model", path=EMBEDDINGS),
        Case("embed-wrong-method", None, 405, None, path=EMBEDDINGS, method="GET"),
        # -- tokenize, detokenize --------------------------------------------------------------------
        Case("tokenize-nothing", {}, 400, "prompt", path="/tokenize"),
        Case("detokenize-negative", {"tokens": [-1]}, 400, "tokens", path="/detokenize"),
        Case("detokenize-strings", {"tokens": ["a"]}, 400, "tokens[0]", path="/detokenize"),
        # -- responses ----------------------------------------------------------------------------
        Case("responses-input-missing", {"model": t.model}, 400, "input", path=RESPONSES),
        Case("responses-input-empty", t.resp(input=[]), 400, "input", path=RESPONSES),
        Case("responses-input-empty-string", t.resp(input=""), 400, "input", path=RESPONSES),
        Case(
            "responses-item-type",
            t.resp(input=[{"type": "computer_call", "id": "x"}]),
            400,
            "input[0].type",
            path=RESPONSES,
        ),
        Case(
            "responses-item-type-web-search",
            t.resp(input=[{"type": "web_search_call", "id": "x"}]),
            400,
            "input[0].type",
            path=RESPONSES,
        ),
        Case(
            "responses-image-part",
            t.resp(
                input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
            ),
            400,
            "input[0].content[0].type",
            path=RESPONSES,
        ),
        Case(
            "responses-call-without-call-id",
            t.resp(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]),
            400,
            "input[0].call_id",
            path=RESPONSES,
        ),
        Case(
            "responses-hosted-tool",
            t.resp(tools=[{"type": "file_search"}], stream=True),
            400,
            "tools[0].type",
            path=RESPONSES,
        ),
        Case(
            "responses-hosted-tool-web-search",
            t.resp(tools=[{"type": "web_search"}]),
            400,
            "tools[0].type",
            path=RESPONSES,
        ),
        Case(
            "responses-tool-choice-unknown",
            t.resp(tools=[FUNCTION_TOOL], tool_choice={"type": "function", "name": "g"}),
            400,
            "tool_choice.name",
            path=RESPONSES,
        ),
        Case(
            "responses-format-without-schema",
            t.resp(text={"format": {"type": "json_schema", "name": "x"}}),
            400,
            "text.format.schema",
            path=RESPONSES,
        ),
        Case(
            "responses-max-output-tokens-huge",
            t.resp(max_output_tokens=10**6, stream=True),
            400,
            "max_output_tokens",
            path=RESPONSES,
        ),
        Case("responses-temperature", t.resp(temperature=-1), 400, "temperature", path=RESPONSES),
        Case(
            "responses-temperature-high",
            t.resp(temperature=2.5),
            400,
            "temperature",
            path=RESPONSES,
        ),
        Case(
            "responses-background-unstored",
            t.resp(background=True, store=False),
            400,
            "background",
            path=RESPONSES,
        ),
        Case(
            "responses-too-long",
            t.resp(input=t.long_text, stream=True),
            400,
            "input",
            path=RESPONSES,
        ),
        Case("responses-unknown-model", t.resp(model="x"), 404, "model", path=RESPONSES),
        Case(
            "responses-previous-unknown",
            t.resp(previous_response_id="resp_nope", stream=True),
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
            "responses-cancel-unknown", {}, 404, "response_id", path=RESPONSES + "/resp_nope/cancel"
        ),
        # -- /invocations: every kind, TGI -----------------------------------------------------------
        Case("invocations-garbage", {"hello": "world"}, 400, None, path=INVOCATIONS),
        Case("invocations-bad-json", b"{nope", 400, None, path=INVOCATIONS),
        Case("tgi-empty-inputs", {"inputs": ""}, 400, "inputs", path=INVOCATIONS),
        Case(
            "tgi-temperature-zero",
            t.tgi(temperature=0),
            400,
            "parameters.temperature",
            path=INVOCATIONS,
        ),
        Case(
            "tgi-max-new-tokens",
            t.tgi(max_new_tokens=10**6),
            400,
            "parameters.max_new_tokens",
            path=INVOCATIONS,
        ),
        Case("tgi-top-k-zero", t.tgi(top_k=0), 400, "parameters.top_k", path=INVOCATIONS),
    ]


def anthropic_cases(t: Target) -> list[Case]:
    """Bad requests to Anthropic's routes, answered in Anthropic's error shape."""
    return [
        Case("a-invalid-json", b'{"messages": [', 400, ..., path=MESSAGES),
        Case("a-body-array", [1], 400, ..., path=MESSAGES),
        Case(
            "a-wrong-content-type",
            b"{}",
            415,
            ...,
            MESSAGES,
            "POST",
            (("content-type", "text/plain"),),
        ),
        Case("a-wrong-method", None, 405, ..., path=MESSAGES, method="GET"),
        Case("a-model-missing", t.msgs(model=None), 400, ..., path=MESSAGES),
        Case("a-unknown-model", t.msgs(model="claude-sonnet-4-5"), 404, ..., path=MESSAGES),
        Case("a-max-tokens-missing", t.msgs(max_tokens=None), 400, ..., path=MESSAGES),
        Case("a-max-tokens-zero", t.msgs(max_tokens=0), 400, ..., path=MESSAGES),
        Case(
            "a-max-tokens-over-context", t.msgs(max_tokens=t.max_model_len), 400, ..., path=MESSAGES
        ),
        Case("a-messages-empty", t.msgs(messages=[]), 400, ..., path=MESSAGES),
        Case(
            "a-role-system",
            t.msgs(messages=[{"role": "system", "content": "x"}]),
            400,
            ...,
            path=MESSAGES,
        ),
        Case(
            "a-image-block",
            t.msgs(messages=blocks({"type": "image", "source": {}})),
            400,
            ...,
            path=MESSAGES,
        ),
        Case("a-block-not-object", t.msgs(messages=blocks("hi")), 400, ..., path=MESSAGES),
        Case("a-tool-use-in-user", t.msgs(messages=blocks(TOOL_USE)), 400, ..., path=MESSAGES),
        Case(
            "a-tool-use-input-not-object",
            t.msgs(messages=[*blocks({**TOOL_USE, "input": [1]}, role="assistant"), *USER]),
            400,
            ...,
            path=MESSAGES,
        ),
        Case(
            "a-prefill-with-tool-use",
            t.msgs(messages=[*USER, *blocks(TOOL_USE, role="assistant")]),
            400,
            ...,
            path=MESSAGES,
        ),
        Case("a-system-image", t.msgs(system=[{"type": "image"}]), 400, ..., path=MESSAGES),
        Case("a-temperature-high", t.msgs(temperature=1.5), 400, ..., path=MESSAGES),
        Case("a-top-k-negative", t.msgs(top_k=-1), 400, ..., path=MESSAGES),
        Case("a-stop-sequence-empty", t.msgs(stop_sequences=[""]), 400, ..., path=MESSAGES),
        Case("a-stream-string", t.msgs(stream="yes"), 400, ..., path=MESSAGES),
        Case(
            "a-server-tool",
            t.msgs(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
            400,
            ...,
            path=MESSAGES,
        ),
        Case(
            "a-tool-schema-not-object",
            t.msgs(tools=[{**TOOL, "input_schema": {"type": "string"}}]),
            400,
            ...,
            path=MESSAGES,
        ),
        Case("a-tool-names-twice", t.msgs(tools=[TOOL, TOOL]), 400, ..., path=MESSAGES),
        Case(
            "a-tool-choice-unknown-tool",
            t.msgs(tools=[TOOL], tool_choice={"type": "tool", "name": "g"}),
            400,
            ...,
            path=MESSAGES,
        ),
        Case(
            "a-tool-choice-any-without-tools",
            t.msgs(tool_choice={"type": "any"}),
            400,
            ...,
            path=MESSAGES,
        ),
        Case(
            "a-forced-tool-and-output-format",
            t.msgs(
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
            t.msgs(output_config={"format": {"type": "json_schema", "schema": 5}}),
            400,
            ...,
            path=MESSAGES,
        ),
        Case(
            "a-thinking-budget-over-max",
            t.msgs(thinking={"type": "enabled", "budget_tokens": 2000}),
            400,
            ...,
            path=MESSAGES,
        ),
        Case(
            "a-mcp-servers",
            t.msgs(mcp_servers=[{"type": "url", "url": "http://x"}]),
            400,
            ...,
            path=MESSAGES,
        ),
        Case(
            "a-too-long-prompt",
            t.msgs(messages=[{"role": "user", "content": t.long_text}], stream=True),
            400,
            ...,
            path=MESSAGES,
        ),
        Case("a-count-model-missing", {"messages": USER}, 400, ..., path=COUNT_TOKENS),
        Case(
            "a-count-unknown-model", {"model": "x", "messages": USER}, 404, ..., path=COUNT_TOKENS
        ),
        Case(
            "a-invocations-bad",
            {"anthropic_version": "bedrock-2023-05-31", "max_tokens": 0, "messages": USER},
            400,
            ...,
            path=INVOCATIONS,
        ),
    ]
