"""`POST /v1/embeddings` and its /invocations dispatch over the scripted engine: the wire
shape, float and base64 carrying the same float32 values, batches in order, token-id
input, `dimensions`, usage, and the engine's failures in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import base64
from array import array

import msgspec
import pytest
from fake_engine import FakeEngine, Script, fake_embedding
from handlers_testing import EMBEDDING_SIZE, assert_openai_error, call_asgi, encode

from engine.pooling_config import PoolingConfig
from engine.tokenizer import Tokenizer

EMBEDDINGS = "/v1/embeddings"
TEXTS = ["The capital of France is Paris.", "Hello world!", "banana"]


def set_pooling(engine: FakeEngine, **fields) -> None:
    pooling = PoolingConfig(hidden_size=EMBEDDING_SIZE, **fields)
    engine.info = msgspec.structs.replace(engine.info, pooling=pooling)


def decode_base64(text: str) -> list[float]:
    values = array("f")
    values.frombytes(base64.b64decode(text))
    return values.tolist()


def test_one_text(client, engine: FakeEngine, tokenizer: Tokenizer) -> None:
    result = client.simulate_post(EMBEDDINGS, json={"model": "tiny", "input": TEXTS[0]})
    assert result.status_code == 200, result.text
    body = result.json
    ids = tokenizer.encode(TEXTS[0], add_special_tokens=True)
    assert body["object"] == "list" and body["model"] == "tiny"
    assert body["id"].startswith("embd-")
    assert body["data"] == [
        {"index": 0, "object": "embedding", "embedding": fake_embedding(ids, EMBEDDING_SIZE)}
    ]
    assert body["usage"]["prompt_tokens"] == len(ids) == body["usage"]["total_tokens"]
    assert body["usage"]["completion_tokens"] == 0
    (added,) = engine.added
    assert added.prompt_token_ids == ids
    assert added.pooling is not None and added.pooling.dimensions is None
    assert added.params.max_tokens == 0
    assert engine.live == set()


def test_base64_carries_the_same_float32_values(client) -> None:
    floats = client.simulate_post(EMBEDDINGS, json={"input": TEXTS, "encoding_format": "float"})
    b64 = client.simulate_post(EMBEDDINGS, json={"input": TEXTS, "encoding_format": "base64"})
    assert floats.status_code == b64.status_code == 200
    for as_float, as_b64 in zip(floats.json["data"], b64.json["data"], strict=True):
        assert isinstance(as_b64["embedding"], str)
        assert decode_base64(as_b64["embedding"]) == as_float["embedding"]


def test_a_batch_is_its_singles_in_order(client, tokenizer: Tokenizer) -> None:
    batch = client.simulate_post(EMBEDDINGS, json={"input": TEXTS}).json
    assert [d["index"] for d in batch["data"]] == [0, 1, 2]
    total = 0
    for i, text in enumerate(TEXTS):
        single = client.simulate_post(EMBEDDINGS, json={"input": text}).json
        assert single["data"][0]["embedding"] == batch["data"][i]["embedding"]
        total += single["usage"]["prompt_tokens"]
    assert len({tuple(d["embedding"]) for d in batch["data"]}) == 3
    assert batch["usage"]["prompt_tokens"] == total


def test_token_id_inputs(client, engine: FakeEngine, tokenizer: Tokenizer) -> None:
    ids = encode(tokenizer, TEXTS[1])
    one = client.simulate_post(EMBEDDINGS, json={"input": ids}).json
    assert one["data"][0]["embedding"] == fake_embedding(ids, EMBEDDING_SIZE)
    many = client.simulate_post(EMBEDDINGS, json={"input": [ids, [5, 6, 7]]}).json
    assert [d["embedding"] for d in many["data"]] == [
        fake_embedding(ids, EMBEDDING_SIZE),
        fake_embedding([5, 6, 7], EMBEDDING_SIZE),
    ]
    assert [a.prompt_token_ids for a in engine.added] == [ids, ids, [5, 6, 7]]


def test_add_special_tokens_false(client, engine: FakeEngine, tokenizer: Tokenizer) -> None:
    client.simulate_post(EMBEDDINGS, json={"input": "hi", "add_special_tokens": False})
    assert engine.added[0].prompt_token_ids == tokenizer.encode("hi", add_special_tokens=False)


def test_dimensions_on_a_matryoshka_model(client, engine: FakeEngine) -> None:
    set_pooling(engine, matryoshka=True)
    result = client.simulate_post(EMBEDDINGS, json={"input": "hi", "dimensions": 4})
    assert result.status_code == 200, result.text
    assert len(result.json["data"][0]["embedding"]) == 4
    assert engine.added[0].pooling.dimensions == 4
    too_big = client.simulate_post(EMBEDDINGS, json={"input": "hi", "dimensions": 9})
    assert "at most" in assert_openai_error(too_big, 400, "dimensions")["message"]


def test_dimensions_outside_the_listed_sizes(client, engine: FakeEngine) -> None:
    set_pooling(engine, matryoshka=True, matryoshka_dimensions=[2, 4])
    assert client.simulate_post(EMBEDDINGS, json={"input": "a", "dimensions": 2}).status_code == 200
    error = assert_openai_error(
        client.simulate_post(EMBEDDINGS, json={"input": "a", "dimensions": 3}), 400, "dimensions"
    )
    assert "[2, 4]" in error["message"]


def test_a_model_without_embeddings_says_why(client, engine: FakeEngine) -> None:
    set_pooling(engine, unsupported="this model's pooling mode 'max' is not supported")
    error = assert_openai_error(client.simulate_post(EMBEDDINGS, json={"input": "a"}), 400, "model")
    assert "'max'" in error["message"]
    engine.info = msgspec.structs.replace(engine.info, pooling=None)
    assert_openai_error(client.simulate_post(EMBEDDINGS, json={"input": "a"}), 400, "model")
    assert engine.added == []


def test_an_engine_failure_is_a_500_and_frees_everything(client, engine: FakeEngine) -> None:
    engine.script = Script(token_ids=[], fail_at_step=0)
    result = client.simulate_post(EMBEDDINGS, json={"input": TEXTS})
    assert_openai_error(result, 500, None)
    assert engine.live == set()


def test_a_full_queue_is_a_503_before_anything_runs(client, engine: FakeEngine) -> None:
    engine.refuse_after = 1
    result = client.simulate_post(EMBEDDINGS, json={"input": TEXTS})
    assert_openai_error(result, 503, None)
    assert engine.live == set()


@pytest.mark.parametrize(
    "marker", [{"task": "embeddings"}, {"encoding_format": "float"}], ids=["task", "format"]
)
def test_invocations_dispatch_by_marker(client, engine: FakeEngine, marker) -> None:
    result = client.simulate_post("/invocations", json={"input": TEXTS[1], **marker})
    assert result.status_code == 200, result.text
    assert result.json["object"] == "list"
    direct = client.simulate_post(EMBEDDINGS, json={"input": TEXTS[1]}).json
    assert result.json["data"] == direct["data"]


@pytest.mark.anyio
async def test_a_client_that_leaves_aborts_every_input(client, engine: FakeEngine) -> None:
    engine.script = Script(token_ids=[], hold=asyncio.Event())  # a prefill that never ends
    disconnect = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, disconnect.set)
    result = await call_asgi(
        client.app, EMBEDDINGS, {"input": TEXTS}, disconnect_when=lambda _: disconnect.is_set()
    )
    assert result.status is None
    assert sorted(engine.aborted) == sorted(a.request_id for a in engine.added)
    assert len(engine.added) == len(TEXTS)
    assert engine.live == set() and engine.num_in_flight == 0


# -- vLLM's extras: messages, embed_dtype / endianness, use_activation, /pooling ---------
CONVERSATION = [
    {"role": "system", "content": "Represent the question for retrieval."},
    {"role": "user", "content": "What is the capital of France?"},
]


def test_messages_are_rendered_and_embedded_as_one_input(
    client, engine: FakeEngine, tokenizer: Tokenizer
) -> None:
    """vLLM's chat-style embeddings: the conversation rendered as /tokenize renders it
    (no generation prompt unless asked, no special tokens added), one engine request."""
    seen = []
    for extra in ({}, {"add_generation_prompt": True}):
        engine.added.clear()
        body = client.simulate_post(EMBEDDINGS, json={"messages": CONVERSATION, **extra}).json
        rendered = client.simulate_post(
            "/tokenize",
            json={"messages": CONVERSATION, "add_generation_prompt": False, **extra},
        ).json["tokens"]
        (added,) = engine.added
        assert added.prompt_token_ids == rendered
        assert body["data"][0]["embedding"] == fake_embedding(rendered, EMBEDDING_SIZE)
        assert body["usage"]["prompt_tokens"] == len(rendered)
        seen.append(rendered)
    assert len(seen[1]) > len(seen[0]) and seen[1][: len(seen[0])] == seen[0]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "messages": CONVERSATION}, "messages"),
        ({}, "input"),
        ({"input": "x", "add_generation_prompt": True}, "add_generation_prompt"),
        ({"input": "x", "chat_template_kwargs": {}}, "chat_template_kwargs"),
        ({"messages": []}, "messages"),
        (
            {
                "messages": CONVERSATION,
                "add_generation_prompt": True,
                "continue_final_message": True,
            },
            "continue_final_message",
        ),
        ({"input": "x", "embed_dtype": "fp8_e4m3"}, "embed_dtype"),
        ({"input": "x", "embed_dtype": "int8"}, "embed_dtype"),
        ({"input": "x", "endianness": "middle"}, "endianness"),
        ({"input": "x", "use_activation": "yes"}, "use_activation"),
    ],
)
def test_bad_extras_are_400_naming_the_field(client, engine: FakeEngine, body, param) -> None:
    assert_openai_error(client.simulate_post(EMBEDDINGS, json=body), 400, param)
    assert engine.added == []


@pytest.mark.parametrize(
    ("dtype", "numpy_dtype"), [("float32", "f4"), ("float16", "f2"), ("bfloat16", None)]
)
@pytest.mark.parametrize("endianness", ["little", "big", "native"])
def test_base64_in_the_asked_dtype_and_byte_order(client, dtype, numpy_dtype, endianness) -> None:
    import numpy as np
    import torch

    floats = client.simulate_post(EMBEDDINGS, json={"input": TEXTS}).json["data"]
    body = {"input": TEXTS, "encoding_format": "base64", "embed_dtype": dtype}
    encoded = client.simulate_post(EMBEDDINGS, json={**body, "endianness": endianness}).json["data"]
    order = {"little": "<", "big": ">", "native": "="}[endianness]
    for want, got in zip(floats, encoded, strict=True):
        raw = base64.b64decode(got["embedding"])
        reference = torch.tensor(want["embedding"], dtype=torch.float32)
        if numpy_dtype is None:  # bfloat16: the top 16 bits, rounded as torch rounds
            bits = np.frombuffer(raw, dtype=order + "u2").astype(np.int32)
            expected = reference.to(torch.bfloat16).view(torch.int16).numpy().astype(np.int32)
            assert np.array_equal(bits & 0xFFFF, expected & 0xFFFF)
        else:
            values = np.frombuffer(raw, dtype=order + numpy_dtype)
            expected = reference.numpy().astype(numpy_dtype)
            assert np.array_equal(values, expected)


@pytest.mark.parametrize("name", ["use_activation", "normalize", "activation", "softmax"])
def test_use_activation_reaches_the_engine(client, engine: FakeEngine, name: str) -> None:
    """Under vLLM's current name and its earlier ones (`normalize` on embeddings,
    `activation` / `softmax` on classification): an unknown field is dropped, so
    `normalize: false` would have returned normalised vectors."""
    for value in (True, False, None):
        engine.added.clear()
        body = {"input": "x"} if value is None else {"input": "x", name: value}
        assert client.simulate_post(EMBEDDINGS, json=body).status_code == 200
        assert engine.added[0].pooling.normalize is value


def test_pooling_route_answers_in_vllm_s_shape(client, engine: FakeEngine, tokenizer) -> None:
    embedded = client.simulate_post(EMBEDDINGS, json={"input": TEXTS[:2]}).json
    for task in ({}, {"task": "embed"}):
        result = client.simulate_post("/pooling", json={"input": TEXTS[:2], **task})
        assert result.status_code == 200, result.text
        body = result.json
        assert body["id"].startswith("pool-") and body["object"] == "list"
        assert [d["object"] for d in body["data"]] == ["pooling", "pooling"]
        assert [d["data"] for d in body["data"]] == [d["embedding"] for d in embedded["data"]]
        assert body["usage"] == embedded["usage"]
    chat = client.simulate_post("/pooling", json={"messages": CONVERSATION}).json
    assert len(chat["data"]) == 1
    for task in ("token_embed", "classify", "score", "bogus"):
        result = client.simulate_post("/pooling", json={"input": "x", "task": task})
        assert_openai_error(result, 400, "task")


def test_the_inputs_of_one_request_share_a_group(client, engine: FakeEngine) -> None:
    """The engine lets the inputs of one API request take turns with later arrivals
    (engine/waiting_queue.py): it knows them by a group the handler names, one per
    request; a single input is its own."""
    for _ in range(2):
        result = client.simulate_post(EMBEDDINGS, json={"input": TEXTS})
        assert result.status_code == 200, result.text
    result = client.simulate_post(EMBEDDINGS, json={"input": TEXTS[0]})
    assert result.status_code == 200, result.text
    first, second, single = engine.added[:3], engine.added[3:6], engine.added[6]
    assert len({a.group for a in first}) == 1 and first[0].group is not None
    assert len({a.group for a in second}) == 1 and second[0].group != first[0].group
    assert single.group is None


@pytest.mark.parametrize(
    ("path", "body", "headers"),
    [
        ("/v1/embeddings", {"model": "sql", "input": "hi"}, {}),
        ("/pooling", {"model": "sql", "input": "hi"}, {}),
        ("/v2/embed", {"model": "sql", "texts": ["hi"], "input_type": "search_query"}, {}),
        (
            "/invocations",
            {"task": "embeddings", "input": "hi"},
            {"X-Amzn-SageMaker-Adapter-Identifier": "sql"},
        ),
    ],
    ids=["embeddings", "pooling", "cohere", "sagemaker-header"],
)
def test_a_pooling_request_naming_an_adapter_runs_on_it(make_client, engine, path, body, headers):
    """With --enable-lora, an adapter named by `model` (or SageMaker's adapter header)
    reaches the engine as the request's adapter, as a generation's does; before, these
    routes answered with the base model's vectors under the adapter's name."""
    client = make_client(enable_lora=True)
    result = client.simulate_post(path, json=body, headers=headers)
    assert result.status_code == 200, result.text
    assert engine.added and all(added.lora_name == "sql" for added in engine.added)
    base = client.simulate_post("/v1/embeddings", json={"model": "tiny", "input": "hi"})
    assert base.status_code == 200 and engine.added[-1].lora_name is None


@pytest.mark.parametrize("runtime", [False, True])
def test_adapter_routes_exist_only_with_runtime_updating(make_client, engine, runtime) -> None:
    """--enable-lora alone: loading and unloading routes are absent (404), as vLLM's
    without VLLM_ALLOW_RUNTIME_LORA_UPDATING; with --enable-runtime-lora-updating they
    answer (here a load of a directory that does not exist: the adapter's 400 / 424)."""
    client = make_client(enable_lora=True, enable_runtime_lora_updating=runtime)
    loads = [
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"}, 400),
        ("/adapters", {"name": "x", "src": "/nonexistent"}, 424),
    ]
    for path, body, refused in loads:
        result = client.simulate_post(path, json=body)
        assert result.status_code == (refused if runtime else 404), (path, result.text)
    unload = client.simulate_post("/v1/unload_lora_adapter", json={"lora_name": "x"})
    assert unload.status_code == 404  # the route's answer (unknown adapter), or no route
    assert ("cannot be found" in unload.json["error"]["message"]) is runtime
    assert engine.added == []


def test_an_adapter_name_with_a_slash_is_unloaded_through_sagemakers_route(
    make_client, engine
) -> None:
    """Adapter names may hold "/" (org/sql): DELETE /adapters/org/sql reaches the adapter
    (the engine's answer: unknown here, 404 in the route's shape), not Falcon's missing
    route."""
    client = make_client(enable_lora=True, enable_runtime_lora_updating=True)
    result = client.simulate_delete("/adapters/org/sql")
    assert result.status_code == 404
    assert result.json["error"]["message"] == "The lora adapter 'org/sql' cannot be found."
