"""The engine says why a request stopped, down to whether its last token was the stop
token: the API worker leaves that token's text out on the engine's word alone, never
re-deriving the model's EOS ids, `ignore_eos` or `min_tokens` (issue 15)."""

from __future__ import annotations

from typing import Any

import pytest

from engine.config import EngineConfig
from engine.messages import AddRequest, RequestOutput
from engine.sampling_params import SamplingParams

PROMPT = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def core(model_smollm2_dir: str) -> Any:
    from engine.core import EngineCore

    return EngineCore(
        EngineConfig(model=model_smollm2_dir, max_model_len=128, num_threads=1, seed=0)
    )


def _last_output(core: Any, rid: str, params: SamplingParams) -> RequestOutput:
    assert core.add_request(AddRequest(request_id=rid, prompt_token_ids=PROMPT, params=params))
    last = None
    while core.has_work():
        for _, out in core.step():
            if out.request_id == rid:
                last = out
    assert last is not None and last.finished
    return last


def test_an_eos_stop_is_reported_as_a_stop_token(core: Any) -> None:
    eos = next(iter(core.eos_token_ids))
    params = SamplingParams(temperature=0.0, max_tokens=4, logit_bias={eos: 100.0})
    out = _last_output(core, "eos", params)
    assert (out.finish_reason, out.new_token_ids[-1]) == ("stop", eos)
    assert out.finished_on_stop_token and out.stop_reason is None


def test_a_stop_token_id_is_reported_with_its_id(core: Any) -> None:
    probe = _last_output(core, "probe", SamplingParams(temperature=0.0, max_tokens=1))
    first = probe.new_token_ids[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[first])
    out = _last_output(core, "stop-id", params)
    assert (out.finish_reason, out.stop_reason, out.finished_on_stop_token) == ("stop", first, True)


def test_eos_under_ignore_eos_and_a_length_end_are_no_stop_token(core: Any) -> None:
    eos = next(iter(core.eos_token_ids))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logit_bias={eos: 100.0})
    out = _last_output(core, "ignored", params)
    assert (out.finish_reason, out.new_token_ids[-1]) == ("length", eos)
    assert not out.finished_on_stop_token
