"""`hearth serve` configuration: flags, their `HEARTH_<FLAG>` variables, SageMaker's
`SM_HEARTH_<FLAG>` mapping in `serve`, size and boolean parsing, the errors a bad value
gives, and how the drain window reaches gunicorn and uvicorn. No server is started:
`run_serve`'s gunicorn application is replaced where a test follows a command that far."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from container import cli, gunicorn_app, sagemaker_serve
from container.flags import (
    SECRET_LIST_FLAGS,
    Bounded,
    env_name,
    finish_many,
    parse_bool,
    parse_bytes,
)
from container.sagemaker_serve import sagemaker_argv
from engine.profiler_config import parse_profiler_config

ROOT = Path(__file__).resolve().parents[2]

VLLM_FLAGS = [
    "--host",
    "--port",
    "--uds",
    "--api-key",
    "--served-model-name",
    "--max-model-len",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--gpu-memory-utilization",
    "--dtype",
    "--block-size",
    "--enable-prefix-caching",
    "--seed",
    "--chat-template",
    "--response-role",
    "--allowed-origins",
    "--allowed-methods",
    "--allowed-headers",
    "--enable-request-id-headers",
    "--sse-keep-alive-interval",
    "--max-num-queued-reqs",
    "--max-num-queued-tokens",
    "--scheduling-policy",
    "--enable-server-load-tracking",
    "--enable-tokenizer-info-endpoint",
    "--disable-log-stats",
    "--root-path",
    "--ssl-keyfile",
    "--ssl-certfile",
    "--workers",
    "--device",
    "--kv-cache-memory",
    "--quantization",
    "--max-logprobs",
    "--cpu-isa",
    "--cache-dir",
    "--engine-heartbeat-timeout",
    "--max-n",
    "--max-stop-strings",
    "--max-request-body-bytes",
]
"""vLLM's flag names where the concept is the same, plus ours (docs/api.md)."""


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flags read the environment when the parser is built: start from none set."""
    for key in list(os.environ):
        if key.startswith(("HEARTH_", "SM_HEARTH_", "SAGEMAKER_")) and key != "HEARTH_CACHE_DIR":
            monkeypatch.delenv(key)


def _serve_parser() -> argparse.ArgumentParser:
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices["serve"]


def _parse(argv: list[str]) -> argparse.Namespace:
    args = cli.build_parser().parse_args(argv)
    finish_many(args)
    return args


def _serve_options() -> list[argparse.Action]:
    return [a for a in _serve_parser()._actions if a.option_strings and a.dest != "help"]


# ------------------------------------------------------------------ HEARTH_<FLAG>


def _sample(action: argparse.Action) -> tuple[str, Any]:
    """A valid environment value for the flag, different from its default, and the
    value it must parse to."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return ("false", False) if action.default else ("true", True)
    if action.option_strings[0] in SECRET_LIST_FLAGS:
        return "alpha,1\nbeta", ["alpha,1", "beta"]
    if action.nargs == "+" or isinstance(action, argparse._AppendAction):
        return "alpha,beta", ["alpha", "beta"]
    if action.choices:
        choice = next(c for c in reversed(list(action.choices)) if c != action.default)
        return str(choice), choice
    if action.type is parse_bytes:
        return "3MiB", 3 << 20
    if action.type is parse_profiler_config:
        text = '{"profiler": "torch", "torch_profiler_dir": "/tmp/traces"}'
        return text, parse_profiler_config(text)
    kind = action.type.kind if isinstance(action.type, Bounded) else action.type
    if kind is int:
        value = (action.default or 0) + 7
        return str(value), value
    if kind is float:
        value = (action.default or 0.0) + 2.5
        return str(value), value
    return "/some/value", "/some/value"


def test_the_design_flags_exist() -> None:
    names = {s for a in _serve_options() for s in a.option_strings}
    assert not set(VLLM_FLAGS) - names


