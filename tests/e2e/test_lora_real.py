"""LoRA adapters on a real `hearth serve` (two API workers, the engine process), float32:
each adapter's greedy completion is token-identical to transformers + PEFT on the base
plus that adapter, alone and in a batch mixing the base and two other adapters;
adapters load and unload at run time through SageMaker's and vLLM's routes (every
worker sees the change: the registry is the engine's) and are picked by `model` or by
SageMaker's adapter header; unknown adapters and bad adapter files are clean 4xx."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine.tokenizer import Tokenizer
from handlers.serving.logprobs import TokenTexts
from tests.e2e.clients import assert_openai_error, async_client, client, metric
from tests.e2e.server import Server, start_server
from tests.lora_adapters import make_adapter, make_adapters, reference_tokens, tiny_llama

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
TEXTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, a small robot"]
STARTUP = ["alpha", "beta", "gamma"]
HEADER = "X-Amzn-SageMaker-Adapter-Identifier"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory, model_smollm2_dir: str) -> str:
    """A tiny random Llama with the default model's tokenizer: on the two shared cores
    this host has, PEFT's reference on SmolLM2 itself takes minutes per adapter (the
    engine's own parity on SmolLM2 is tests/engine/test_greedy_parity.py)."""
    return tiny_llama(tmp_path_factory.mktemp("tiny-base"), model_smollm2_dir)


@pytest.fixture(scope="module")
def prompts(base_dir: str) -> list[list[int]]:
    tok = Tokenizer(base_dir)
    return [tok.encode(t, add_special_tokens=False) for t in TEXTS]


@pytest.fixture(scope="module")
def adapters(base_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_adapters(base_dir, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def expected(
    base_dir: str, adapters: dict[str, str], prompts: list[list[int]]
) -> dict[str | None, list[list[str]]]:
    """Each adapter's (and the base's) greedy tokens by transformers + PEFT, as the
    per-token texts the server's `logprobs.tokens` shows."""
    texts = TokenTexts(Tokenizer(base_dir))
    out: dict[str | None, list[list[str]]] = {}
    for name in [None, *adapters]:
        ids = reference_tokens(base_dir, adapters.get(name or ""), prompts, NEW_TOKENS)
        out[name] = [[texts.text(t) for t in seq] for seq in ids]
    return out


@pytest.fixture(scope="module")
def lora_server(server_logs: Path, base_dir: str, adapters: dict[str, str]) -> Iterator[Server]:
    modules = [f"{name}={adapters[name]}" for name in STARTUP]
    server = start_server(
        server_logs,
        base_dir,
        "--served-model-name", "base",
        "--dtype", "float32",
        "--workers", "2",
        "--max-model-len", "512",
        "--enable-lora",
        "--enable-runtime-lora-updating",
        "--max-loras", "3",
        "--max-lora-rank", "16",
        "--lora-modules", *modules,
    )  # fmt: skip
    yield server
    server.stop()


SAMPLING = {"max_tokens": NEW_TOKENS, "temperature": 0.0, "logprobs": 0}
EXTRA = {"ignore_eos": True}


def _complete(server: Server, model: str, prompt: list[int]) -> list[str]:
    done = client(server).completions.create(
        model=model, prompt=prompt, extra_body=EXTRA, **SAMPLING
    )
    return done.choices[0].logprobs.tokens


def test_adapters_change_the_output(expected: dict[str | None, list[str]]) -> None:
    for name in ("alpha", "beta", "gamma", "delta"):
        assert expected[name] != expected[None], name


def test_each_adapter_alone_is_token_identical_to_peft(
    lora_server: Server, prompts: list[list[int]], expected: dict[str | None, list[str]]
) -> None:
    for name in STARTUP:
        assert _complete(lora_server, name, prompts[0]) == expected[name][0], name
    assert _complete(lora_server, "base", prompts[0]) == expected[None][0]


def test_a_batch_mixing_base_and_adapters_is_token_identical(
    lora_server: Server, prompts: list[list[int]], expected: dict[str | None, list[str]]
) -> None:
    async def run() -> list[tuple[str | None, int, list[str]]]:
        api = async_client(lora_server)

        async def one(name: str | None, i: int) -> tuple[str | None, int, list[str]]:
            done = await api.completions.create(
                model=name or "base", prompt=prompts[i], extra_body=EXTRA, **SAMPLING
            )
            return name, i, done.choices[0].logprobs.tokens

        jobs = [one(name, i) for i in range(len(prompts)) for name in (None, "beta", "gamma")]
        return await asyncio.gather(*jobs)

    for name, i, text in asyncio.run(run()):
        assert text == expected[name][i], (name, i)


def test_load_and_unload_at_run_time_through_both_route_families(
    lora_server: Server,
    adapters: dict[str, str],
    prompts: list[list[int]],
    expected: dict[str | None, list[str]],
) -> None:
    url = lora_server.url
    body = {"prompt": prompts[1], **SAMPLING, **EXTRA}
    # SageMaker: register, pick it by the header on /invocations, unregister.
    r = httpx.post(url + "/adapters", json={"name": "delta", "src": adapters["delta"]}, timeout=120)
    assert r.status_code == 200 and r.text == "Adapter delta registered", r.text
    cards = {m.id: m for m in client(lora_server).models.list().data}
    assert cards["delta"].parent == "base" and cards["alpha"].parent == "base"
    assert cards["base"].parent is None
    assert client(lora_server).models.retrieve("delta").parent == "base"
    for _ in range(2):  # both workers know it (whichever answers)
        r = httpx.post(url + "/invocations", json=body, headers={HEADER: "delta"}, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["logprobs"]["tokens"] == expected["delta"][1]
        assert r.json()["model"] == "delta"
    r = httpx.delete(url + "/adapters/delta", timeout=60)
    assert r.status_code == 200 and r.text == "Adapter delta unregistered", r.text
    r = httpx.post(url + "/invocations", json=body, headers={HEADER: "delta"}, timeout=60)
    assert_openai_error(r, 404, "model")
    assert_openai_error(httpx.delete(url + "/adapters/delta", timeout=60), 404)
    assert_openai_error(httpx.get(url + "/v1/models/delta", timeout=60), 404, "model")
    # vLLM: the same adapter under another name, picked by `model`.
    r = httpx.post(
        url + "/v1/load_lora_adapter",
        json={"lora_name": "delta-v", "lora_path": adapters["delta"]},
        timeout=120,
    )
    assert r.status_code == 200 and "added successfully" in r.text, r.text
    assert _complete(lora_server, "delta-v", prompts[1]) == expected["delta"][1]
    dup = httpx.post(
        url + "/v1/load_lora_adapter",
        json={"lora_name": "delta-v", "lora_path": adapters["delta"]},
        timeout=60,
    )
    assert_openai_error(dup, 400)
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "delta-v"}, timeout=60)
    assert r.status_code == 200 and "removed successfully" in r.text, r.text
    with pytest.raises(openai.NotFoundError):
        _complete(lora_server, "delta-v", prompts[1])
    again = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "delta-v"}, timeout=60)
    assert_openai_error(again, 404)


