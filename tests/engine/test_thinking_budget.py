"""thinking_token_budget in the sampler: a reasoning block is closed by force once it
holds `budget` tokens (the closing tag's ids, one a step, whatever the logits say),
counted from the opening tag in the output or in the prompt; a block the model closes
in time, text after a block, and other rows are untouched."""

from __future__ import annotations

import torch

from engine.request import Request
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams, ThinkingBudget

VOCAB = 32
START, END = [20], [21, 22]  # "<think>" one token, "</think>" two
FAVOURITE = 5  # what the logits always prefer


def generate(
    prompt: list[int],
    budget: int,
    steps: int,
    script: dict[int, int] | None = None,
    spec: ThinkingBudget | None = None,
):
    """Greedy steps where token FAVOURITE always wins unless `script` (output index →
    the token the model "wants" there, by a large logit) says otherwise."""
    spec = spec or ThinkingBudget(budget=budget, start_ids=START, end_ids=END)
    request = Request("r", prompt, SamplingParams(temperature=0, thinking=spec))
    free = Request("free", prompt, SamplingParams(temperature=0))
    sampler = Sampler(torch.device("cpu"))
    for step in range(steps):
        logits = torch.zeros(2, VOCAB)
        logits[:, FAVOURITE] = 5.0
        if script and step in script:
            logits[:, script[step]] = 50.0
        out = sampler(logits, [request, free], [0])
        request.all_token_ids.append(out.token_ids[0])
        free.all_token_ids.append(out.token_ids[1])
    return request.output_token_ids, free.output_token_ids


def test_a_block_opened_in_the_output_is_closed_at_the_budget() -> None:
    out, free = generate([1, 2], budget=3, steps=9, script={0: 20})
    assert out == [20, 5, 5, 5, 21, 22, 5, 5, 5]
    assert free == [20, 5, 5, 5, 5, 5, 5, 5, 5]


def test_a_block_closed_in_time_is_untouched() -> None:
    out, _ = generate([1], budget=4, steps=6, script={0: 20, 2: 21, 3: 22})
    assert out == [20, 5, 21, 22, 5, 5]


def test_a_block_opened_by_the_prompt_counts_its_prompt_tokens() -> None:
    out, _ = generate([1, 20, 7], budget=3, steps=5)  # one token of the block in the prompt
    assert out == [5, 5, 21, 22, 5]


def test_budget_zero_closes_at_once_and_a_later_block_counts_afresh() -> None:
    out, _ = generate([1], budget=0, steps=6, script={0: 20, 3: 20})
    assert out == [20, 21, 22, 20, 21, 22]


def test_no_block_no_forcing() -> None:
    out, free = generate([1, 21, 22], budget=0, steps=4)
    assert out == free == [5, 5, 5, 5]


HARMONY = ThinkingBudget(budget=2, start_ids=[20, 23], end_ids=[21], forced_ids=[21, 24, 25])
"""harmony's shape: the block opens with two ids (`<|channel|>analysis<|message|>`), closes
with one (`<|end|>`), and the budget forces the close plus the final answer's header."""


def test_forced_ids_run_past_the_closing_tag() -> None:
    """At the budget the whole forced sequence comes out, then free sampling; the block
    closed at its first id, so no second forcing starts."""
    out, _ = generate([1], budget=2, steps=8, script={0: 20, 1: 23}, spec=HARMONY)
    assert out == [20, 23, 5, 5, 21, 24, 25, 5]


def test_a_harmony_block_closed_in_time_forces_nothing() -> None:
    out, _ = generate([1], budget=2, steps=6, script={0: 20, 1: 23, 2: 21}, spec=HARMONY)
    assert out == [20, 23, 21, 5, 5, 5]
