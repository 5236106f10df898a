"""Settings that used to be read where they were used (issue 15) now come from a flag
and its `HEARTH_<FLAG>` variable, through `container/settings.py`, into a config field:
each one is set by its variable, and a bad value fails naming the variable."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from container import cli, gunicorn_app, settings
from engine.config import EngineConfig
from handlers.config import ServerConfig
from handlers.http.asgi import engine_client
from handlers.protocol.base import DEFAULT_LIMITS


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith(("HEARTH_", "SM_HEARTH_", "SAGEMAKER_")):
            monkeypatch.delenv(key)


SET_BY_VARIABLE = [
    # (variable, value, config, field, parsed)
    ("HEARTH_MAX_N", "3", "server", "max_n", 3),
    ("HEARTH_MAX_LOGPROBS", "0", "server", "max_logprobs", 0),
    ("HEARTH_MAX_STOP_STRINGS", "5", "server", "max_stop_strings", 5),
    ("HEARTH_MAX_REQUEST_BODY_BYTES", "2MiB", "server", "max_request_body_bytes", 2 << 20),
    ("HEARTH_ENGINE_HEARTBEAT_TIMEOUT", "4.5", "server", "engine_heartbeat_timeout", 4.5),
    ("HEARTH_CPU_ISA", "AVX512_VNNI", "engine", "cpu_isa", "avx512_vnni"),
    ("HEARTH_CACHE_DIR", "/var/cache/models", "engine", "cache_dir", "/var/cache/models"),
    ("HEARTH_TEST_FAULT_FILE", "/tmp/fault", "engine", "test_fault_file", "/tmp/fault"),
]


@pytest.mark.parametrize(("variable", "raw", "which", "field", "value"), SET_BY_VARIABLE)
def test_the_variable_sets_the_config_field(
    variable: str, raw: str, which: str, field: str, value: Any
) -> None:
    engine, server = settings.configs_from_env({variable: raw})
    assert getattr(engine if which == "engine" else server, field) == value
    default = EngineConfig() if which == "engine" else ServerConfig()
    assert getattr(default, field) != value, "the test must move the value off its default"


def test_the_limit_defaults_are_the_request_validation_defaults() -> None:
    """Written once: the flags' defaults are ServerConfig's, which are RequestLimits'."""
    _, server = settings.configs_from_env({})
    assert server.request_limits() == DEFAULT_LIMITS
    _, tight = settings.configs_from_env({"HEARTH_MAX_N": "2", "HEARTH_MAX_LOGPROBS": "1"})
    limits = tight.request_limits()
    assert (limits.max_n, limits.max_logprobs) == (2, 1)


@pytest.mark.parametrize(
    ("variable", "raw"),
    [
        ("HEARTH_MAX_N", "0"),
        ("HEARTH_MAX_N", "many"),
        ("HEARTH_MAX_LOGPROBS", "-1"),
        ("HEARTH_MAX_STOP_STRINGS", "0"),
        ("HEARTH_MAX_REQUEST_BODY_BYTES", "huge"),
        ("HEARTH_ENGINE_HEARTBEAT_TIMEOUT", "0"),
        ("HEARTH_ENGINE_HEARTBEAT_TIMEOUT", "soon"),
        ("HEARTH_CPU_ISA", "sse4"),
    ],
)
def test_a_bad_value_fails_naming_the_variable(variable: str, raw: str) -> None:
    with pytest.raises(SystemExit) as info:
        settings.configs_from_env({variable: raw})
    assert str(info.value.code).startswith(f"hearth: {variable}")


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--max-n", "0"], "--max-n"),
        (["--max-logprobs", "-2"], "--max-logprobs"),
        (["--engine-heartbeat-timeout", "-1"], "--engine-heartbeat-timeout"),
        (["--cpu-isa", "neon"], "--cpu-isa"),
    ],
)
def test_a_bad_flag_fails_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", *argv])
    assert info.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


def test_the_worker_reaches_the_engine_through_its_config(tmp_path: Path) -> None:
    client = engine_client(ServerConfig(runtime_dir=str(tmp_path), engine_heartbeat_timeout=7.0))
    assert (client.runtime_dir, client.heartbeat_timeout_s) == (tmp_path, 7.0)
    with pytest.raises(RuntimeError, match="runtime_dir"):
        engine_client(ServerConfig())


def test_serve_hands_each_process_its_settings_in_its_config(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The runtime directory, the heartbeat timeout, the cache directory and the fault
    hook travel in the two configs (and the engine's argv), not in variables of their own."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    seen: dict[str, Any] = {}

    class Supervisor:
        died = False

        def __init__(self, env: dict[str, str], runtime_dir: str) -> None:
            seen.update(env=env, runtime_dir=runtime_dir)

        def stop(self) -> None:
            pass

    class Application:
        def __init__(self, options: dict[str, Any], supervisor: Any, niceness: int) -> None:
            seen["server"] = ServerConfig.from_env()

        def run(self) -> None:
            pass

    def resolve(model: str, cache_dir: str | None, progress: Any = None) -> str:
        seen["cache_dir"] = cache_dir
        return model

    monkeypatch.setattr(gunicorn_app, "EngineSupervisor", Supervisor)
    monkeypatch.setattr(gunicorn_app, "HearthApplication", Application)
    monkeypatch.setattr("engine.model_resolver.resolve_model_dir", resolve)
    for key in ("PROMETHEUS_MULTIPROC_DIR", "HEARTH_SERVER_CONFIG"):
        monkeypatch.setenv(key, "")
    monkeypatch.setenv("HEARTH_ENGINE_HEARTBEAT_TIMEOUT", "9")
    monkeypatch.setenv("HEARTH_TEST_FAULT_FILE", str(tmp_path / "fault"))
    assert cli.main(["serve", str(model), "--cache-dir", str(tmp_path / "cache")]) == 0

    assert seen["cache_dir"] == str(tmp_path / "cache")
    server: ServerConfig = seen["server"]
    assert server.runtime_dir == seen["runtime_dir"] and server.engine_heartbeat_timeout == 9.0
    engine = msgspec.json.decode(seen["env"]["HEARTH_ENGINE_CONFIG"], type=EngineConfig)
    assert engine.cache_dir == str(tmp_path / "cache")
    assert engine.test_fault_file == str(tmp_path / "fault")
    assert "HEARTH_RUNTIME_DIR" not in seen["env"]
