"""A choice hides its stop token's text on the engine's word (`finished_on_stop_token`),
whatever the token is: the worker keeps no EOS list of its own (issue 15)."""

from __future__ import annotations

import pytest
from handlers_testing import encode

from engine.messages import RequestOutput
from engine.tokenizer import Tokenizer
from handlers.serving.choice import Choice, ChoiceOptions


def _finish(tokenizer: Tokenizer, options: ChoiceOptions, on_stop_token: bool) -> str:
    ids = encode(tokenizer, "Hello world")
    choice = Choice(0, tokenizer, options)
    choice.process(
        RequestOutput(
            request_id="r",
            new_token_ids=ids,
            finish_reason="stop",
            finished_on_stop_token=on_stop_token,
        )
    )
    assert choice.token_ids == ids  # the token counts either way (usage, logprobs)
    return choice.text


@pytest.mark.parametrize("include", [False, True])
def test_the_last_token_is_hidden_only_when_the_engine_says_it_stopped_on_it(
    tokenizer: Tokenizer, include: bool
) -> None:
    options = ChoiceOptions(include_stop_str_in_output=include)
    ids = encode(tokenizer, "Hello world")
    whole = tokenizer.decode(ids)
    without_last = tokenizer.decode(ids[:-1])
    assert whole != without_last
    assert _finish(tokenizer, options, on_stop_token=False) == whole
    assert _finish(tokenizer, options, on_stop_token=True) == (whole if include else without_last)
