"""A sequence classifier over the scripted engine (whose "logits" are `fake_embedding`
of the prompt): `/classify` applies the model's activation (softmax, sigmoid for one
label or multi-label, none for regression or `use_activation: false`) and names the
best label; with one label `/score` and `/rerank` become cross-encoders (one prompt per
pair: the texts joined, or the server's score template); generation routes and other
misuses are 400s naming the field."""

from __future__ import annotations

import math

import msgspec
import pytest
from fake_engine import FakeEngine, fake_embedding
from handlers_testing import assert_openai_error

from engine.pooling_config import ClassifierConfig, PoolingConfig
from engine.tokenizer import Tokenizer

TEXTS = ["The capital of France is Paris.", "Bananas are yellow."]


def make_classifier(engine: FakeEngine, num_labels: int, activation: str = "classify") -> None:
    labels = [f"class-{i}" for i in range(num_labels)]
    classifier = ClassifierConfig(num_labels=num_labels, labels=labels, activation=activation)
    pooling = PoolingConfig(
        normalize=False, classifier=classifier, unsupported="this model is a sequence classifier"
    )
    engine.info = msgspec.structs.replace(engine.info, pooling=pooling)


def logits(tokenizer: Tokenizer, text: str, size: int) -> list[float]:
    return fake_embedding(tokenizer.encode(text, add_special_tokens=True), size)


def softmax(x: list[float]) -> list[float]:
    top = max(x)
    e = [math.exp(v - top) for v in x]
    return [v / sum(e) for v in e]


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


@pytest.mark.parametrize(
    ("activation", "transform"),
    [
        ("classify", softmax),
        ("sigmoid", lambda xs: [sigmoid(v) for v in xs]),
        ("identity", lambda xs: xs),
    ],
)
def test_classify_applies_the_model_s_activation(
    client, engine: FakeEngine, tokenizer: Tokenizer, activation, transform
) -> None:
    make_classifier(engine, 3, activation)
    result = client.simulate_post("/classify", json={"model": "tiny", "input": TEXTS})
    assert result.status_code == 200, result.text
    body = result.json
    assert body["id"].startswith("classify-") and body["object"] == "list"
    for i, (data, text) in enumerate(zip(body["data"], TEXTS, strict=True)):
        want = transform(logits(tokenizer, text, 3))
        assert data["index"] == i and data["num_classes"] == 3
        assert data["probs"] == pytest.approx(want, abs=1e-6)
        assert data["label"] == f"class-{max(range(3), key=lambda k: want[k])}"
    raw = client.simulate_post("/classify", json={"input": TEXTS[0], "use_activation": False})
    assert raw.json["data"][0]["probs"] == pytest.approx(logits(tokenizer, TEXTS[0], 3), abs=1e-6)
    tokens = sum(len(tokenizer.encode(t, add_special_tokens=True)) for t in TEXTS)
    assert body["usage"]["prompt_tokens"] == tokens


def test_one_label_is_a_sigmoid_and_messages_work(client, engine, tokenizer) -> None:
    make_classifier(engine, 1)
    body = client.simulate_post(
        "/classify", json={"messages": [{"role": "user", "content": TEXTS[0]}]}
    ).json
    (added,) = engine.added
    want = sigmoid(fake_embedding(added.prompt_token_ids, 1)[0])
    assert body["data"][0]["probs"] == pytest.approx([want], abs=1e-6)


def test_cross_encoder_score_and_rerank(client, engine: FakeEngine, tokenizer) -> None:
    make_classifier(engine, 1)
    query, docs = "capital of France?", ["Paris.", "Bananas.", "Berlin."]
    result = client.simulate_post("/score", json={"text_1": query, "text_2": docs})
    assert result.status_code == 200, result.text
    want = [sigmoid(logits(tokenizer, query + d, 1)[0]) for d in docs]
    assert [d["score"] for d in result.json["data"]] == pytest.approx(want, abs=1e-6)
    assert [a.prompt_token_ids for a in engine.added] == [
        tokenizer.encode(query + d, add_special_tokens=True) for d in docs
    ]
    rerank = client.simulate_post("/rerank", json={"query": query, "documents": docs, "top_n": 2})
    order = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in rerank.json["results"]] == order
    raw = client.simulate_post("/score", json={"text_1": query, "text_2": docs[:1],
                               "use_activation": False})  # fmt: skip
    assert raw.json["data"][0]["score"] == pytest.approx(logits(tokenizer, query + docs[0], 1)[0])


def test_cross_encoder_cuts_each_text_before_joining(client, engine, tokenizer) -> None:
    make_classifier(engine, 1)
    query, doc = "one two three four five", "alpha beta gamma delta epsilon"
    body = {"text_1": query, "text_2": doc, "max_tokens_per_query": 2, "max_tokens_per_doc": 3}
    assert client.simulate_post("/score", json=body).status_code == 200
    (added,) = engine.added
    kept_q = tokenizer.leading_text(query, 2)
    kept_d = tokenizer.leading_text(doc, 3)
    assert len(tokenizer.encode(kept_q, add_special_tokens=False)) == 2
    assert len(tokenizer.encode(kept_d, add_special_tokens=False)) == 3
    assert query.startswith(kept_q) and doc.startswith(kept_d)
    assert added.prompt_token_ids == tokenizer.encode(kept_q + kept_d, add_special_tokens=True)


@pytest.mark.parametrize(
    ("num_labels", "path", "body", "param"),
    [
        (2, "/score", {"text_1": "a", "text_2": "b"}, "model"),
        (2, "/rerank", {"query": "a", "documents": ["b"]}, "model"),
        (1, "/rerank", {"query": "a", "documents": ["b"], "instruction": "x"}, "instruction"),
        # an empty instruction too, as for a bi-encoder (it was let through here)
        (1, "/rerank", {"query": "a", "documents": ["b"], "instruction": ""}, "instruction"),
        (
            1,
            "/score",
            {"text_1": "a", "text_2": "b", "chat_template_kwargs": {"x": 1}},
            "chat_template_kwargs",
        ),
        (1, "/v1/completions", {"prompt": "hi"}, "model"),
        (1, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
        (1, "/v1/embeddings", {"input": "hi"}, "model"),
        (1, "/pooling", {"input": "hi"}, "model"),
        (1, "/classify", {"input": ""}, "input"),
    ],
)
def test_misuse_is_a_400(client, engine: FakeEngine, num_labels, path, body, param) -> None:
    make_classifier(engine, num_labels)
    assert_openai_error(client.simulate_post(path, json=body), 400, param)
    assert engine.added == []


def test_classify_needs_a_classifier(client, engine: FakeEngine) -> None:
    assert_openai_error(client.simulate_post("/classify", json={"input": "x"}), 400, "model")
    assert_openai_error(
        client.simulate_post("/classify", json={"model": "nope", "input": "x"}), 404, "model"
    )


def test_invocations_input_classifies_on_a_classifier(client, engine, tokenizer) -> None:
    make_classifier(engine, 2)
    result = client.simulate_post("/invocations", json={"input": TEXTS[0]})
    assert result.status_code == 200, result.text
    want = softmax(logits(tokenizer, TEXTS[0], 2))
    assert result.json["data"][0]["probs"] == pytest.approx(want, abs=1e-6)