def test_every_serve_flag_reads_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    options = _serve_options()
    assert len(options) >= len(VLLM_FLAGS)
    expected: dict[str, Any] = {}
    for action in options:
        flag = action.option_strings[0]
        if action.help != argparse.SUPPRESS:  # a hidden test hook still reads its variable
            assert f"[env {env_name(flag)}" in action.help, f"{flag}'s help names no variable"
        raw, value = _sample(action)
        monkeypatch.setenv(env_name(flag), raw)
        expected[action.dest] = value
    monkeypatch.setenv("HEARTH_MODEL", "/models/from-env")
    expected["model"] = "/models/from-env"

    args = vars(_parse(["serve"]))
    wrong = {k: (args[k], v) for k, v in expected.items() if args[k] != v}
    assert not wrong, f"(parsed, expected) of flags not set by their variable: {wrong}"


def test_a_flag_on_the_command_line_wins_over_its_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HEARTH_MAX_MODEL_LEN", "4096")
    monkeypatch.setenv("HEARTH_API_KEY", "a\nb")
    monkeypatch.setenv("HEARTH_ENABLE_PREFIX_CACHING", "false")
    args = _parse(["serve", "--max-model-len", "512", "--api-key", "c", "--enable-prefix-caching"])
    assert args.max_model_len == 512
    assert args.api_key == ["c"]  # replaces the variable's list, does not extend it
    assert args.enable_prefix_caching is True
    args = _parse(["serve"])
    assert (args.max_model_len, args.api_key, args.enable_prefix_caching) == (
        4096,
        ["a", "b"],
        False,
    )


@pytest.mark.parametrize("text", ["true", "True", " TRUE ", "1", "yes", "on"])
def test_booleans_true(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_bool(text, "--x") is True
    monkeypatch.setenv("HEARTH_ENABLE_SERVER_LOAD_TRACKING", text)
    assert _parse(["serve"]).enable_server_load_tracking is True


@pytest.mark.parametrize("text", ["false", "False", "0", "no", "off", ""])
def test_booleans_false(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_bool(text, "--x") is False
    monkeypatch.setenv("HEARTH_ENABLE_PREFIX_CACHING", text)  # default on
    assert _parse(["serve"]).enable_prefix_caching is False


@pytest.mark.parametrize("text", ["maybe", "2", "tru", "enabled"])
def test_booleans_reject_garbage(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HEARTH_ENABLE_PREFIX_CACHING", text)
    with pytest.raises(SystemExit) as exc:
        _parse(["serve"])
    assert str(exc.value.code) == (
        f"hearth: HEARTH_ENABLE_PREFIX_CACHING={text!r} is not a boolean (use true or false)"
    )


# ------------------------------------------------------------------ sizes


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4GiB", 4 << 30),
        ("512MiB", 512 << 20),
        ("1048576", 1048576),
        ("2G", 2 << 30),
        ("2gb", 2 << 30),
        ("1.5GiB", 3 << 29),
        ("64k", 64 << 10),
        ("64KiB", 64 << 10),
        (" 8 MiB ", 8 << 20),
        ("1TiB", 1 << 40),
    ],
)
def test_kv_cache_memory_sizes(text: str, size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_bytes(text) == size
    assert _parse(["serve", "--kv-cache-memory", text]).kv_cache_memory == size
    monkeypatch.setenv("HEARTH_KV_CACHE_MEMORY", text)
    assert _parse(["serve"]).kv_cache_memory == size


@pytest.mark.parametrize("text", ["", "lots", "4XB", "1.2.3G", "-1", "0", "0MiB", "GiB"])
def test_kv_cache_memory_rejects_non_sizes(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="is not a size"):
        parse_bytes(text)


# ------------------------------------------------------------------ help and errors


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith(("HEARTH_", "SM_", "SAGEMAKER_"))
    }
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        env={**clean, **(env or {})},
        cwd=ROOT,
        timeout=120,
    )


def test_serve_help_lists_the_groups() -> None:
    done = _run(["container.cli", "serve", "--help"])
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for group in ("server:", "OpenAI API:", "engine:"):
        assert f"\n{group}\n" in out
    for flag in VLLM_FLAGS:
        assert flag in out
    assert "[env HEARTH_MAX_MODEL_LEN]" in out
    assert "--no-enable-prefix-caching" in out


