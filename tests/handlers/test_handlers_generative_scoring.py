"""vLLM's `/generative_scoring` over the scripted engine (which reports a named id t at
logprob -1 - t/100): each item is one greedy one-token request on query + item (or item
+ query) asking the labels' logprobs, and the score is the first label's probability,
renormalised over the labels or not; bad bodies are 400s naming the field."""

from __future__ import annotations

import math

import pytest
from fake_engine import FakeEngine
from handlers_testing import assert_openai_error

ROUTE = "/generative_scoring"
LABELS = [7, 30]


def logprob(token_id: int) -> float:
    return -1.0 - token_id / 100


def test_scores_are_the_first_label_s_probability(client, engine: FakeEngine, tokenizer) -> None:
    body = {"model": "tiny", "query": "Is this fruit? ", "items": ["apple", "chair"],
            "label_token_ids": LABELS}  # fmt: skip
    result = client.simulate_post(ROUTE, json=body)
    assert result.status_code == 200, result.text
    out = result.json
    assert out["id"].startswith("generative-scoring-") and out["object"] == "list"
    odds = [math.exp(logprob(t)) for t in LABELS]
    want = odds[0] / sum(odds)
    assert [d["score"] for d in out["data"]] == pytest.approx([want, want])
    assert [d["object"] for d in out["data"]] == ["score", "score"]
    query = tokenizer.encode("Is this fruit? ", add_special_tokens=True)
    for added, item in zip(engine.added, ["apple", "chair"], strict=True):
        assert added.prompt_token_ids == query + tokenizer.encode(item, add_special_tokens=False)
        assert added.params.max_tokens == 1 and added.params.temperature == 0
        assert added.params.logprob_token_ids == LABELS
    assert out["usage"]["completion_tokens"] == 2
    raw = client.simulate_post(ROUTE, json={**body, "apply_softmax": False}).json
    assert raw["data"][0]["score"] == pytest.approx(math.exp(logprob(LABELS[0])))


def test_item_first_and_token_ids(client, engine: FakeEngine) -> None:
    body = {"query": [5, 6], "items": [[9], [10, 11]], "label_token_ids": [3],
            "item_first": True}  # fmt: skip
    assert client.simulate_post(ROUTE, json=body).status_code == 200
    assert [a.prompt_token_ids for a in engine.added] == [[9, 5, 6], [10, 11, 5, 6]]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"query": "q", "items": ["a"], "label_token_ids": []}, "label_token_ids"),
        ({"query": "q", "items": ["a"], "label_token_ids": [-1]}, "label_token_ids"),
        ({"query": "q", "items": ["a"], "label_token_ids": [10**9]}, "label_token_ids"),
        ({"query": "q", "items": [], "label_token_ids": [1]}, "items"),
        ({"query": "q", "items": [1, 2], "label_token_ids": [1]}, "items"),
        ({"query": [], "items": ["a"], "label_token_ids": [1]}, "query"),
        ({"query": "q", "items": [[10**9]], "label_token_ids": [1]}, "items[0]"),
        ({"items": ["a"], "label_token_ids": [1]}, "query"),
    ],
)
def test_bad_bodies(client, engine: FakeEngine, body, param) -> None:
    assert_openai_error(client.simulate_post(ROUTE, json=body), 400, param)
    assert engine.added == []
