"""Cohere's `POST /v2/embed` over the scripted engine: one vector per text in every
asked type (float, base64, binary, ubinary, checked against numpy here), the truncate
modes reaching the engine, input_type selecting the model's task prefix, and bad bodies
as 400s naming the field."""

from __future__ import annotations

import base64

import msgspec
import numpy as np
import pytest
from fake_engine import FakeEngine, fake_embedding
from handlers_testing import EMBEDDING_SIZE, assert_openai_error

from engine.tokenizer import Tokenizer

EMBED = "/v2/embed"
TEXTS = ["The capital of France is Paris.", "Bananas are yellow."]


def vector(tokenizer: Tokenizer, text: str) -> np.ndarray:
    ids = tokenizer.encode(text, add_special_tokens=True)
    return np.array(fake_embedding(ids, EMBEDDING_SIZE), dtype=np.float32)


def test_every_type_carries_the_same_vectors(client, engine: FakeEngine, tokenizer) -> None:
    body = {"model": "tiny", "texts": TEXTS, "input_type": "search_document",
            "embedding_types": ["float", "base64", "binary", "ubinary"]}  # fmt: skip
    result = client.simulate_post(EMBED, json=body)
    assert result.status_code == 200, result.text
    out = result.json
    assert out["response_type"] == "embeddings_by_type" and out["texts"] == TEXTS
    expected = np.stack([vector(tokenizer, t) for t in TEXTS])
    emb = out["embeddings"]
    assert set(emb) == {"float", "base64", "binary", "ubinary"}
    assert np.array_equal(np.array(emb["float"], dtype=np.float32), expected)
    decoded = [np.frombuffer(base64.b64decode(b), dtype="<f4") for b in emb["base64"]]
    assert np.array_equal(np.stack(decoded), expected)
    bits = np.packbits(expected >= 0, axis=-1)
    assert emb["ubinary"] == bits.tolist()
    assert emb["binary"] == (bits.astype(np.int16) - 128).tolist()
    tokens = sum(len(tokenizer.encode(t, add_special_tokens=True)) for t in TEXTS)
    assert out["meta"]["billed_units"]["input_tokens"] == tokens
    only_float = client.simulate_post(EMBED, json={"texts": TEXTS[:1]}).json["embeddings"]
    assert set(only_float) == {"float"}


def test_truncate_modes_reach_the_engine(client, engine: FakeEngine, tokenizer) -> None:
    text = "one two three four five six seven eight"
    ids = tokenizer.encode(text, add_special_tokens=True)
    assert len(ids) > 3
    for truncate, kept in (("END", ids[:3]), ("START", ids[-3:])):
        engine.added.clear()
        body = {"texts": [text], "truncate": truncate, "max_tokens": 3}
        assert client.simulate_post(EMBED, json=body).status_code == 200
        assert engine.added[0].prompt_token_ids == kept
    result = client.simulate_post(
        EMBED, json={"texts": [text], "truncate": "NONE", "max_tokens": 3}
    )
    assert_openai_error(result, 400, "texts")


def test_input_type_selects_the_model_s_prefix(client, engine: FakeEngine, tokenizer) -> None:
    prompts = {"query": "Query: ", "document": "Doc: "}
    engine.info = msgspec.structs.replace(
        engine.info, pooling=msgspec.structs.replace(engine.info.pooling, prompts=prompts)
    )
    for input_type, prefix in (("search_query", "Query: "), ("document", "Doc: ")):
        engine.added.clear()
        body = {"texts": TEXTS[:1], "input_type": input_type}
        assert client.simulate_post(EMBED, json=body).status_code == 200
        assert engine.added[0].prompt_token_ids == tokenizer.encode(prefix + TEXTS[0])
    bad = client.simulate_post(EMBED, json={"texts": TEXTS, "input_type": "clustering"})
    assert_openai_error(bad, 400, "input_type")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "texts"),
        ({"texts": []}, "texts"),
        ({"texts": ["a"], "inputs": [{"content": [{"type": "text", "text": "a"}]}]}, "texts"),
        ({"images": ["data:image/png;base64,AAAA"]}, "images"),
        (
            {"inputs": [{"content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "inputs[0].content[0]",
        ),
        ({"texts": ["a"], "embedding_types": ["int8"]}, "embedding_types[0]"),
        ({"texts": ["a"], "embedding_types": ["bits"]}, "embedding_types[0]"),
        ({"texts": ["a"], "truncate": "MIDDLE"}, "truncate"),
        ({"texts": ["a"], "output_dimension": 4}, "dimensions"),
        ({"texts": ["a"], "max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_bodies(client, engine: FakeEngine, body, param) -> None:
    assert_openai_error(client.simulate_post(EMBED, json=body), 400, param)
    assert engine.added == []


def test_inputs_text_parts_are_joined(client, engine: FakeEngine, tokenizer) -> None:
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}]
    result = client.simulate_post(EMBED, json={"inputs": [{"content": parts}]})
    assert result.status_code == 200, result.text
    assert engine.added[0].prompt_token_ids == tokenizer.encode("Hello world")


def test_invocations_dispatches_a_texts_body(client, engine: FakeEngine, tokenizer) -> None:
    result = client.simulate_post(
        "/invocations", json={"texts": TEXTS[:1], "input_type": "search_query"}
    )
    assert result.status_code == 200, result.text
    assert result.json["response_type"] == "embeddings_by_type"
    assert result.json["embeddings"]["float"] == [vector(tokenizer, TEXTS[0]).tolist()]