def test_unknown_adapters_and_bad_adapter_files_are_4xx(
    lora_server: Server, base_dir: str, tmp_path: Path, prompts: list[list[int]]
) -> None:
    url = lora_server.url
    with pytest.raises(openai.NotFoundError) as exc:
        _complete(lora_server, "no-such-adapter", prompts[0])
    assert "no-such-adapter" in str(exc.value)
    chat = {"model": "no-such-adapter", "messages": [{"role": "user", "content": "hi"}]}
    assert_openai_error(
        httpx.post(url + "/v1/chat/completions", json=chat, timeout=60), 404, "model"
    )
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 2}}
    r = httpx.post(url + "/invocations", json=body, headers={HEADER: "ghost"}, timeout=60)
    assert_openai_error(r, 404, "model")
    missing = {"name": "ghost", "src": str(tmp_path / "nothing")}
    assert_openai_error(httpx.post(url + "/adapters", json=missing, timeout=60), 424, "src")
    big = make_adapter(base_dir, tmp_path / "big", seed=5, r=32, lora_alpha=32,
                       target_modules=["q_proj"])  # fmt: skip
    r = httpx.post(url + "/adapters", json={"name": "big", "src": big}, timeout=120)
    assert "max_lora_rank" in assert_openai_error(r, 424, "src")["message"]
    r = httpx.post(
        url + "/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": big}, timeout=120
    )
    assert_openai_error(r, 400, "src")
    assert_openai_error(httpx.post(url + "/adapters", json={"name": "x"}, timeout=60), 400, "src")
    base_name = {"name": "base", "src": big}
    assert_openai_error(httpx.post(url + "/adapters", json=base_name, timeout=60), 400, "name")
    assert httpx.get(url + "/health", timeout=30).status_code == 200  # still serving


def test_metrics_count_requests_per_adapter(lora_server: Server, prompts: list[list[int]]) -> None:
    before = _lora_count(lora_server, "gamma")
    _complete(lora_server, "gamma", prompts[2])
    assert _lora_count(lora_server, "gamma") == before + 1
    assert metric(lora_server, "hearth:lora_requests_total") >= 1


def _lora_count(server: Server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("hearth:lora_requests_total{") and f'lora_name="{name}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total
