"""Property-based fuzzing of the wire schemas (issue 8): generated bodies, through the
production app, for the routes that take a client's request body: chat (and its batch),
completions, TGI (/invocations), /tokenize and /detokenize, the token-in-token-out
/inference/v1/generate, the render and derender routes, the Responses and Anthropic
Messages APIs (and count_tokens), embeddings, pooling, classify, score, rerank,
generative scoring and Cohere's /v2/embed. Whatever the body, the answer is a 2xx or a
4xx in the route's error shape (OpenAI's; Anthropic's on /v1/messages*), a stream ends as
its API ends one, and nothing is left running in the engine.

Bodies mix the real field names (so validation goes deep) with random JSON values;
the run is derandomized, so a failure reproduces on every machine."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from handlers.protocol.anthropic import CountTokensRequest, MessagesRequest
from handlers.protocol.chat import ChatCompletionRequest
from handlers.protocol.cohere_embed import CohereEmbedRequest
from handlers.protocol.completion import CompletionRequest
from handlers.protocol.derender import DerenderChatRequest, DerenderCompletionRequest
from handlers.protocol.embedding import ClassificationRequest, EmbeddingRequest, PoolingRequest
from handlers.protocol.generate import (
    IGNORED_SAMPLING_FIELDS,
    REFUSED_SAMPLING_FIELDS,
    SAMPLING_FIELDS,
    GenerateRequest,
)
from handlers.protocol.generative_scoring import GenerativeScoringRequest
from handlers.protocol.responses import ResponsesRequest
from handlers.protocol.score import RerankRequest, ScoreRequest
from handlers.protocol.tgi import TGIParameters
from tests.handlers.handlers_testing import ANTHROPIC_ERROR_TYPES

EXAMPLES = 200
"""Per test; the 24 route tests make 4,800 bodies a run (about 35 s on two cores)."""

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.sampled_from(["", "user", "assistant", "system", "tool", "hi", "0", "-1", "1e309"])
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def mostly(valid: st.SearchStrategy[Any], times: int = 4) -> st.SearchStrategy[Any]:
    """`valid` `times` times in `times + 1`, any JSON value otherwise: bodies get past one
    check more often than not, so validation and serving go deep."""
    return st.one_of(*[valid] * times, json_values)


messages = st.lists(
    st.fixed_dictionaries(
        {"role": mostly(st.sampled_from(["user", "assistant", "system"]), times=9)},
        optional={
            "content": mostly(st.text(max_size=30), times=9),
            "name": mostly(st.text(max_size=8)),
        },
    ),
    max_size=3,
)


def bodies(fields: list[str], base: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """Dicts of the core alone (deep into serving), the core with real field names set to
    random values (deep into validation), or anything at all, a third of the time each."""
    small_ints = st.integers(min_value=-2, max_value=40)
    field_values = st.dictionaries(
        st.sampled_from(fields), json_values | small_ints | st.booleans(), max_size=6
    )
    shaped = st.builds(
        lambda core, extra: {**core, **extra}, st.fixed_dictionaries(base), field_values
    )
    return st.fixed_dictionaries(base) | shaped | json_values


CHAT_BODIES = bodies(
    sorted(ChatCompletionRequest.model_fields),
    {"messages": messages, "max_tokens": st.integers(min_value=1, max_value=8)},
)
COMPLETION_BODIES = bodies(
    sorted(CompletionRequest.model_fields),
    {
        "prompt": st.text(max_size=20)
        | st.lists(st.integers(min_value=-1, max_value=600), max_size=5)
        | json_values,
        "max_tokens": st.integers(min_value=1, max_value=8),
    },
)
TGI_BODIES = st.builds(
    lambda inputs, params, extra: {"inputs": inputs, "parameters": params, **extra},
    st.text(max_size=20) | json_values,
    st.dictionaries(
        st.sampled_from([*sorted(TGIParameters.model_fields), "grammar", "top_n_tokens"]),
        json_values | st.integers(min_value=-2, max_value=40),
        max_size=5,
    )
    | json_values,
    st.dictionaries(st.sampled_from(["stream", "model"]), json_values, max_size=2),
)
GENERATE_BODIES = bodies(
    sorted(GenerateRequest.model_fields),
    {
        "token_ids": st.lists(st.integers(min_value=-1, max_value=600), max_size=5) | json_values,
        "sampling_params": st.dictionaries(
            st.sampled_from(
                sorted(SAMPLING_FIELDS | IGNORED_SAMPLING_FIELDS | set(REFUSED_SAMPLING_FIELDS))
            )
            | st.text(max_size=8),
            json_values | st.integers(min_value=-2, max_value=40) | st.booleans(),
            max_size=5,
        )
        | json_values,
    },
)
TOKENIZE_BODIES = bodies(
    ["prompt", "messages", "model", "add_special_tokens", "add_generation_prompt"],
    {"prompt": st.text(max_size=20) | json_values},
)

_token_ids = st.lists(st.integers(min_value=-1, max_value=70_000), max_size=5)
_logprob_entries = st.lists(
    st.fixed_dictionaries(
        {"logprob": mostly(st.floats(allow_nan=False))},
        optional={
            "token_id": mostly(st.integers(min_value=-1, max_value=70_000)),
            "token": mostly(st.sampled_from(["token_id:5", "token_id:", "token_id:99999999", "x"])),
            "top_logprobs": json_values,
        },
    ),
    max_size=3,
)
GENERATED = st.fixed_dictionaries(
    {
        "request_id": mostly(st.text(max_size=5)),
        "choices": st.lists(
            st.fixed_dictionaries(
                {
                    "index": st.integers(min_value=-1, max_value=3),
                    "token_ids": mostly(_token_ids),
                },
                optional={
                    "logprobs": mostly(
                        st.fixed_dictionaries({"content": mostly(_logprob_entries)})
                    ),
                    "finish_reason": json_values,
                    "stop_reason": json_values,
                },
            ),
            max_size=3,
        )
        | json_values,
    }
)
"""A generate response as the derender routes take it back, valid or nearly."""
DERENDER_CHAT_BODIES = bodies(
    sorted(DerenderChatRequest.model_fields),
    {"generate_response": GENERATED, "chat_request": CHAT_BODIES},
)
DERENDER_COMPLETION_BODIES = bodies(
    sorted(DerenderCompletionRequest.model_fields),
    {
        "generate_responses": st.lists(GENERATED, max_size=3),
        "completion_request": COMPLETION_BODIES,
    },
)

texts = st.text(max_size=20) | st.sampled_from(["", " ", "{}", '{"a": 1}', "<think>", "\x00"])


small_schemas = mostly(
    st.sampled_from(
        [
            {"type": "object"},
            {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
            {"type": "string", "maxLength": 3},
            {"type": "array", "items": {"$ref": "#"}},
            {"enum": [1, "a", None]},
            {},
            {"type": "nonsense"},
        ]
    )
)


def _typed(types: list[str], fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy:
    """Dicts of one of `types` with some of `fields`."""
    return st.builds(
        lambda kind, extra: {"type": kind, **extra},
        st.sampled_from(types),
        st.fixed_dictionaries({}, optional=fields),
    )


_RESPONSE_PARTS = _typed(
    ["input_text", "output_text", "refusal", "text", "input_image", "input_file"],
    {"text": texts, "refusal": texts, "image_url": texts, "file_id": texts},
)
_RESPONSE_ITEMS = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "developer"])},
    optional={
        "type": st.just("message"),
        "content": texts | st.lists(_RESPONSE_PARTS, min_size=1, max_size=3),
    },
) | _typed(
    ["function_call", "function_call_output", "reasoning", "message", "web_search_call"],
    {
        "call_id": texts,
        "name": texts,
        "arguments": texts,
        "output": texts,
        "id": texts,
        "summary": st.lists(_typed(["summary_text"], {"text": texts}), max_size=2),
        "content": st.lists(_typed(["reasoning_text"], {"text": texts}), max_size=2),
        "role": st.sampled_from(["user", "assistant"]),
    },
)
_FUNCTION_TOOLS = _typed(
    ["function", "web_search", "file_search", "mcp"],
    {"name": texts, "description": texts, "parameters": small_schemas, "strict": st.booleans()},
)
RESPONSES_BODIES = st.fixed_dictionaries(
    {
        "input": mostly(texts | st.lists(_RESPONSE_ITEMS, min_size=1, max_size=4)),
        "max_output_tokens": st.integers(min_value=1, max_value=8),
    },
    optional={
        "tools": mostly(st.lists(_FUNCTION_TOOLS, max_size=3)),
        "tool_choice": mostly(
            st.sampled_from(["auto", "none", "required"]) | _typed(["function"], {"name": texts})
        ),
        "text": mostly(
            st.fixed_dictionaries(
                {},
                optional={
                    "format": _typed(
                        ["text", "json_object", "json_schema"],
                        {"name": texts, "schema": small_schemas, "strict": st.booleans()},
                    )
                },
            )
        ),
        "reasoning": st.fixed_dictionaries(
            {},
            optional={
                "effort": mostly(st.sampled_from(["low", "medium", "high", "none"])),
                "summary": mostly(st.sampled_from(["auto", "concise", "detailed"])),
            },
        ),
        "include": st.lists(
            mostly(
                st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content"])
            ),
            max_size=2,
        ),
        "top_logprobs": st.integers(min_value=-1, max_value=30),
        "previous_response_id": texts,
        "stream": st.booleans(),
        "instructions": mostly(texts),
        "temperature": mostly(st.floats(min_value=0, max_value=2)),
        "store": st.booleans(),
        "seed": st.integers(min_value=-1, max_value=2**64),
        "truncation": mostly(st.sampled_from(["disabled", "auto"])),
    },
) | bodies(
    sorted(set(ResponsesRequest.model_fields) - {"background"}),
    {"input": texts, "max_output_tokens": st.integers(min_value=1, max_value=8)},
).filter(
    lambda b: not (isinstance(b, dict) and b.get("background") is not False and "background" in b)
)
"""Responses bodies; never `background` (it runs on after its POST answers, which the
engine check after each body would see)."""
_ANTHROPIC_BLOCKS = _typed(
    ["text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking", "document"],
    {
        "text": texts,
        "id": texts,
        "name": texts,
        "input": st.dictionaries(st.text(max_size=4), json_values, max_size=2),
        "tool_use_id": texts,
        "content": texts | st.lists(_typed(["text", "image"], {"text": texts}), max_size=2),
        "thinking": texts,
        "signature": texts,
        "data": texts,
        "source": json_values,
        "is_error": st.booleans(),
    },
)


def _anthropic_messages(blocks: st.SearchStrategy[Any], most: int) -> st.SearchStrategy[Any]:
    """Lists of 1..`most` user / assistant turns, each a text or a list of `blocks`."""
    turn = st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant"]),
            "content": texts | st.lists(blocks, min_size=1, max_size=3),
        }
    )
    return st.lists(turn, min_size=1, max_size=most)


_ANTHROPIC_MESSAGES = _anthropic_messages(_ANTHROPIC_BLOCKS, 4)
_ANTHROPIC_EXTRAS = {
    "system": mostly(texts | st.lists(_typed(["text"], {"text": texts}), max_size=2)),
    "tools": mostly(
        st.lists(
            st.fixed_dictionaries(
                {"name": texts | st.just("f")},
                optional={"input_schema": small_schemas, "description": texts, "type": texts},
            ),
            max_size=3,
        )
    ),
    "tool_choice": _typed(["auto", "any", "tool", "none"], {"name": texts}),
    "thinking": _typed(
        ["enabled", "disabled", "adaptive"],
        {"budget_tokens": st.integers(min_value=-1, max_value=5000)},
    ),
    "stop_sequences": mostly(st.lists(texts, max_size=3)),
    "stream": st.booleans(),
    "temperature": mostly(st.floats(min_value=0, max_value=1)),
    "top_k": st.integers(min_value=-2, max_value=50),
    "metadata": mostly(st.fixed_dictionaries({}, optional={"user_id": texts})),
}
_VALID_BLOCKS = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, texts),
    st.builds(
        lambda i, n, a: {"type": "tool_use", "id": i, "name": n, "input": a},
        st.text(min_size=1, max_size=6),
        st.sampled_from(["f", "get_weather"]) | st.text(min_size=1, max_size=6),
        st.dictionaries(st.text(max_size=4), json_values, max_size=2),
    ),
    st.builds(
        lambda i, c, e: {"type": "tool_result", "tool_use_id": i, "content": c, "is_error": e},
        st.text(min_size=1, max_size=6),
        texts | st.lists(st.builds(lambda t: {"type": "text", "text": t}, texts), max_size=2),
        st.booleans(),
    ),
    st.builds(lambda t, g: {"type": "thinking", "thinking": t, "signature": g}, texts, texts),
)
_VALID_ANTHROPIC_MESSAGES = _anthropic_messages(_VALID_BLOCKS, 5)
_ANTHROPIC_CORE = {"model": st.just("tiny"), "messages": mostly(_ANTHROPIC_MESSAGES)}
MESSAGES_BODIES = (
    st.fixed_dictionaries(
        {**_ANTHROPIC_CORE, "max_tokens": st.integers(min_value=1, max_value=8)},
        optional=_ANTHROPIC_EXTRAS,
    )
    | st.fixed_dictionaries(
        {
            "model": st.just("tiny"),
            "messages": _VALID_ANTHROPIC_MESSAGES,
            "max_tokens": st.integers(min_value=1, max_value=8),
            "stream": st.booleans(),
        },
        optional={
            "tools": st.just([{"name": "f", "input_schema": {"type": "object"}}]),
            "tool_choice": st.sampled_from(
                [{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "f"}, {"type": "none"}]
            ),
            "thinking": st.sampled_from(
                [{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}]
            ),
            "system": texts,
            "stop_sequences": st.lists(texts, max_size=2),
        },
    )
    | bodies(
        sorted(MessagesRequest.model_fields),
        {**_ANTHROPIC_CORE, "max_tokens": st.integers(min_value=1, max_value=8)},
    )
)
COUNT_TOKENS_BODIES = st.fixed_dictionaries(_ANTHROPIC_CORE, optional=_ANTHROPIC_EXTRAS) | bodies(
    sorted(CountTokensRequest.model_fields), _ANTHROPIC_CORE
)

_ids = st.lists(st.integers(min_value=-2, max_value=70_000), max_size=5)
_pooled_inputs = mostly(
    texts | st.lists(texts, min_size=1, max_size=3) | _ids | st.lists(_ids, min_size=1, max_size=3)
)
EMBEDDING_BODIES = bodies(sorted(EmbeddingRequest.model_fields), {"input": _pooled_inputs})
POOLING_BODIES = bodies(sorted(PoolingRequest.model_fields), {"input": _pooled_inputs})
CLASSIFY_BODIES = bodies(sorted(ClassificationRequest.model_fields), {"input": _pooled_inputs})
_documents = mostly(
    texts
    | st.lists(texts, min_size=1, max_size=3)
    | st.fixed_dictionaries(
        {"content": st.lists(_typed(["text", "image_url"], {"text": texts}), max_size=2)}
    )
)
SCORE_BODIES = bodies(
    sorted(ScoreRequest.model_fields),
    {"text_1": _documents, "text_2": _documents},
) | bodies(sorted(ScoreRequest.model_fields), {"queries": _documents, "documents": _documents})
RERANK_BODIES = bodies(
    sorted(RerankRequest.model_fields),
    {
        "query": mostly(texts),
        "documents": mostly(st.lists(texts | st.fixed_dictionaries({"text": texts}), max_size=4)),
    },
)
GENERATIVE_SCORING_BODIES = bodies(
    sorted(GenerativeScoringRequest.model_fields),
    {
        "query": mostly(texts | _ids),
        "items": mostly(st.lists(texts, max_size=3) | st.lists(_ids, max_size=3)),
        "label_token_ids": mostly(_ids),
    },
)
COHERE_EMBED_BODIES = bodies(
    sorted(CohereEmbedRequest.model_fields),
    {
        "texts": mostly(st.lists(texts, max_size=3)),
        "embedding_types": mostly(
            st.lists(
                st.sampled_from(["float", "binary", "ubinary", "int8", "uint8", "base64"]),
                max_size=3,
            )
        ),
        "input_type": st.sampled_from(["search_query", "search_document", "classification"]),
    },
)
DETOKENIZE_BODIES = bodies(["model", "tokens"], {"tokens": mostly(_ids)})
CHAT_BATCH_BODIES = bodies(
    sorted(ChatCompletionRequest.model_fields),
    {
        "messages": mostly(st.lists(messages, min_size=1, max_size=3)),
        "max_tokens": st.integers(min_value=1, max_value=8),
    },
)


NEVER_STREAMED = {"/v1/messages/count_tokens"}
"""Routes that answer one JSON object whatever `stream` says."""


def stream_ended(path: str, text: str) -> bool:
    """Whether a route's stream ended as its API ends one: OpenAI's `data: [DONE]`; the
    Responses API's terminal event; Anthropic's `message_stop` (or its `error` event);
    TGI's (on /invocations) the event whose `generated_text` is set."""
    last_event = text.rstrip().rpartition("event: ")[2].partition("\n")[0]
    if path == "/v1/responses":
        return last_event in ("response.completed", "response.incomplete", "response.failed")
    if path == "/v1/messages":
        return last_event in ("message_stop", "error")
    last_line = text.rstrip().rpartition("\n")[2]
    if path == "/invocations" and '"generated_text":"' in last_line:
        return True  # TGI's stream ends with the event that carries generated_text
    return last_line == "data: [DONE]"


