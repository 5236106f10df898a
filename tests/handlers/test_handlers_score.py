"""vLLM's score (`/score`, `/v1/score`) and rerank (`/rerank`, `/v1/rerank`, `/v2/rerank`)
APIs over the scripted engine: each distinct text is embedded once, a pair's score is the
cosine similarity of the engine's two vectors (computed here independently), rerank
orders by it, the per-side truncations reach the engine, and every malformed body is a
400 naming its field; the same bodies through /invocations."""

from __future__ import annotations

import math

import msgspec
import pytest
from fake_engine import FakeEngine, fake_embedding
from handlers_testing import EMBEDDING_SIZE, MAX_MODEL_LEN, assert_openai_error

from engine.tokenizer import Tokenizer

QUERY = "What is the capital of France?"
DOCS = [
    "The capital of Brazil is Brasilia.",
    "The capital of France is Paris.",
    "Bananas are yellow.",
    "Paris is in France.",
]
SPELLINGS = [
    ("text_1", "text_2"),
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
]


def cosine(a: list[float], b: list[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b)))


def vector(tokenizer: Tokenizer, text: str) -> list[float]:
    return fake_embedding(tokenizer.encode(text, add_special_tokens=True), EMBEDDING_SIZE)


def expected_scores(tokenizer: Tokenizer, query: str, docs: list[str]) -> list[float]:
    return [cosine(vector(tokenizer, query), vector(tokenizer, doc)) for doc in docs]


@pytest.mark.parametrize("route", ["/score", "/v1/score"])
@pytest.mark.parametrize(("first", "second"), SPELLINGS)
def test_one_against_many(
    client, engine: FakeEngine, tokenizer: Tokenizer, route: str, first: str, second: str
) -> None:
    result = client.simulate_post(route, json={"model": "tiny", first: QUERY, second: DOCS})
    assert result.status_code == 200, result.text
    body = result.json
    assert body["id"].startswith("score-") and body["object"] == "list"
    assert body["model"] == "tiny"
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    assert {d["object"] for d in body["data"]} == {"score"}
    for got, want in zip(body["data"], expected_scores(tokenizer, QUERY, DOCS), strict=True):
        assert got["score"] == pytest.approx(want, abs=1e-6)
    # The query is embedded once, then each document, each as a pooling request.
    prompts = [added.prompt_token_ids for added in engine.added]
    assert prompts == [tokenizer.encode(t, add_special_tokens=True) for t in [QUERY, *DOCS]]
    assert all(added.pooling is not None for added in engine.added)
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts)) == body["usage"]["total_tokens"]
    assert body["usage"]["completion_tokens"] == 0
    assert engine.live == set()


def test_pairwise_and_one_to_one(client, tokenizer: Tokenizer) -> None:
    queries = ["Paris", "yellow fruit"]
    docs = ["The capital of France is Paris.", "Bananas are yellow."]
    body = client.simulate_post("/score", json={"text_1": queries, "text_2": docs}).json
    want = [
        cosine(vector(tokenizer, q), vector(tokenizer, d))
        for q, d in zip(queries, docs, strict=True)
    ]
    assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-6)
    one = client.simulate_post("/score", json={"text_1": queries[1], "text_2": [docs[1]]}).json
    assert [d["score"] for d in one["data"]] == pytest.approx(want[1:], abs=1e-6)


