"""LoRA settings: vLLM's flags and their HEARTH_* / SM_HEARTH_* variables, both
`--lora-modules` forms, the model directory's adapters/ folder, and the one-line
refusals."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from container import settings
from container.sagemaker_serve import sagemaker_argv


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith(("HEARTH_", "SM_HEARTH_", "SAGEMAKER_")):
            monkeypatch.delenv(key)


def _engine(argv: list[str], environ: dict[str, str] | None = None):
    args = settings.parse_serve_args(argv, environ or {})
    return settings.serve_configs(args)


def test_flags_reach_both_configs() -> None:
    engine, server = _engine(
        ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "32", "--lora-modules",
         "sql=/a/sql", '{"name": "chat", "path": "s3://b/chat/"}']
    )  # fmt: skip
    assert engine.enable_lora and server.enable_lora
    assert engine.max_loras == 4 and engine.max_lora_rank == 32
    assert engine.lora_modules == (("sql", "/a/sql"), ("chat", "s3://b/chat/"))


def test_variables_set_them_too() -> None:
    env = {
        "HEARTH_ENABLE_LORA": "true",
        "HEARTH_LORA_MODULES": "a=/x,b=/y",
        "HEARTH_MAX_LORAS": "2",
    }
    engine, _ = _engine([], env)
    assert engine.enable_lora and engine.max_loras == 2
    assert engine.lora_modules == (("a", "/x"), ("b", "/y"))


def test_sagemaker_variables_become_the_flags(tmp_path: Path) -> None:
    argv = sagemaker_argv(
        {"SM_HEARTH_ENABLE_LORA": "true", "SM_HEARTH_MAX_LORAS": "3",
         "SM_HEARTH_LORA_MODULES": "a=s3://b/a/"},
        model_dir=tmp_path,
    )  # fmt: skip
    engine, _ = _engine(argv[1:])
    assert engine.enable_lora and engine.max_loras == 3
    assert engine.lora_modules == (("a", "s3://b/a/"),)


def test_the_model_directory_adapters_folder_is_registered(tmp_path: Path) -> None:
    for name in ("sql", "chat"):
        (tmp_path / "adapters" / name).mkdir(parents=True)
        (tmp_path / "adapters" / name / "adapter_config.json").write_text("{}")
    (tmp_path / "adapters" / "notes").mkdir()  # no adapter_config.json: not an adapter
    engine, _ = _engine([str(tmp_path), "--enable-lora", "--lora-modules", "sql=/elsewhere"])
    assert dict(engine.lora_modules) == {
        "sql": "/elsewhere",
        "chat": str(tmp_path / "adapters/chat"),
    }
    plain, _ = _engine([str(tmp_path)])  # without --enable-lora the folder is left alone
    assert plain.lora_modules == () and not plain.enable_lora


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "nopath"], "is not NAME=PATH"),
        (["--enable-lora", "--lora-modules", '{"name": "a"}'], "JSON must be"),
        (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "names an adapter twice"),
    ],
)
def test_bad_settings_fail_in_one_line(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        _engine(argv)
    assert message in str(exc.value)


def test_bounds_fail_naming_the_flag() -> None:
    with pytest.raises(SystemExit):
        _engine(["--max-loras", "0"])


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        (["--enable-lora"], {}, False),
        (["--enable-lora", "--enable-runtime-lora-updating"], {}, True),
        (["--enable-lora"], {"HEARTH_ENABLE_RUNTIME_LORA_UPDATING": "true"}, True),
        (["--enable-lora"], {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}, True),
        (
            ["--enable-lora"],
            {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "HEARTH_ENABLE_RUNTIME_LORA_UPDATING": "0"},
            False,
        ),
    ],
    ids=["default-off", "flag", "hearth-variable", "vllm-variable", "hearth-variable-wins"],
)
def test_runtime_loading_is_opt_in(argv, environ, expected) -> None:
    """The routes that load and unload adapters while serving are off unless asked for,
    as vLLM's (VLLM_ALLOW_RUNTIME_LORA_UPDATING, honoured too): --enable-lora alone serves
    the start-up adapters and no client can make the server read a path."""
    _, server = _engine(argv, environ)
    assert server.enable_runtime_lora_updating is expected
