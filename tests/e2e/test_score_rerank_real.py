"""vLLM's score and rerank APIs through the real server (gunicorn + uvicorn workers +
engine core + the default SmolLM2): `/score` equals the cosine similarity of the
server's own `/v1/embeddings` vectors and of transformers' float32 last-token states;
`/rerank` through the unmodified Cohere SDK (`ClientV2.rerank`, which posts to
`/v2/rerank`) and raw HTTP orders the documents by that score; a SageMaker
`/invocations` rerank body answers the same; a bad body is a 400 naming its field; no
KV block is left behind.
"""

from __future__ import annotations

from typing import Any

import cohere
import httpx
import numpy as np
import pytest

from engine.tokenizer import Tokenizer
from tests.e2e.clients import TIMEOUT, assert_openai_error, client, wait_metric
from tests.e2e.server import Server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

MODEL = "smollm2"
QUERY = "What is the capital of France?"
DOCS = [
    "The capital of Brazil is Brasilia.",
    "The capital of France is Paris.",
    "Bananas are a yellow fruit rich in potassium.",
    "Paris is the largest city of France and sits on the Seine.",
    "def add(a, b):\n    return a + b\n",
]


def embed(server: Server, texts: list[str]) -> np.ndarray:
    out = client(server).embeddings.create(model=MODEL, input=texts, encoding_format="float")
    return np.array([d.embedding for d in sorted(out.data, key=lambda d: d.index)])


def cosines(query: np.ndarray, docs: np.ndarray) -> np.ndarray:
    return docs @ query / (np.linalg.norm(docs, axis=1) * np.linalg.norm(query))


@pytest.fixture(scope="module")
def server_scores(invariant_server: Server) -> np.ndarray:
    vectors = embed(invariant_server, [QUERY, *DOCS])
    return cosines(vectors[0], vectors[1:])


@pytest.fixture(scope="module")
def reference_scores(model_smollm2_dir: str, smollm2_hf_dir: str) -> np.ndarray:
    """transformers (float32): cosines of the final-norm hidden states of each text's
    last token."""
    import torch
    from transformers import AutoModel

    tokenizer = Tokenizer(model_smollm2_dir)
    model = AutoModel.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        rows = [
            model(torch.tensor([tokenizer.encode(t, add_special_tokens=True)]))
            .last_hidden_state[0, -1]
            .numpy()
            for t in [QUERY, *DOCS]
        ]
    return cosines(rows[0], np.stack(rows[1:]))


def test_score_is_the_cosine_of_the_embeddings(
    invariant_server: Server, server_scores: np.ndarray, reference_scores: np.ndarray
) -> None:
    r = httpx.post(
        invariant_server.url + "/score",
        json={"model": MODEL, "text_1": QUERY, "text_2": DOCS},
        timeout=TIMEOUT,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("score-")
    got = np.array([d["score"] for d in sorted(body["data"], key=lambda d: d["index"])])
    print(
        f"\nscores {np.round(got, 4).tolist()}; vs /v1/embeddings max |d| "
        f"{np.abs(got - server_scores).max():.1e}, vs transformers "
        f"{np.abs(got - reference_scores).max():.1e}"
    )
    assert np.abs(got - server_scores).max() <= 1e-6
    assert np.abs(got - reference_scores).max() <= 1e-5
    assert len(set(got.round(6).tolist())) == len(DOCS)  # the scores tell the documents apart
    pairwise = httpx.post(
        invariant_server.url + "/v1/score",
        json={"model": MODEL, "queries": [QUERY, QUERY], "documents": DOCS[:2]},
        timeout=TIMEOUT,
    ).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(got[:2].tolist(), abs=1e-6)


def test_rerank_through_the_cohere_sdk(invariant_server: Server, server_scores: np.ndarray) -> None:
    co = cohere.ClientV2(api_key="unused", base_url=invariant_server.url)
    out = co.rerank(model=MODEL, query=QUERY, documents=DOCS, top_n=3)
    order = np.argsort(-server_scores, kind="stable")[:3].tolist()
    assert [r.index for r in out.results] == order
    assert [r.relevance_score for r in out.results] == pytest.approx(
        server_scores[order].tolist(), abs=1e-6
    )


def test_rerank_raw_and_through_invocations(
    invariant_server: Server, server_scores: np.ndarray
) -> None:
    body = {"model": MODEL, "query": QUERY, "documents": DOCS}
    for path in ("/rerank", "/v1/rerank", "/invocations"):
        r = httpx.post(invariant_server.url + path, json=body, timeout=TIMEOUT)
        assert r.status_code == 200, (path, r.text)
        results: list[dict[str, Any]] = r.json()["results"]
        assert [x["index"] for x in results] == np.argsort(-server_scores, kind="stable").tolist()
        assert [x["document"]["text"] for x in results] == [DOCS[x["index"]] for x in results]
    assert wait_metric(invariant_server, "hearth:kv_cache_used_blocks", 0) == 0


def test_bad_bodies_name_the_field(invariant_server: Server) -> None:
    r = httpx.post(
        invariant_server.url + "/score",
        json={"model": MODEL, "text_1": ["a", "b"], "text_2": ["c", "d", "e"]},
        timeout=TIMEOUT,
    )
    assert_openai_error(r, 400, "text_2")
    r = httpx.post(
        invariant_server.url + "/v2/rerank",
        json={"model": MODEL, "query": QUERY, "documents": [{"content": []}]},
        timeout=TIMEOUT,
    )
    assert_openai_error(r, 400, "documents[0]")


def test_cohere_embed_through_the_sdk(invariant_server: Server) -> None:
    """Cohere's /v2/embed through the unmodified SDK (which always sends input_type):
    float and base64 vectors equal /v1/embeddings', billed tokens counted."""
    co = cohere.ClientV2(api_key="unused", base_url=invariant_server.url)
    out = co.embed(
        model=MODEL, texts=DOCS[:3], input_type="search_document",
        embedding_types=["float", "base64", "ubinary"],
    )  # fmt: skip
    reference = embed(invariant_server, DOCS[:3])
    assert np.array_equal(np.array(out.embeddings.float_), reference.astype(np.float32))
    assert out.embeddings.ubinary == np.packbits(reference >= 0, axis=-1).tolist()
    assert out.meta.billed_units.input_tokens > 0
