"""One reader of the settings: `hearth serve` and the Lambda entry resolve the same
`EngineConfig` and `ServerConfig` from the same environment."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from container import cli, settings
from container.flags import SECRET_LIST_FLAGS, Bounded, env_name, finish_many, parse_bytes
from engine.profiler_config import parse_profiler_config

ROOT = Path(__file__).resolve().parents[2]

_NOT_CONFIG = {"--host", "--port", "--uds", "--workers", "--ssl-keyfile", "--ssl-certfile"}
"""Flags of the process (bind, TLS, worker count), not of either config."""


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith(("HEARTH_", "SM_HEARTH_", "SAGEMAKER_")) and key != "HEARTH_CACHE_DIR":
            monkeypatch.delenv(key)


def _serve_options() -> list[argparse.Action]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices["serve"]._actions if a.option_strings and a.dest != "help"]


def _sample(action: argparse.Action) -> str:
    """A valid value for the flag's variable, different from its default."""
    flag = action.option_strings[0]
    if flag == "--chat-template":
        return "{{ messages[0].content }}"
    if flag == "--root-path":
        return "/api"
    if flag == "--gpu-memory-utilization":
        return "0.5"  # a fraction: EngineConfig refuses more than 1
    if flag == "--device":
        return "cuda:1"  # validated by EngineConfig: auto, cpu, cuda or cuda:N
    if flag == "--lora-modules":
        return "alpha=/adapters/a,beta=s3://bucket/b"  # NAME=PATH items
    if isinstance(action, argparse.BooleanOptionalAction):
        return "false" if action.default else "true"
    if flag in SECRET_LIST_FLAGS:
        return "alpha,1\nbeta"  # one key per line; a comma is part of a key
    if action.nargs == "+" or isinstance(action, argparse._AppendAction):
        return "alpha,beta"
    if action.choices:
        return str(next(c for c in reversed(list(action.choices)) if c != action.default))
    if action.type is parse_bytes:
        return "4GiB"  # a size with a unit: what the old Lambda reader crashed on
    if action.type is parse_profiler_config:
        return '{"profiler": "torch", "torch_profiler_dir": "/tmp/traces"}'

    kind = action.type.kind if isinstance(action.type, Bounded) else action.type
    if kind is int:
        return str((action.default or 0) + 7)
    if kind is float:
        return str((action.default or 0.0) + 2.5)
    return "/some/value"


def _environment() -> dict[str, str]:
    environ = {
        env_name(a.option_strings[0]): _sample(a)
        for a in _serve_options()
        if a.option_strings[0] not in _NOT_CONFIG
    }
    environ["HEARTH_MODEL"] = "/nonexistent/model-dir"
    return environ


def _as_json(configs: tuple[Any, Any]) -> Any:
    return json.loads(msgspec.json.encode(list(configs)))


@pytest.mark.slow
def test_lambda_and_serve_resolve_the_same_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    environ = _environment()
    assert len(environ) > 30  # every config flag is set once

    # `hearth serve`: the CLI's own parser over the environment, then the CLI's configs
    # (before run_serve resolves the model directory).
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    args = cli.build_parser().parse_args(["serve"])
    finish_many(args)
    serve = _as_json(settings.serve_configs(args))

    # Lambda: import the real entry in a fresh process with the same environment. Its
    # engine thread fails on the missing model in the background; the configs are built.
    code = (
        "import json, msgspec\n"
        "from container import lambda_handler as h\n"
        "configs = [h.engine_config, h.server_config]\n"
        "print('CONFIGS ' + msgspec.json.encode(configs).decode())\n"
    )
    env = {**os.environ, **environ, "PYTHONPATH": str(ROOT)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("CONFIGS "))
    lambda_configs = json.loads(line.removeprefix("CONFIGS "))

    assert lambda_configs == serve
    engine, server = serve
    # Spot checks that the values really came from the environment.
    assert engine["kv_cache_memory"] == 4 << 30
    assert engine["max_num_seqs"] == 256 + 7
    assert server["served_model_names"] == ["alpha", "beta"]
    assert len(server["api_key_digests"]) == 2  # one per line, as the flag splits it
    assert server["generation_config"] == "vllm"


def test_a_bad_value_fails_loudly_and_names_the_variable() -> None:
    with pytest.raises(SystemExit, match="HEARTH_KV_CACHE_MEMORY"):
        settings.configs_from_env({"HEARTH_KV_CACHE_MEMORY": "lots"})
    with pytest.raises(SystemExit, match="HEARTH_LOG_LEVEL"):
        settings.configs_from_env({"HEARTH_LOG_LEVEL": "loud"})


def test_log_level_reaches_the_engine_process_config() -> None:
    engine, _ = settings.configs_from_env({"HEARTH_LOG_LEVEL": "DEBUG"})
    assert engine.log_level == "debug"
