"""Embeddings through the real server (gunicorn + uvicorn workers + engine core + the
default SmolLM2) with the unmodified `openai` SDK: float and base64 carry the same
vectors, a batch equals its singles, the vectors equal transformers' float32
`last_hidden_state` at the last token, L2-normalised (the documented default for a
causal LM without a sentence-transformers config), usage counts the prompt tokens,
embeddings running beside greedy generation change none of its tokens, and nothing is
left in the KV cache afterwards.
"""

from __future__ import annotations

import base64
import concurrent.futures
import threading
from typing import Any

import httpx
import numpy as np
import pytest

from engine.tokenizer import Tokenizer
from tests.e2e.clients import TIMEOUT, client, wait_metric
from tests.e2e.server import Server

# NOTE: the module's first test may also start the shared server (minutes on a busy
# 2-core host, and pytest-timeout counts fixture setup), hence the longer limit.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

MODEL = "smollm2"
HIDDEN = 576
TOL = 1e-5
"""Largest |hearth - transformers| per component of the unit vectors (measured: 3.3e-7 on
an AVX2 host). The server runs the GGUF fast path (the file's Q4/Q8 blocks times float32
activations, the same weight values transformers dequantizes), so only the order of
float32 sums differs."""
TEXTS = [
    "The capital of France is Paris.",
    "Hello, how are you?",
    "def add(a, b):\n    return a + b\n",
    "请用中文介绍一下长城。",
    " ".join(f"Item {i}: a line of a long list." for i in range(40)),
]


def vectors(response: Any) -> np.ndarray:
    return np.array([d.embedding for d in sorted(response.data, key=lambda d: d.index)])


@pytest.fixture(scope="module")
def tokenizer(model_smollm2_dir: str) -> Tokenizer:
    return Tokenizer(model_smollm2_dir)


