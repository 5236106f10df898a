"""Bad input of every kind against the real default server over raw HTTP: each case gets
its 4xx in OpenAI's error shape naming the field, never a 500; after the whole matrix
the server is healthy, still answers, and holds no KV blocks.

The table is `tests/bad_input_cases.py`'s (the handler tests run it on a scripted engine)
built for the real model, vocabulary 49152, max_model_len 2048, plus the cases only a
real server answers.
"""

from __future__ import annotations

import httpx
import orjson
import pytest

from tests.bad_input_cases import (
    COMPLETIONS,
    COUNT_TOKENS,
    EMBEDDINGS,
    INVOCATIONS,
    MESSAGES,
    RESPONSES,
    USER,
    Case,
    Target,
    anthropic_cases,
    blocks,
    openai_cases,
    tag,
)
from tests.e2e.clients import assert_anthropic_error, assert_openai_error, wait_metric
from tests.e2e.server import Server

pytestmark = pytest.mark.slow

TARGET = Target(model="smollm2", max_model_len=2048, out_of_vocab=49152)
VOCAB, MAX_MODEL_LEN, LONG_TEXT = TARGET.out_of_vocab, TARGET.max_model_len, TARGET.long_text
chat, comp, resp, tgi = TARGET.chat, TARGET.comp, TARGET.resp, TARGET.tgi

# The shared table, and what only a real server answers: a body past the size limit, a
# real grammar compile, the model's vocabulary and context, every /invocations kind.
CASES = [
    *openai_cases(TARGET),
    # -- transport --------------------------------------------------------------------------
    Case("nan", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, None),
    Case("body-too-large", b'{"prompt": "' + b"a" * (7 * 1024 * 1024) + b'"}', 413, None),
    # -- messages ---------------------------------------------------------------------------
    Case(
        "part-not-object",
        chat(messages=[{"role": "user", "content": ["hi"]}]),
        400,
        "messages[0].content[0]",
    ),
    Case(
        "name-number",
        chat(messages=[{"role": "user", "content": "x", "name": 5}]),
        400,
        "messages[0].name",
    ),
    # -- sampling ranges and types ------------------------------------------------------------
    Case("top-k-float", chat(top_k=1.5), 400, "top_k"),
    Case("n-string", chat(n="2"), 400, "n"),
    Case("seed-string", chat(seed="1"), 400, "seed"),
    Case("max-tokens-negative", chat(max_tokens=-5), 400, "max_tokens"),
    Case(
        "stream-options-not-object",
        chat(stream=True, stream_options="usage"),
        400,
        "stream_options",
    ),
    Case("logprobs-string", chat(logprobs="yes"), 400, "logprobs"),
    Case("echo-number", chat(echo=1), 400, "echo"),
    # -- stop ----------------------------------------------------------------------------------
    Case("stop-token-ids-strings", chat(stop_token_ids=["2"]), 400, "stop_token_ids[0]"),
    # -- logit bias, logprobs ----------------------------------------------------------------
    Case("logit-bias-key-negative", chat(logit_bias={"-3": 1}), 400, "logit_bias"),
    Case("logit-bias-value-string", chat(logit_bias={"5": "1"}), 400, "logit_bias"),
    Case("logit-bias-not-object", chat(logit_bias=[1, 2]), 400, "logit_bias"),
    # -- structured outputs ----------------------------------------------------------------
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
    Case("functions", chat(functions=[{"name": "f"}]), 400, "functions"),
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
    Case("unknown-route-root", None, 404, None, path="/nothing", method="GET"),
    Case("wrong-method-delete", None, 405, None, path=COMPLETIONS, method="DELETE"),
    Case("wrong-method-tokenize", None, 405, None, path="/tokenize", method="GET"),
    # -- completions ----------------------------------------------------------------------------
    Case("prompt-empty-inner-list", comp(prompt=[[1], []]), 400, "prompt[1]", path=COMPLETIONS),
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
    Case("completion-logprobs-negative", comp(logprobs=-1), 400, "logprobs", path=COMPLETIONS),
    Case("max-tokens-zero-no-echo", comp(max_tokens=0), 400, "max_tokens", path=COMPLETIONS),
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
    # -- embeddings ------------------------------------------------------------------------------
    Case("embed-ids-out-of-vocab", {"input": [1, VOCAB]}, 400, "input", path=EMBEDDINGS),
    Case("embed-lists-out-of-vocab", {"input": [[1], [VOCAB]]}, 400, "input[1]", path=EMBEDDINGS),
    Case("embed-ids-negative", {"input": [1, -1]}, 400, "input", path=EMBEDDINGS),
    Case("embed-empty-inner-list", {"input": [[1], []]}, 400, "input[1]", path=EMBEDDINGS),
    Case("embed-text-too-long", {"input": LONG_TEXT}, 400, "input", path=EMBEDDINGS),
    Case(
        "invocations-embed-bad",
        {"task": "embeddings", "input": [1, VOCAB]},
        400,
        "input",
        path=INVOCATIONS,
    ),
    # -- tokenize, detokenize --------------------------------------------------------------------
    Case("tokenize-empty-messages", {"messages": []}, 400, "messages", path="/tokenize"),
    Case("tokenize-unknown-model", {"prompt": "a", "model": "x"}, 404, "model", path="/tokenize"),
    Case("detokenize-out-of-vocab", {"tokens": [VOCAB]}, 400, "tokens", path="/detokenize"),
    Case("detokenize-missing", {}, 400, "tokens", path="/detokenize"),
    # -- responses ----------------------------------------------------------------------------
    Case(
        "responses-bad-schema",
        resp(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}),
        400,
        "text.format.schema",
        path=RESPONSES,
    ),
    Case("invocations-responses-bad", {"input": 5}, 400, "input", path=INVOCATIONS),
    # -- /invocations: every kind, TGI -----------------------------------------------------------
    Case("invocations-array", [1], 400, None, path=INVOCATIONS),
    Case("invocations-chat-bad", chat(temperature=9), 400, "temperature", path=INVOCATIONS),
    Case("invocations-completion-bad", comp(n=0), 400, "n", path=INVOCATIONS),
    Case("tgi-inputs-number", {"inputs": 5}, 400, "inputs", path=INVOCATIONS),
    Case(
        "tgi-parameters-list",
        {"inputs": "x", "parameters": []},
        400,
        "parameters",
        path=INVOCATIONS,
    ),
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


ANTHROPIC_CASES = [
    *anthropic_cases(TARGET),
    Case(
        "a-body-too-large", b'{"x": "' + b"a" * (7 * 1024 * 1024) + b'"}', 413, ..., path=MESSAGES
    ),
    Case("a-unknown-route", None, 404, ..., path=MESSAGES + "/batches", method="GET"),
    Case(
        "a-count-image",
        {"model": TARGET.model, "messages": blocks({"type": "image"})},
        400,
        ...,
        path=COUNT_TOKENS,
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
