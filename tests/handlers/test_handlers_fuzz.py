"""Property-based fuzzing of the wire schemas (issue 8): generated bodies for chat,
completions, TGI (/invocations), /tokenize, the token-in-token-out /inference/v1/generate
and the render and derender routes through the production app. Whatever the
body, the answer is a 2xx or a 4xx in OpenAI's error shape: never a 500, never an
exception out of the app, and nothing left running in the engine.

Bodies mix the real field names (so validation goes deep) with random JSON values;
the run is derandomized, so a failure reproduces on every machine."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from handlers.protocol.chat import ChatCompletionRequest
from handlers.protocol.completion import CompletionRequest
from handlers.protocol.derender import DerenderChatRequest, DerenderCompletionRequest
from handlers.protocol.generate import (
    IGNORED_SAMPLING_FIELDS,
    REFUSED_SAMPLING_FIELDS,
    SAMPLING_FIELDS,
    GenerateRequest,
)
from handlers.protocol.tgi import TGIParameters

EXAMPLES = 300
"""Per test; ten tests make 3,000 bodies a run (about 65 s on two shared cores)."""

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
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system"]) | json_values},
        optional={"content": st.text(max_size=30) | json_values, "name": json_values},
    ),
    max_size=3,
)


def bodies(fields: list[str], base: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """Mostly dicts with real field names and a valid core, sometimes anything at all."""
    small_ints = st.integers(min_value=-2, max_value=40)
    field_values = st.dictionaries(
        st.sampled_from(fields), json_values | small_ints | st.booleans(), max_size=6
    )
    shaped = st.builds(
        lambda core, extra: {**core, **extra}, st.fixed_dictionaries(base), field_values
    )
    return shaped | json_values


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
        {"logprob": st.floats(allow_nan=False) | json_values},
        optional={
            "token_id": st.integers(min_value=-1, max_value=70_000) | json_values,
            "token": st.sampled_from(["token_id:5", "token_id:", "token_id:99999999", "x"])
            | json_values,
            "top_logprobs": json_values,
        },
    ),
    max_size=3,
)
GENERATED = st.fixed_dictionaries(
    {
        "request_id": st.text(max_size=5) | json_values,
        "choices": st.lists(
            st.fixed_dictionaries(
                {
                    "index": st.integers(min_value=-1, max_value=3),
                    "token_ids": _token_ids | json_values,
                },
                optional={
                    "logprobs": st.fixed_dictionaries({"content": _logprob_entries | json_values})
                    | json_values,
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


def check(client, engine, path: str, body: Any) -> None:
    result = client.simulate_post(path, json=body)
    assert result.status_code < 500, (path, body, result.status_code, result.text[:300])
    if result.status_code >= 400:
        error = result.json["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["code"] == result.status_code
    elif path.endswith("/render"):  # never a stream: the request a stream would run
        assert isinstance(result.json, dict | list), result.text[:200]
    elif body.get("stream") is True if isinstance(body, dict) else False:
        assert result.text.rstrip().endswith("data: [DONE]"), result.text[-200:]
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