@pytest.fixture(scope="module")
def reference(smollm2_hf_dir: str, tokenizer: Tokenizer) -> np.ndarray:
    """transformers (float32): the final-norm hidden state of each text's last token."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
    rows = []
    with torch.inference_mode():
        for text in TEXTS:
            ids = tokenizer.encode(text, add_special_tokens=True)
            last = model(torch.tensor([ids])).last_hidden_state[0, -1]
            rows.append(torch.nn.functional.normalize(last, dim=-1).numpy())
    return np.stack(rows)


@pytest.fixture(scope="module")
def batch(invariant_server: Server) -> Any:
    return client(invariant_server).embeddings.create(
        model=MODEL, input=TEXTS, encoding_format="float"
    )


def test_float_and_base64_are_the_same_vectors(invariant_server: Server, batch: Any) -> None:
    sdk = client(invariant_server)
    floats = vectors(batch)
    assert floats.shape == (len(TEXTS), HIDDEN)
    # The SDK's default: it asks for base64 and decodes it itself.
    decoded_by_sdk = vectors(sdk.embeddings.create(model=MODEL, input=TEXTS))
    raw = sdk.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    decoded_here = np.stack(
        [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in raw.data]
    )
    assert np.array_equal(floats, decoded_by_sdk)
    assert np.array_equal(floats, decoded_here)


def test_a_batch_equals_its_singles(invariant_server: Server, batch: Any) -> None:
    sdk = client(invariant_server)
    singles = np.stack(
        [vectors(sdk.embeddings.create(model=MODEL, input=t, encoding_format="float"))[0]
         for t in TEXTS]
    )  # fmt: skip
    worst = float(np.abs(singles - vectors(batch)).max())
    print(f"\nbatch vs singles: max |difference| = {worst:.2e}")
    assert worst <= 1e-6


def test_matches_transformers_last_token(batch: Any, reference: np.ndarray) -> None:
    got = vectors(batch)
    worst = float(np.abs(got - reference).max())
    cosines = (got * reference).sum(axis=1)
    print(
        f"\nhearth vs transformers: max |difference| = {worst:.2e}, min cosine {cosines.min():.8f}"
    )
    assert worst <= TOL
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


def test_usage_and_token_id_input(
    invariant_server: Server, batch: Any, tokenizer: Tokenizer
) -> None:
    ids = [tokenizer.encode(t, add_special_tokens=True) for t in TEXTS]
    assert batch.usage.prompt_tokens == sum(len(i) for i in ids) == batch.usage.total_tokens
    by_ids = client(invariant_server).embeddings.create(
        model=MODEL, input=ids, encoding_format="float"
    )
    assert np.array_equal(vectors(by_ids), vectors(batch))


def test_dimensions_is_refused_naming_the_field(invariant_server: Server) -> None:
    r = httpx.post(
        invariant_server.v1 + "/embeddings",
        json={"model": MODEL, "input": "x", "dimensions": 64},
        timeout=TIMEOUT,
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "dimensions"


def test_invocations_with_the_task_marker(invariant_server: Server, batch: Any) -> None:
    r = httpx.post(
        invariant_server.url + "/invocations",
        json={"task": "embeddings", "input": TEXTS[0], "encoding_format": "float"},
        timeout=TIMEOUT,
    )
    assert r.status_code == 200, r.text
    assert np.array_equal(np.array(r.json()["data"][0]["embedding"]), vectors(batch)[0])


def _greedy(server: Server) -> tuple[str, list[str]]:
    out = client(server).completions.create(
        model=MODEL, prompt="The three primary colors are", max_tokens=24, temperature=0,
        logprobs=0,
    )  # fmt: skip
    return out.choices[0].text, out.choices[0].logprobs.tokens


def test_embeddings_beside_generation_change_no_token(invariant_server: Server) -> None:
    """Embeddings sent back to back for as long as a greedy completion runs share its
    engine steps; its tokens are the same as when it ran alone."""
    alone = _greedy(invariant_server)
    sdk = client(invariant_server)
    done = threading.Event()

    def keep_embedding() -> int:
        count = 0
        while not done.is_set():
            assert len(sdk.embeddings.create(model=MODEL, input=TEXTS[:3]).data) == 3
            count += 1
        return count

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        embedder = pool.submit(keep_embedding)
        try:
            mixed = _greedy(invariant_server)
        finally:
            done.set()
        assert embedder.result() >= 1
    assert mixed == alone
    assert wait_metric(invariant_server, "hearth:kv_cache_used_blocks", 0) == 0


def test_vllm_extras_on_the_real_server(
    invariant_server: Server, batch: Any, smollm2_hf_dir: str, tokenizer: Tokenizer
) -> None:
    """vLLM's embedding extras: `messages` embeds the rendered conversation (equal to
    embedding its /tokenize ids), `use_activation: false` returns transformers' raw
    last-token state, base64 in float16 / big-endian decodes to the float vector, and
    `/pooling` answers the same vectors in vLLM's pooling shape."""
    import torch
    from transformers import AutoModel

    url = invariant_server.url
    conversation = [{"role": "user", "content": TEXTS[0]}]
    chat = httpx.post(url + "/v1/embeddings", json={"model": MODEL, "messages": conversation},
                      timeout=TIMEOUT)  # fmt: skip
    assert chat.status_code == 200, chat.text
    ids = httpx.post(url + "/tokenize", json={"messages": conversation,
                     "add_generation_prompt": False}, timeout=TIMEOUT).json()["tokens"]  # fmt: skip
    by_ids = client(invariant_server).embeddings.create(
        model=MODEL, input=ids, encoding_format="float"
    )
    assert np.array_equal(np.array(chat.json()["data"][0]["embedding"]), vectors(by_ids)[0])

    raw = httpx.post(url + "/v1/embeddings", json={"model": MODEL, "input": TEXTS[:2],
                     "use_activation": False}, timeout=TIMEOUT).json()  # fmt: skip
    model = AutoModel.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = np.stack([
            model(torch.tensor([tokenizer.encode(t, add_special_tokens=True)]))
            .last_hidden_state[0, -1].numpy()
            for t in TEXTS[:2]
        ])  # fmt: skip
    got = np.array([d["embedding"] for d in raw["data"]])
    scale = float(np.abs(expected).max())
    assert np.abs(got - expected).max() <= TOL * scale
    assert abs(float(np.linalg.norm(got[0])) - 1.0) > 1e-2

    half = httpx.post(url + "/v1/embeddings", json={"model": MODEL, "input": TEXTS[0],
                      "encoding_format": "base64", "embed_dtype": "float16",
                      "endianness": "big"}, timeout=TIMEOUT).json()  # fmt: skip
    decoded = np.frombuffer(base64.b64decode(half["data"][0]["embedding"]), dtype=">f2")
    assert np.array_equal(decoded, vectors(batch)[0].astype(np.float16))

    pooled = httpx.post(url + "/pooling", json={"model": MODEL, "input": TEXTS}, timeout=TIMEOUT)
    assert pooled.status_code == 200, pooled.text
    assert pooled.json()["id"].startswith("pool-")
    assert np.array_equal(np.array([d["data"] for d in pooled.json()["data"]]), vectors(batch))