@pytest.mark.parametrize("route", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_by_score(client, tokenizer: Tokenizer, route: str) -> None:
    result = client.simulate_post(route, json={"model": "tiny", "query": QUERY, "documents": DOCS})
    assert result.status_code == 200, result.text
    body = result.json
    assert set(body) == {"id", "model", "usage", "results"}
    assert body["id"].startswith("rerank-") and body["model"] == "tiny"  # vLLM's prefix
    scores = expected_scores(tokenizer, QUERY, DOCS)
    order = sorted(range(len(DOCS)), key=lambda i: -scores[i])
    assert [r["index"] for r in body["results"]] == order
    for r in body["results"]:
        assert r["relevance_score"] == pytest.approx(scores[r["index"]], abs=1e-6)
        assert r["document"] == {"text": DOCS[r["index"]]}
    tokens = sum(len(tokenizer.encode(t, add_special_tokens=True)) for t in [QUERY, *DOCS])
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_rerank_top_n_text_objects_and_no_documents(client, tokenizer: Tokenizer) -> None:
    scores = expected_scores(tokenizer, QUERY, DOCS)
    best = sorted(range(len(DOCS)), key=lambda i: -scores[i])[:2]
    body = client.simulate_post(
        "/rerank",
        json={
            "query": QUERY,
            "documents": [{"text": d} for d in DOCS],
            "top_n": 2,
            "return_documents": False,
        },
    ).json
    assert [r["index"] for r in body["results"]] == best
    assert all(r["document"] is None for r in body["results"])
    everything = client.simulate_post(
        "/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 9}
    )
    assert len(everything.json["results"]) == len(DOCS)


def test_per_side_truncation_reaches_the_engine(
    client, engine: FakeEngine, tokenizer: Tokenizer
) -> None:
    long_query = "one two three four five six seven eight nine ten"
    long_doc = "alpha beta gamma delta epsilon zeta eta theta iota kappa"
    result = client.simulate_post(
        "/score",
        json={
            "queries": long_query,
            "documents": [long_doc, "short"],
            "max_tokens_per_query": 3,
            "max_tokens_per_doc": 4,
        },
    )
    assert result.status_code == 200, result.text
    query_ids = tokenizer.encode(long_query, add_special_tokens=True)
    doc_ids = tokenizer.encode(long_doc, add_special_tokens=True)
    assert len(query_ids) > 3 and len(doc_ids) > 4
    prompts = [added.prompt_token_ids for added in engine.added]
    assert prompts == [
        query_ids[:3],
        doc_ids[:4],
        tokenizer.encode("short", add_special_tokens=True),
    ]
    # truncate_prompt_tokens then cuts what the per-side limit kept, on its side.
    engine.added.clear()
    result = client.simulate_post(
        "/score",
        json={
            "queries": long_query,
            "documents": long_doc,
            "max_tokens_per_doc": 4,
            "truncate_prompt_tokens": 2,
        },
    )
    assert result.status_code == 200, result.text
    assert [added.prompt_token_ids for added in engine.added] == [query_ids[-2:], doc_ids[2:4]]


def test_cache_salt_and_priority_reach_the_engine(client, engine: FakeEngine) -> None:
    result = client.simulate_post(
        "/rerank", json={"query": QUERY, "documents": DOCS[:2], "cache_salt": "s", "priority": 3}
    )
    assert result.status_code == 200, result.text
    assert {(a.cache_salt, a.priority) for a in engine.added} == {("s", 3)}


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
        ("/score", {"text_1": [], "text_2": ["c"]}, "text_1"),
        ("/score", {"text_1": "a"}, "text_1"),
        ("/score", {"text_1": "a", "text_2": "b", "queries": "c", "documents": "d"}, "documents"),
        ("/score", {"queries": "a", "documents": "b", "items": "c"}, "documents"),
        ("/score", {"text_1": "a", "text_2": ["b", 3]}, "text_2[1]"),
        (
            "/score",
            {"text_1": {"content": [{"type": "text", "text": "a"}]}, "text_2": "b"},
            "text_1",
        ),
        ("/score", {"text_1": "a", "text_2": "b", "instruction": "Judge relevance"}, "instruction"),
        (
            "/score",
            {"text_1": "a", "text_2": "b", "chat_template_kwargs": {"x": 1}},
            "chat_template_kwargs",
        ),
        ("/score", {"text_1": "a", "text_2": "b", "padding": "max_length"}, "padding"),
        ("/score", {"text_1": "a", "text_2": "b", "max_tokens_per_doc": -1}, "max_tokens_per_doc"),
        (
            "/score",
            {"text_1": "a", "text_2": "b", "max_tokens_per_query": MAX_MODEL_LEN},
            "max_tokens_per_query",
        ),
        (
            "/score",
            {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0},
            "truncate_prompt_tokens",
        ),
        (
            "/score",
            {"text_1": "a", "text_2": "b", "mm_processor_kwargs": {"a": 1}},
            "mm_processor_kwargs",
        ),
        ("/score", {"text_1": "a", "text_2": ""}, "text_2"),
        ("/rerank", {"query": "a"}, "documents"),
        ("/rerank", {"query": "a", "documents": []}, "documents"),
        ("/rerank", {"query": "a", "documents": ["b", {"content": []}]}, "documents[1]"),
        ("/rerank", {"query": "a", "documents": [{"txt": "b"}]}, "documents[0]"),
        ("/rerank", {"query": ["a"], "documents": ["b"]}, "query"),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
        (
            "/rerank",
            {"query": "a", "documents": ["b"], "return_documents": "yes"},
            "return_documents",
        ),
    ],
)
def test_bad_bodies_are_400_naming_the_field(
    client, engine: FakeEngine, route, body, param
) -> None:
    result = client.simulate_post(route, json=body)
    assert_openai_error(result, 400, param)
    assert engine.live == set()


def test_too_many_inputs(client) -> None:
    docs = ["x"] * 1024
    assert_openai_error(
        client.simulate_post("/rerank", json={"query": "q", "documents": docs}), 400, "documents"
    )
    assert_openai_error(
        client.simulate_post("/score", json={"text_1": docs[:600], "text_2": docs[:600]}),
        400,
        "text_2",
    )


def test_unknown_model_and_no_embeddings(client, engine: FakeEngine) -> None:
    assert_openai_error(
        client.simulate_post("/score", json={"model": "other", "text_1": "a", "text_2": "b"}),
        404,
        "model",
    )
    engine.info = msgspec.structs.replace(engine.info, pooling=None)
    assert_openai_error(
        client.simulate_post("/rerank", json={"query": "a", "documents": ["b"]}), 400, "model"
    )
    assert engine.added == []


def test_invocations_dispatches_score_and_rerank(client, tokenizer: Tokenizer) -> None:
    rerank = client.simulate_post(
        "/invocations", json={"query": QUERY, "documents": DOCS, "top_n": 1}
    )
    assert rerank.status_code == 200, rerank.text
    scores = expected_scores(tokenizer, QUERY, DOCS)
    assert [r["index"] for r in rerank.json["results"]] == [max(range(4), key=lambda i: scores[i])]
    score = client.simulate_post("/invocations", json={"queries": QUERY, "documents": DOCS})
    assert score.status_code == 200, score.text
    assert [d["score"] for d in score.json["data"]] == pytest.approx(scores, abs=1e-6)
    bad = client.simulate_post("/invocations", json={"text_1": "a"})
    assert_openai_error(bad, 400, "text_1")
