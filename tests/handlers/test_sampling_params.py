"""SamplingParams are built in one place (`make_sampling_params`): chat, completion and
TGI requests get the same model checks and the same numerical-safety clamps (issue 15)."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine

from handlers.errors import BadRequestError
from handlers.protocol.sampling import (
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    make_sampling_params,
)

pytestmark = pytest.mark.anyio

TINY = {"temperature": 1e-4, "top_p": 1e-12, "repetition_penalty": 1e-12}
"""Valid on every API, and each one below the float32-safe floor."""

BODIES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **TINY}),
    "completion": ("/v1/completions", {"prompt": "hi", **TINY}),
    "tgi": ("/invocations", {"inputs": "hi", "parameters": {"do_sample": True, **TINY}}),
}


@pytest.mark.parametrize("api", sorted(BODIES))
def test_every_api_gets_the_same_safety_clamps(client, engine: FakeEngine, api: str) -> None:
    path, body = BODIES[api]
    assert client.simulate_post(path, json=body).status_code == 200
    params = engine.added[0].params
    assert (params.temperature, params.top_p, params.repetition_penalty) == (
        MIN_TEMPERATURE,
        MIN_TOP_P,
        MIN_REPETITION_PENALTY,
    )


def test_greedy_stays_greedy_and_top_k_zero_is_off() -> None:
    params = make_sampling_params(max_tokens=4, vocab_size=10, temperature=0.0, top_k=0)
    assert params.temperature == 0.0 and params.top_k == -1


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stop_token_ids": [10]}, "stop_token_ids"),
        ({"logit_bias": {"10": 1.0}}, "logit_bias"),
        ({"min_tokens": 5}, "min_tokens"),
    ],
)
def test_model_checks_name_the_field(fields: dict, param: str) -> None:
    with pytest.raises(BadRequestError) as info:
        make_sampling_params(max_tokens=4, vocab_size=10, **fields)
    assert info.value.param == param


def test_token_ids_and_bias_reach_the_engine_as_ints() -> None:
    params = make_sampling_params(
        max_tokens=4, vocab_size=10, stop_token_ids=[9], logit_bias={"9": -5}
    )
    assert params.stop_token_ids == [9] and params.logit_bias == {9: -5.0}