BAD_VALUES = [
    # (argv after `hearth`, environment, the one error line)
    (
        ["serve", "--port", "eighty"],
        {},
        "hearth serve: error: argument --port: invalid int value: 'eighty'",
    ),
    (
        ["serve", "--kv-cache-memory", "lots"],
        {},
        "hearth serve: error: argument --kv-cache-memory: 'lots' is not a size "
        "(use e.g. 4GiB, 512MiB or a byte count)",
    ),
    (
        ["serve", "--dtype", "fp8"],
        {},
        "hearth serve: error: argument --dtype: invalid choice: 'fp8' "
        "(choose from 'auto', 'float32', 'bfloat16', 'float16')",
    ),
    (
        ["serve", "--worker-niceness", "20"],
        {},
        "hearth serve: error: argument --worker-niceness: '20' is above the maximum 19",
    ),
    (
        ["serve", "--worker-niceness=-5"],
        {},
        "hearth serve: error: argument --worker-niceness: '-5' is below the minimum 0",
    ),
    (
        ["serve", "--max-model-len"],
        {},
        "hearth serve: error: argument --max-model-len: expected one argument",
    ),
    (
        ["serve"],
        {"HEARTH_MAX_MODEL_LEN": "big"},
        "hearth: HEARTH_MAX_MODEL_LEN='big' is not an integer",
    ),
    (
        ["serve"],
        {"HEARTH_GPU_MEMORY_UTILIZATION": "most"},
        "hearth: HEARTH_GPU_MEMORY_UTILIZATION='most' is not a number",
    ),
    (
        ["serve"],
        {"HEARTH_KV_CACHE_MEMORY": "4 bananas"},
        "hearth: HEARTH_KV_CACHE_MEMORY: '4 bananas' is not a size "
        "(use e.g. 4GiB, 512MiB or a byte count)",
    ),
    (
        ["serve"],
        {"HEARTH_DTYPE": "fp8"},
        "hearth: HEARTH_DTYPE='fp8' is not one of: auto, float32, bfloat16, float16",
    ),
    (
        ["serve"],
        {"HEARTH_DISABLE_LOG_STATS": "sometimes"},
        "hearth: HEARTH_DISABLE_LOG_STATS='sometimes' is not a boolean (use true or false)",
    ),
]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line and not line.startswith("usage:")]


