"""A run-time `POST /adapters` whose `src` is an `s3://` prefix (moto), through the
production app over a real in-process engine: the API worker fetches the files with
boto3, the engine registers them, and a request on the adapter is token-identical to
transformers + PEFT. (The real-server tests cover local sources; a moto *server* for
their subprocess would need moto[server], which this environment lacks.)"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import boto3
import httpx
import pytest
from moto import mock_aws

from engine.config import EngineConfig
from engine.inproc_client import InprocEngineClient
from handlers.config import ServerConfig
from handlers.http.app import create_app
from handlers.serving.stats import NullStatsSink
from tests.lora_adapters import make_adapter, reference_tokens, tiny_llama

pytestmark = pytest.mark.slow

PROMPT = [1, 504, 3200, 77, 9, 1201, 45]
NEW_TOKENS = 8


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    with mock_aws():
        yield


def test_register_an_adapter_from_s3_and_run_it(
    aws: None, tmp_path: Path, model_smollm2_dir: str
) -> None:
    base = tiny_llama(tmp_path / "base", model_smollm2_dir)
    adapter = make_adapter(base, tmp_path / "adapter", seed=3, r=8, lora_alpha=16,
                           target_modules=["q_proj", "v_proj", "down_proj"])  # fmt: skip
    expected = reference_tokens(base, adapter, [PROMPT], NEW_TOKENS)[0]
    assert expected != reference_tokens(base, None, [PROMPT], NEW_TOKENS)[0]
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket="models")
    for f in Path(adapter).iterdir():
        s3.upload_file(str(f), "models", f"adapters/tuned/{f.name}")

    async def run() -> tuple[httpx.Response, ...]:
        engine = InprocEngineClient(
            EngineConfig(model=base, dtype="float32", enable_lora=True, max_loras=2,
                         num_kv_blocks=64, max_model_len=256)
        )  # fmt: skip
        config = ServerConfig(
            model_dir=base, served_model_names=("base",), enable_lora=True,
            enable_runtime_lora_updating=True, runtime_dir=str(tmp_path / "run"),
        )  # fmt: skip
        app = create_app(config, engine, stats=NullStatsSink())
        await engine.start()
        try:
            await engine.wait_ready(timeout=300)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
                load = await http.post(
                    "/adapters", json={"name": "tuned", "src": "s3://models/adapters/tuned/"}
                )
                body = {"model": "tuned", "prompt": PROMPT, "max_tokens": NEW_TOKENS,
                        "temperature": 0.0, "ignore_eos": True, "logprobs": 0}  # fmt: skip
                done = await http.post("/v1/completions", json=body)
                missing = await http.post(
                    "/adapters", json={"name": "gone", "src": "s3://models/adapters/none/"}
                )
                models = await http.get("/v1/models")
                return load, done, missing, models
        finally:
            await engine.close()

    load, done, missing, models = asyncio.run(run())
    assert load.status_code == 200, load.text
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["completion_tokens"] == NEW_TOKENS
    from engine.tokenizer import Tokenizer
    from handlers.serving.logprobs import TokenTexts

    texts = TokenTexts(Tokenizer(base))
    assert done.json()["choices"][0]["logprobs"]["tokens"] == [texts.text(t) for t in expected]
    # fetched into the runtime directory, and removed once read: the adapter generated
    # from the engine's memory, and /v1/models lists it by the source the client gave
    assert (tmp_path / "run" / "adapters").is_dir()
    assert list((tmp_path / "run" / "adapters").iterdir()) == []
    card = next(m for m in models.json()["data"] if m["id"] == "tuned")
    assert card["root"] == "s3://models/adapters/tuned/" and card["parent"] == "base"
    assert missing.status_code == 424 and "holds no objects" in missing.json()["error"]["message"]
