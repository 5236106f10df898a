"""Real servers for the end-to-end tests: one shared default server per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.server import Server, start_server


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("servers")


@pytest.fixture(scope="session")
def default_server(server_logs: Path, model_smollm2_dir: str) -> Iterator[Server]:
    """`hearth serve` with the embedded default model and two API workers."""
    server = start_server(
        server_logs, "--workers", "2", "--max-model-len", "2048", "--enable-server-load-tracking"
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def invariant_server(
    request: pytest.FixtureRequest, server_logs: Path, model_smollm2_dir: str
) -> Iterator[Server]:
    """The default model in `--quantization gguf`, the mode whose outputs never depend on
    load and whose weights and KV cache are exactly the file's and the model's float32
    numbers: for tests that compare a request alone and in a batch, or against
    transformers' float32 numbers. The default differs from it wherever the fast path runs
    (``--quantization auto`` keeps float16 keys / int8 values even where it picks
    ``gguf``); on a host without AVX2 the default is the exact mode, which serves too."""
    from kernels.cpu import ops

    if not ops.available():
        yield request.getfixturevalue("default_server")
        return
    server = start_server(
        server_logs, "--workers", "2", "--max-model-len", "2048", "--quantization", "gguf"
    )
    yield server
    server.stop()