@pytest.mark.parametrize(("argv", "env", "line"), BAD_VALUES)
def test_bad_values_give_one_clear_line(
    argv: list[str],
    env: dict[str, str],
    line: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def must_not_serve(args: argparse.Namespace) -> int:
        raise AssertionError(f"a bad value reached run_serve: {args}")

    monkeypatch.setattr(cli, "run_serve", must_not_serve)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    code = exc.value.code
    if isinstance(code, str):  # SystemExit("message"): Python prints it, exit status 1
        assert code == line
    else:
        assert code == 2
        assert _error_lines(capsys.readouterr().err) == [line]


@pytest.mark.parametrize(
    ("module", "env", "line"),
    [
        ("container.cli", {"HEARTH_PORT": "http"}, "hearth: HEARTH_PORT='http' is not an integer"),
        (
            "container.sagemaker_serve",
            {"SM_HEARTH_MAX_MODEL_LEN": "long"},
            "hearth serve: error: argument --max-model-len: invalid int value: 'long'",
        ),
        (
            "container.sagemaker_serve",
            {"SM_HEARTH_MAX_MODEL_LENGTH": "1024"},
            "serve: SM_HEARTH_MAX_MODEL_LENGTH does not name a `hearth serve` flag "
            "(--max-model-length is unknown)",
        ),
        (
            "container.sagemaker_serve",
            {"SM_HEARTH_ENABLE_PREFIX_CACHING": "nope"},
            "serve: SM_HEARTH_ENABLE_PREFIX_CACHING='nope' is not a boolean (use true or false)",
        ),
    ],
)
def test_bad_values_in_a_real_process_exit_without_a_traceback(
    module: str, env: dict[str, str], line: str
) -> None:
    args = [module, "serve"] if module == "container.cli" else [module]
    done = _run(args, {**env, "SAGEMAKER_BIND_TO_PORT": "1"})
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert _error_lines(done.stderr) == [line]


# ------------------------------------------------------------------ `serve` (SageMaker)


def _served(argv: list[str]) -> argparse.Namespace:
    assert argv[0] == "serve"
    return _parse(argv)


def test_sagemaker_defaults_without_model_data(tmp_path: Path) -> None:
    argv = sagemaker_argv({}, model_dir=tmp_path / "absent")
    assert argv == ["serve", "--host", "0.0.0.0", "--port", "8080", "--request-timeout", "60"]
    args = _served(argv)
    assert (args.model, args.host, args.port) == (None, "0.0.0.0", 8080)
    assert args.request_timeout == 60.0
    assert args.sse_keep_alive_interval is None
    assert sagemaker_argv({}, model_dir=tmp_path) == argv  # an empty /opt/ml/model


def test_request_timeout_off_by_default_and_overridable_on_sagemaker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _parse(["serve"]).request_timeout is None
    absent = tmp_path / "absent"
    assert (
        _served(sagemaker_argv({"SM_HEARTH_REQUEST_TIMEOUT": "90"}, absent)).request_timeout == 90
    )
    monkeypatch.setenv("HEARTH_REQUEST_TIMEOUT", "30")
    args = _served(sagemaker_argv({"HEARTH_REQUEST_TIMEOUT": "30"}, absent))
    assert args.request_timeout == 30


def test_sagemaker_bind_to_port_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    absent = tmp_path / "absent"
    environ = {"SAGEMAKER_BIND_TO_PORT": "9001", "SM_HEARTH_PORT": "9002"}
    assert _served(sagemaker_argv(environ, absent)).port == 9001
    assert _served(sagemaker_argv({"SM_HEARTH_PORT": "9002"}, absent)).port == 9002
    # HEARTH_PORT (read by the flag itself) moves it too, unless SageMaker set the port.
    monkeypatch.setenv("HEARTH_PORT", "9003")
    assert _served(sagemaker_argv({"HEARTH_PORT": "9003"}, absent)).port == 9003
    environ = {"HEARTH_PORT": "9003", "SAGEMAKER_BIND_TO_PORT": "9001"}
    assert _served(sagemaker_argv(environ, absent)).port == 9001


def test_sagemaker_model_dir_holding_a_hf_model(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    argv = sagemaker_argv({"SAGEMAKER_BIND_TO_PORT": "8081"}, model_dir=tmp_path)
    assert argv[:2] == ["serve", str(tmp_path)]
    args = _served(argv)
    assert args.model == str(tmp_path)
    assert args.served_model_name == ["model"]
    assert (args.host, args.port) == ("0.0.0.0", 8081)


def test_sagemaker_model_dir_holding_a_gguf(tmp_path: Path) -> None:
    (tmp_path / "qwen2.5-0.5b-instruct-q8_0.gguf").write_bytes(b"GGUF")
    args = _served(sagemaker_argv({}, model_dir=tmp_path))
    assert args.model == str(tmp_path)
    assert args.served_model_name == ["model"]


def test_sagemaker_model_and_name_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "config.json").write_text("{}")
    environ = {"SM_HEARTH_MODEL": "/models/x", "SM_HEARTH_SERVED_MODEL_NAME": "a, b"}
    args = _served(sagemaker_argv(environ, model_dir=tmp_path))
    assert args.model == "/models/x"
    assert args.served_model_name == ["a", "b"]
    # A name given while serving /opt/ml/model replaces the default name "model".
    environ = {"SM_HEARTH_SERVED_MODEL_NAME": "llama"}
    args = _served(sagemaker_argv(environ, model_dir=tmp_path))
    assert (args.model, args.served_model_name) == (str(tmp_path), ["llama"])
    monkeypatch.setenv("HEARTH_MODEL", "/models/y")
    args = _served(sagemaker_argv({"HEARTH_MODEL": "/models/y"}, model_dir=tmp_path))
    assert args.model == "/models/y"


def test_sm_hearth_variables_become_flags(tmp_path: Path) -> None:
    environ = {
        "SAGEMAKER_BIND_TO_PORT": "8085",
        "SM_HEARTH_MAX_MODEL_LEN": "1024",
        "SM_HEARTH_KV_CACHE_MEMORY": "256MiB",
        "SM_HEARTH_ENABLE_SERVER_LOAD_TRACKING": "true",  # -> the bare flag
        "SM_HEARTH_ENABLE_REQUEST_ID_HEADERS": "false",  # default off: stays off
        "SM_HEARTH_ENABLE_PREFIX_CACHING": "false",  # default on: --no-... turns it off
        "SM_HEARTH_DTYPE": "bfloat16",
        "SM_HEARTH_API_KEY": "k1\nk2",
        "SM_HEARTH_CHAT_TEMPLATE": "--{{ messages }}",  # a value that starts with dashes
        "SM_OTHER_THING": "ignored",
        "HEARTH_UNRELATED": "ignored",
    }
    argv = sagemaker_argv(environ, model_dir=tmp_path)
    assert "--enable-server-load-tracking" in argv
    assert "--no-enable-prefix-caching" in argv
    assert "--max-model-len=1024" in argv
    args = _served(argv)
    assert args.port == 8085 and args.host == "0.0.0.0"
    assert args.max_model_len == 1024
    assert args.kv_cache_memory == 256 << 20
    assert args.enable_server_load_tracking is True
    assert args.enable_request_id_headers is False
    assert args.enable_prefix_caching is False
    assert args.dtype == "bfloat16"
    assert args.api_key == ["k1", "k2"]
    assert args.chat_template == "--{{ messages }}"


def test_serve_arguments_come_after_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    monkeypatch.setattr(cli, "main", lambda argv: seen.append(argv) or 0)
    monkeypatch.setattr(sagemaker_serve, "SAGEMAKER_MODEL_DIR", Path("/nonexistent"))
    monkeypatch.setenv("SM_HEARTH_MAX_MODEL_LEN", "1024")
    assert sagemaker_serve.main(["--max-model-len", "2048"]) == 0
    argv = seen[0]
    assert argv[-2:] == ["--max-model-len", "2048"]
    assert _served(argv).max_model_len == 2048


# ------------------------------------------------------------------ the drain window


class _FakeSupervisor:
    died = False

    def __init__(self, env: dict[str, str], runtime_dir: str) -> None:
        self.env = env
        self.runtime_dir = runtime_dir

    def stop(self) -> None:
        pass


def _gunicorn_options(monkeypatch: pytest.MonkeyPatch, run: Any) -> dict[str, Any]:
    """What `run_serve` hands gunicorn, without running it."""
    captured: dict[str, Any] = {}

    class FakeApplication:
        def __init__(self, options: dict[str, Any], supervisor: Any, niceness: int) -> None:
            captured.update(options, worker_niceness=niceness)

        def run(self) -> None:
            pass

    monkeypatch.setattr(gunicorn_app, "HearthApplication", FakeApplication)
    monkeypatch.setattr(gunicorn_app, "EngineSupervisor", _FakeSupervisor)
    # run_serve exports its settings into os.environ: have them restored afterwards.
    for key in ("PROMETHEUS_MULTIPROC_DIR", "HEARTH_SERVER_CONFIG"):
        monkeypatch.setenv(key, "")
    assert run() == 0
    return captured


@pytest.fixture
def fake_model(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    return str(tmp_path)


def test_default_drain_window_is_20s(monkeypatch: pytest.MonkeyPatch, fake_model: str) -> None:
    options = _gunicorn_options(monkeypatch, lambda: cli.main(["serve", fake_model]))
    assert options["graceful_timeout"] == 20
    assert options["worker_class"] == "container.worker.HearthUvicornWorker"
    assert options["bind"] == ["127.0.0.1:8000"]


def test_sagemaker_serve_binds_and_drains_as_configured(
    monkeypatch: pytest.MonkeyPatch, fake_model: str
) -> None:
    monkeypatch.setenv("SAGEMAKER_BIND_TO_PORT", "8089")
    monkeypatch.setenv("SM_HEARTH_MODEL", fake_model)
    monkeypatch.setenv("SM_HEARTH_TIMEOUT_GRACEFUL_SHUTDOWN", "25")
    options = _gunicorn_options(monkeypatch, lambda: sagemaker_serve.main([]))
    assert options["bind"] == ["0.0.0.0:8089"]
    assert options["graceful_timeout"] == 25


@pytest.mark.parametrize(("graceful", "uvicorn"), [(20, 18), (25, 23), (1, 1)])
def test_uvicorn_drains_inside_gunicorns_window(graceful: int, uvicorn: int) -> None:
    """uvicorn-worker does not pass gunicorn's graceful_timeout on; our worker does, 2 s
    short of it, so uvicorn ends what is left before gunicorn's SIGKILL."""
    from gunicorn.config import Config
    from gunicorn.glogging import Logger

    from container.worker import HearthUvicornWorker

    cfg = Config()
    cfg.set("graceful_timeout", graceful)
    worker = HearthUvicornWorker(0, os.getpid(), [], None, 30, cfg, Logger(cfg))
    try:
        assert worker.config.timeout_graceful_shutdown == uvicorn
        assert worker.config.lifespan == "on"
    finally:
        worker.tmp.close()


def test_the_master_preloads_worker_modules_but_never_torch() -> None:
    code = (
        "import sys; from container.gunicorn_app import preload_worker_modules; "
        "preload_worker_modules(); "
        "print(sorted({'torch', 'transformers', 'triton'} & set(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# ------------------------------------------------------------------ issue 17, item 5
@pytest.mark.parametrize("variable", ["HEARTH_API_KEY", "SM_HEARTH_API_KEY"])
def test_an_api_key_with_a_comma_is_one_key(variable: str, tmp_path: Path) -> None:
    """`abc,def` became two keys, `abc` and `def`, each weaker than the one meant."""
    environ = {variable: "abc,def"}
    if variable.startswith("SM_"):
        args = _served(sagemaker_argv(environ, model_dir=tmp_path))
    else:
        args = _parse_env(environ)
    assert args.api_key == ["abc,def"]
    several = {variable: "k1\nk2\n"}
    if variable.startswith("SM_"):
        assert _served(sagemaker_argv(several, model_dir=tmp_path)).api_key == ["k1", "k2"]
    else:
        assert _parse_env(several).api_key == ["k1", "k2"]


@pytest.mark.parametrize("value", ["", " ", "\n"])
@pytest.mark.parametrize("variable", ["HEARTH_API_KEY", "SM_HEARTH_API_KEY"])
def test_an_empty_api_key_variable_fails_closed(variable: str, value: str, tmp_path: Path) -> None:
    """A failed `$(aws secretsmanager ...)` left the variable empty, which silently
    turned auth off; `--api-key ""` on the command line already failed closed."""
    environ = {variable: value}
    with pytest.raises(SystemExit, match="set but empty"):
        if variable.startswith("SM_"):
            _served(sagemaker_argv(environ, model_dir=tmp_path))
        else:
            _parse_env(environ)


def _parse_env(environ: dict[str, str]) -> argparse.Namespace:
    old = dict(os.environ)
    os.environ.update(environ)
    try:
        return _parse(["serve"])
    finally:
        os.environ.clear()
        os.environ.update(old)


@pytest.mark.parametrize(
    ("host", "uds", "has_key", "warns"),
    [
        ("0.0.0.0", None, False, True),
        ("::", None, False, True),
        ("10.1.2.3", None, False, True),
        ("0.0.0.0", None, True, False),
        ("127.0.0.1", None, False, False),
        ("::1", None, False, False),
        ("localhost", None, False, False),
        ("0.0.0.0", "/tmp/h.sock", False, False),
    ],
)
def test_a_non_loopback_bind_without_a_key_warns(host, uds, has_key, warns) -> None:
    warning = cli.open_bind_warning(host, uds, has_key)
    assert (warning is not None) == warns
    if warns:
        assert "no API key" in warning and host in warning
