"""A real `hearth serve` on a tiny random-weight sequence classifier with one label (a
decoder reranker's shape, Qwen3ForSequenceClassification): `/classify` gives
transformers' sigmoid of the head's logit, `/score` and `/rerank` (raw HTTP and the
unmodified Cohere SDK) are cross-encoder scores of the joined query and document, equal
to transformers' on the same text, a score template given with `--chat-template`
composes the pair with the request's `instruction`, and generation routes refuse the
model with a 400 naming `model`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cohere
import httpx
import numpy as np
import pytest
import torch

from engine.tokenizer import Tokenizer
from tests.e2e.clients import TIMEOUT, assert_openai_error, client, wait_metric
from tests.e2e.server import Server, start_server
from tests.engine.tiny_models import save_servable_classifier

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "bananas are yellow", "the eiffel tower", "hello"]
SCORE_TEMPLATE = (
    "{{ instruction | default('Judge') }}: "
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path, Server]]:
    directory = tmp_path_factory.mktemp("reranker")
    hf = save_servable_classifier("qwen3", directory, 1)
    template = directory / "score_template.jinja"
    template.write_text(SCORE_TEMPLATE)
    server = start_server(
        tmp_path_factory.mktemp("reranker-logs"), str(directory), "--served-model-name", "tiny",
        "--max-model-len", "128", "--chat-template", str(template),
    )  # fmt: skip
    yield hf, directory, server
    server.stop()


@pytest.fixture(scope="module")
def plain_reranker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path, Server]]:
    directory = tmp_path_factory.mktemp("plain-reranker")
    hf = save_servable_classifier("llama-gqa-tied", directory, 1)
    server = start_server(
        tmp_path_factory.mktemp("plain-logs"), str(directory), "--served-model-name", "tiny",
        "--max-model-len", "128",
    )  # fmt: skip
    yield hf, directory, server
    server.stop()


def logits(hf: Any, directory: Path, texts: list[str]) -> np.ndarray:
    tokenizer = Tokenizer(directory)
    with torch.inference_mode():
        return np.array(
            [
                hf(torch.tensor([tokenizer.encode(t, add_special_tokens=True)])).logits[0, 0].item()
                for t in texts
            ]
        )


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def test_classify_is_transformers_sigmoid(plain_reranker) -> None:
    hf, directory, server = plain_reranker
    r = httpx.post(server.url + "/classify", json={"model": "tiny", "input": DOCS}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("classify-") and body["object"] == "list"
    probs = np.array([d["probs"][0] for d in body["data"]])
    assert all(d["num_classes"] == 1 and d["label"] == "LABEL_0" for d in body["data"])
    expected = sigmoid(logits(hf, directory, DOCS))
    print(f"\nclassify vs transformers: max |d| = {np.abs(probs - expected).max():.1e}")
    assert np.abs(probs - expected).max() <= 1e-5
    raw = httpx.post(server.url + "/classify", json={"input": DOCS[0], "use_activation": False},
                     timeout=TIMEOUT).json()  # fmt: skip
    assert raw["data"][0]["probs"][0] == pytest.approx(logits(hf, directory, DOCS[:1])[0], abs=1e-5)


def test_cross_encoder_scores_are_transformers(plain_reranker) -> None:
    """No score template: each pair is the query and the document joined, vLLM's
    default for a decoder reranker; rerank orders by the same scores."""
    hf, directory, server = plain_reranker
    expected = sigmoid(logits(hf, directory, [QUERY + d for d in DOCS]))
    r = httpx.post(server.url + "/score", json={"text_1": QUERY, "text_2": DOCS}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    got = np.array([d["score"] for d in r.json()["data"]])
    assert np.abs(got - expected).max() <= 1e-5
    co = cohere.ClientV2(api_key="unused", base_url=server.url)
    out = co.rerank(model="tiny", query=QUERY, documents=DOCS, top_n=2)
    assert [x.index for x in out.results] == np.argsort(-expected, kind="stable")[:2].tolist()
    r = httpx.post(server.url + "/rerank", json={"query": QUERY, "documents": DOCS,
                   "instruction": "Judge"}, timeout=TIMEOUT)  # fmt: skip
    assert_openai_error(r, 400, "instruction")
    assert wait_metric(server, "hearth:kv_cache_used_blocks", 0) == 0


def test_the_score_template_composes_each_pair(reranker) -> None:
    hf, directory, server = reranker
    body = {"queries": QUERY, "documents": DOCS[:2], "instruction": "Rank"}
    r = httpx.post(server.url + "/score", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    texts = [f"Rank: <query>{QUERY}</query><document>{d}</document>" for d in DOCS[:2]]
    expected = sigmoid(logits(hf, directory, texts))
    assert np.abs(np.array([d["score"] for d in r.json()["data"]]) - expected).max() <= 1e-5


def test_generation_is_refused(reranker) -> None:
    _, _, server = reranker
    for path, body in (
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/embeddings", {"input": "hi"}),
    ):
        r = httpx.post(server.url + path, json=body, timeout=TIMEOUT)
        assert_openai_error(r, 400, "model")
    assert [m.id for m in client(server).models.list().data] == ["tiny"]
