"""vLLM's operator routes through a real `hearth serve` (a tiny random-weight Llama, two API
workers): `--server-dev-mode`'s /reset_prefix_cache, /reset_mm_cache,
/reset_encoder_cache and /server_info, and `--profiler-config`'s /start_profile and
/stop_profile, behind the API key like every other route; and their absence (404, as in
vLLM) on a server started without the flags."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import Server, start_server
from tests.engine.tiny_models import save_servable_tiny

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

KEY = "operator-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = list(range(5, 69))  # 64 tokens: four blocks of 16


@pytest.fixture(scope="module")
def operator_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_servable_tiny("llama-gqa-tied", directory)
    traces = tmp_path_factory.mktemp("traces")
    profiler = json.dumps({"profiler": "torch", "torch_profiler_dir": str(traces)})
    server = start_server(
        tmp_path_factory.mktemp("operator-logs"), str(directory), "--served-model-name", "tiny",
        "--max-model-len", "256", "--workers", "2", "--server-dev-mode",
        "--profiler-config", profiler, "--enable-prompt-tokens-details",
        env={"HEARTH_API_KEY": KEY},
    )  # fmt: skip
    yield server, traces
    server.stop()


def cached_tokens(server: Server) -> int:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    result = httpx.post(f"{server.v1}/completions", json=body, headers=AUTH, timeout=60)
    assert result.status_code == 200, result.text
    return result.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def post(server: Server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", headers=AUTH, timeout=120, **kwargs)


def test_reset_prefix_cache_empties_the_cache_for_every_worker(operator_server) -> None:
    server, _ = operator_server
    cached_tokens(server)
    assert cached_tokens(server) == 48
    reset = post(server, "/reset_prefix_cache")
    assert reset.status_code == 200 and reset.json() == {"success": True}
    assert cached_tokens(server) == 0  # whichever worker answers: one engine
    running = post(server, "/reset_prefix_cache", params={"reset_running_requests": "true"})
    assert running.json() == {"success": True}
    bad = post(server, "/reset_prefix_cache", params={"reset_running_requests": "maybe"})
    assert bad.status_code == 400 and "reset_running_requests" in bad.json()["error"]["message"]
    for path in ("/reset_mm_cache", "/reset_encoder_cache"):
        assert post(server, path).status_code == 200


def test_operator_routes_need_the_api_key(operator_server) -> None:
    server, _ = operator_server
    for path in ("/reset_prefix_cache", "/start_profile", "/stop_profile"):
        assert httpx.post(f"{server.url}{path}", timeout=30).status_code == 401
    assert httpx.get(f"{server.url}/server_info", timeout=30).status_code == 401


def test_server_info_shows_the_configuration_but_no_secret(operator_server) -> None:
    server, _ = operator_server
    result = httpx.get(f"{server.url}/server_info", headers=AUTH, timeout=30)
    assert result.status_code == 200, result.text
    info = result.json()
    assert info["engine_config"]["max_model_len"] == 256
    assert info["server_config"]["served_model_names"] == ["tiny"]
    assert info["server_config"]["server_dev_mode"] is True
    assert info["engine_config"]["max_num_batched_tokens"] > 0
    assert info["engine"]["max_model_len"] == 256 and info["engine"]["kernels"]
    assert info["system_env"]["torch"]
    assert "HEARTH_API_KEY" not in info["hearth_env"]
    assert KEY not in result.text and "api_key_digests" not in result.text


def test_profile_routes_write_a_trace_of_the_requests_between_them(operator_server) -> None:
    server, traces = operator_server
    assert post(server, "/stop_profile").status_code == 400  # not running
    bad = post(server, "/start_profile", json={"delay_iterations": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "delay_iterations"
    start = post(server, "/start_profile")  # no body, as `vllm bench serve --profile` sends
    assert start.status_code == 200, start.text
    assert post(server, "/start_profile").status_code == 400  # already running
    cached_tokens(server)
    stop = post(server, "/stop_profile")
    assert stop.status_code == 200, stop.text
    (trace,) = traces.glob("*.pt.trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert any(event.get("name", "").startswith("aten::") for event in events)
    assert len(list(traces.glob("*.txt"))) == 1


def test_without_the_flags_the_routes_are_absent(default_server: Server) -> None:
    for path in ("/reset_prefix_cache", "/reset_mm_cache", "/start_profile", "/stop_profile"):
        assert httpx.post(f"{default_server.url}{path}", timeout=30).status_code == 404
    assert httpx.get(f"{default_server.url}/server_info", timeout=30).status_code == 404
