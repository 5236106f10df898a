"""Fixtures of the handler tests: a tiny real tokenizer, a scripted engine, the app.

The app is the production `create_app()`; only the engine (scripted) and the model
directory (a tokenizer trained in the fixture) are stand-ins.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import falcon.testing
import pytest
from fake_engine import FakeEngine
from handlers_testing import EOS_ID, MAX_MODEL_LEN, build_tiny_model, connected_client

from engine.config import ModelInfo
from engine.tokenizer import Tokenizer
from handlers.config import ServerConfig
from handlers.http.app import create_app
from handlers.serving.stats import NullStatsSink, StatsSink


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def model_info(model_dir: Path, tokenizer: Tokenizer) -> ModelInfo:
    return ModelInfo(
        model_dir=str(model_dir),
        max_model_len=MAX_MODEL_LEN,
        vocab_size=tokenizer.vocab_size,
        eos_token_ids=[EOS_ID],
        num_kv_blocks=64,
        block_size=16,
        architecture="LlamaForCausalLM",
    )


@pytest.fixture
def engine(model_info: ModelInfo) -> FakeEngine:
    return FakeEngine(info=model_info)


@pytest.fixture
def make_client(
    model_dir: Path, tokenizer: Tokenizer, engine: FakeEngine
) -> Iterator[Callable[..., falcon.testing.TestClient]]:
    """TestClient over create_app(config overrides...)."""

    def make(stats: StatsSink | None = None, **overrides: Any) -> falcon.testing.TestClient:
        config = ServerConfig(
            model_dir=str(model_dir),
            served_model_names=overrides.pop("served_model_names", ("tiny", "tiny-alias")),
            **overrides,
        )
        app = create_app(config, engine, tokenizer, stats=stats or NullStatsSink())
        return connected_client(app)

    yield make


@pytest.fixture
def client(make_client: Callable[..., falcon.testing.TestClient]) -> falcon.testing.TestClient:
    return make_client()