def check(client, engine, path: str, body: Any) -> None:
    result = client.simulate_post(path, json=body)
    assert result.status_code < 500, (path, body, result.status_code, result.text[:300])
    if result.status_code >= 400 and path.startswith("/v1/messages"):
        assert result.json.keys() == {"type", "error"}, result.json
        assert result.json["error"]["type"] == ANTHROPIC_ERROR_TYPES[result.status_code]
    elif result.status_code >= 400:
        error = result.json["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["code"] == result.status_code
    elif path.endswith("/render"):  # never a stream: the request a stream would run
        assert isinstance(result.json, dict | list), result.text[:200]
    elif isinstance(body, dict) and body.get("stream") is True and path not in NEVER_STREAMED:
        assert stream_ended(path, result.text), result.text[-300:]
    assert engine.live == set(), (path, body)
    assert engine.num_in_flight == 0


@pytest.mark.parametrize(
    ("path", "strategy"),
    [
        ("/v1/chat/completions", CHAT_BODIES),
        ("/v1/completions", COMPLETION_BODIES),
        ("/invocations", TGI_BODIES),
        ("/tokenize", TOKENIZE_BODIES),
        ("/inference/v1/generate", GENERATE_BODIES),
        ("/v1/chat/completions/render", CHAT_BODIES),
        ("/v1/completions/render", COMPLETION_BODIES),
        ("/v1/chat/completions/derender", DERENDER_CHAT_BODIES),
        ("/v1/completions/derender", DERENDER_COMPLETION_BODIES),
        ("/v1/responses", RESPONSES_BODIES),
        ("/v1/responses/render", RESPONSES_BODIES),
        ("/v1/messages", MESSAGES_BODIES),
        ("/v1/messages/render", MESSAGES_BODIES),
        ("/v1/messages/count_tokens", COUNT_TOKENS_BODIES),
        ("/v1/embeddings", EMBEDDING_BODIES),
        ("/pooling", POOLING_BODIES),
        ("/classify", CLASSIFY_BODIES),
        ("/score", SCORE_BODIES),
        ("/rerank", RERANK_BODIES),
        ("/generative_scoring", GENERATIVE_SCORING_BODIES),
        ("/v2/embed", COHERE_EMBED_BODIES),
        ("/detokenize", DETOKENIZE_BODIES),
        ("/v1/chat/completions/batch", CHAT_BATCH_BODIES),
    ],
    ids=[
        "chat",
        "completions",
        "tgi",
        "tokenize",
        "generate",
        "chat-render",
        "completion-render",
        "chat-derender",
        "completion-derender",
        "responses",
        "responses-render",
        "messages",
        "messages-render",
        "count-tokens",
        "embeddings",
        "pooling",
        "classify",
        "score",
        "rerank",
        "generative-scoring",
        "cohere-embed",
        "detokenize",
        "chat-batch",
    ],
)
def test_no_body_makes_a_500_or_leaks(client, engine, path: str, strategy) -> None:
    @FUZZ
    @given(body=strategy)
    def run(body: Any) -> None:
        check(client, engine, path, body)

    run()


@FUZZ
@given(body=CHAT_BODIES | COMPLETION_BODIES)
def test_invocations_dispatch_never_500s(client, engine, body: Any) -> None:
    check(client, engine, "/invocations", body)


# -- issue 17: hostile inputs ----------------------------------------------------------
HOSTILE = settings(FUZZ, max_examples=40)
"""Fewer examples: each body is large (up to a few MB) or slow on purpose."""


def _nested_text(levels: int, key: str, leaf: str) -> str:
    return f'{{"type":"array","{key}":' * levels + leaf + "}" * levels


schema_texts = st.builds(
    _nested_text,
    st.integers(min_value=1, max_value=3000),
    st.sampled_from(["items", "additionalProperties", "not"]),
    st.sampled_from(['{"type":"string"}', "true", "{}", '{"$ref":"#"}']),
) | st.text(max_size=40)
SCHEMA_TEXT_BODIES = st.one_of(
    st.builds(
        lambda s: ("/v1/chat/completions", {"messages": USER, "guided_json": s}), schema_texts
    ),
    st.builds(
        lambda s: ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": s}}),
        schema_texts,
    ),
    st.builds(
        lambda s: (
            "/invocations",
            {"inputs": "hi", "parameters": {"grammar": {"type": "json", "value": s}}},
        ),
        schema_texts,
    ),
    st.builds(
        lambda s: (
            "/v1/chat/completions",
            {"messages": USER, "structured_outputs": {"structural_tag": s}},
        ),
        schema_texts,
    ),
)
MANY_MESSAGE_BODIES = st.builds(
    lambda n, parts, path: (
        path,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * parts}] * n},
    ),
    st.integers(min_value=1, max_value=6000),
    st.integers(min_value=1, max_value=8),
    st.sampled_from(["/v1/chat/completions", "/tokenize"]),
)
HUGE_PROMPT_BODIES = st.builds(
    lambda size, char, route: (
        route[0],
        route[1]("".join([char]) * size),
    ),
    st.integers(min_value=1, max_value=400_000) | st.integers(min_value=2_000, max_value=20_000),
    st.sampled_from(["a", " ", "é", "🌍", "<|im_start|>", "\n"]),
    st.sampled_from(
        [
            ("/v1/completions", lambda t: {"prompt": t, "max_tokens": 1}),
            ("/v1/chat/completions", lambda t: {"messages": [{"role": "user", "content": t}]}),
            ("/invocations", lambda t: {"inputs": t}),
            ("/tokenize", lambda t: {"prompt": t}),
        ]
    ),
)
MANY_CONTAINER_BODIES = st.builds(
    lambda n, leaf, where, path: (
        path,
        {"messages": USER, "prompt": "hi", where: [leaf] * n},
    ),
    st.integers(min_value=1, max_value=150_000),
    st.sampled_from([[], {}, [[]], {"a": []}, [{}, {}]]),
    st.sampled_from(["metadata", "logit_bias", "stop", "tools", "messages"]),
    st.sampled_from(["/v1/chat/completions", "/v1/completions", "/tokenize", "/invocations"]),
)
USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "strategy",
    [SCHEMA_TEXT_BODIES, MANY_MESSAGE_BODIES, HUGE_PROMPT_BODIES, MANY_CONTAINER_BODIES],
    ids=["schema-texts", "many-messages", "huge-prompts", "many-containers"],
)
def test_hostile_bodies_are_refused_cleanly(client, engine, strategy) -> None:
    @HOSTILE
    @given(case=strategy)
    def run(case: tuple[str, Any]) -> None:
        path, body = case
        check(client, engine, path, body)

    run()


loop_templates = st.builds(
    lambda depth, literal: (
        "{% set s = " + literal + " %}" + "{% for a in s %}" * depth + "{% endfor %}" * depth + "ok"
    ),
    st.integers(min_value=1, max_value=4),
    st.sampled_from(["'x' * 100000", "[0] * 100000", "'abc'", "range(100000)"]),
)


@pytest.mark.timeout(300)
def test_request_template_loops_end_in_time_or_a_400(make_client, engine) -> None:
    client = make_client(trust_request_chat_template=True)

    @settings(FUZZ, max_examples=8)
    @given(template=loop_templates)
    def run(template: str) -> None:
        check(client, engine, "/v1/chat/completions", {"messages": USER, "chat_template": template})

    run()
