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
