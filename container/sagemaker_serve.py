"""`serve`: the command SageMaker runs (`docker run IMAGE serve`).

SageMaker configures a container through its environment only, so `serve` turns the
environment into `hearth serve` arguments:

- binds `0.0.0.0:${SAGEMAKER_BIND_TO_PORT:-8080}` (`SAGEMAKER_BIND_TO_PORT`, set by the
  platform for multi-container endpoints, always wins; otherwise `HEARTH_PORT` /
  `SM_HEARTH_PORT` may move the port, e.g. for a local `docker run`);
- serves the model in `/opt/ml/model` (where SageMaker extracts `ModelDataUrl`) when that
  directory holds one, a Hugging Face directory or a `.gguf` file, under the served name
  `model`; `HEARTH_MODEL` / `SM_HEARTH_MODEL` choose another, and without either the
  embedded default is served;
- `SM_HEARTH_<FLAG>` becomes `--<flag>` in the convention SageMaker users know from AWS's
  vLLM container: `true` -> the bare flag, `false` -> the flag left out. For our on/off
  flags whose default is *on* (`--enable-prefix-caching`), "left out" would silently keep
  them on, so `false` gives `--no-<flag>` there: `false` always means off. List flags
  (`--served-model-name`, `--allowed-*`) take comma-separated values, as their
  `HEARTH_<FLAG>` variables do; API keys one per line (`--api-key`);
- the request timeout follows the mode (`serving_mode`), unless the environment sets
  `--request-timeout` itself: real-time endpoints 60 s (SageMaker's InvokeEndpoint gives
  up then, and a request nobody waits for must not keep generating;
  `HEARTH_SAGEMAKER_REALTIME_TIMEOUT` lowers or raises it), asynchronous endpoints and
  batch transform 3600 s (their longest invocation timeout). Batch transform is known
  by `SAGEMAKER_BATCH=true`, which the platform sets; an asynchronous endpoint by
  `HEARTH_SAGEMAKER_MODE=async`, which `hearth deploy sagemaker --async` sets (SageMaker
  tells an async container nothing);
- batch transform's `SAGEMAKER_MAX_PAYLOAD_IN_MB` becomes `--max-request-body-bytes`
  (a payload that size must be accepted);
- AWS's session settings (`SAGEMAKER_ENABLE_STATEFUL_SESSIONS`,
  `SAGEMAKER_SESSIONS_EXPIRATION`, as in its model-hosting-container-standards) become
  `--enable-stateful-sessions` and `--session-ttl`;
- `HEARTH_<FLAG>` variables work as well (read by the flags themselves);
- arguments given after `serve` (`docker run IMAGE serve --max-model-len 4096`) come
  last and so win over the environment.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from container.flags import FALSE, SECRET_LIST_FLAGS, TRUE, add_serve_flags, env_list

SAGEMAKER_MODEL_DIR = Path("/opt/ml/model")
SAGEMAKER_SERVED_NAME = "model"
PREFIX = "SM_HEARTH_"
DEFAULT_PORT = "8080"
MODE_VARIABLE = "HEARTH_SAGEMAKER_MODE"
REALTIME_TIMEOUT_VARIABLE = "HEARTH_SAGEMAKER_REALTIME_TIMEOUT"
MODES = ("realtime", "async", "batch")
REQUEST_TIMEOUTS = {"realtime": 60.0, "async": 3600.0, "batch": 3600.0}
"""Seconds per mode: InvokeEndpoint's 60 s; the longest InvocationTimeoutSeconds of an
async endpoint (AsyncInferenceConfig) and of a transform job (ModelClientConfig), 3600."""


def serving_mode(environ: Mapping[str, str]) -> str:
    """realtime, async or batch: the kind of SageMaker deployment this container serves."""
    batch = environ.get("SAGEMAKER_BATCH", "").strip().lower() in TRUE
    mode = environ.get(MODE_VARIABLE, "").strip().lower() or ("batch" if batch else "realtime")
    if mode not in MODES:
        raise SystemExit(f"serve: {MODE_VARIABLE}={mode!r} is not one of {', '.join(MODES)}")
    return mode


def request_timeout(environ: Mapping[str, str]) -> float:
    """The request timeout of the mode (`REQUEST_TIMEOUTS`)."""
    mode = serving_mode(environ)
    raw = environ.get(REALTIME_TIMEOUT_VARIABLE)
    if mode != "realtime" or raw is None:
        return REQUEST_TIMEOUTS[mode]
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise SystemExit(f"serve: {REALTIME_TIMEOUT_VARIABLE}={raw!r} is not a positive number")
    return value


def _sagemaker_platform_args(environ: Mapping[str, str]) -> list[str]:
    """What SageMaker's own variables ask for, where no HEARTH_ setting says otherwise."""
    args: list[str] = []
    payload_mb = environ.get("SAGEMAKER_MAX_PAYLOAD_IN_MB", "").strip()
    if payload_mb and not _set(environ, "MAX_REQUEST_BODY_BYTES"):
        if not payload_mb.isdigit() or int(payload_mb) < 1:
            raise SystemExit(f"serve: SAGEMAKER_MAX_PAYLOAD_IN_MB={payload_mb!r} is not a size")
        args += ["--max-request-body-bytes", str(int(payload_mb) << 20)]
    sessions = environ.get("SAGEMAKER_ENABLE_STATEFUL_SESSIONS", "").strip().lower()
    if sessions in TRUE and not _set(environ, "ENABLE_STATEFUL_SESSIONS"):
        args.append("--enable-stateful-sessions")
    expiration = environ.get("SAGEMAKER_SESSIONS_EXPIRATION", "").strip()
    if expiration and not _set(environ, "SESSION_TTL"):
        args += ["--session-ttl", expiration]
    return args


def _set(environ: Mapping[str, str], name: str) -> bool:
    """Whether HEARTH_<NAME> or SM_HEARTH_<NAME> sets this flag."""
    return "HEARTH_" + name in environ or PREFIX + name in environ


def _has_model(path: Path) -> bool:
    return path.is_dir() and ((path / "config.json").is_file() or any(path.glob("*.gguf")))


def _serve_flags() -> dict[str, argparse.Action]:
    """`hearth serve`'s options by their long name, to map variables onto them."""
    parser = argparse.ArgumentParser(add_help=False)
    add_serve_flags(parser)
    return {
        option: action
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and not option.startswith("--no-")
    }


def _flag_args(key: str, value: str, flags: Mapping[str, argparse.Action]) -> list[str]:
    """The arguments for one `SM_HEARTH_<FLAG>=value`."""
    flag = "--" + key.removeprefix(PREFIX).lower().replace("_", "-")
    action = flags.get(flag)
    if action is None:
        raise SystemExit(f"serve: {key} does not name a `hearth serve` flag ({flag} is unknown)")
    if isinstance(action, argparse.BooleanOptionalAction):
        word = value.strip().lower()
        if word in TRUE:
            return [flag]
        if word in FALSE:
            return ["--no-" + flag.removeprefix("--")]
        raise SystemExit(f"serve: {key}={value!r} is not a boolean (use true or false)")
    if action.nargs == "+" or isinstance(action, argparse._AppendAction):
        if flag in SECRET_LIST_FLAGS:
            items = env_list(flag, value, key)
        else:
            items = [item.strip() for item in value.split(",") if item.strip()]
        if action.nargs == "+":
            return [flag, *items] if items else []
        return [f"{flag}={item}" for item in items]
    return [f"{flag}={value}"]


def sagemaker_argv(environ: Mapping[str, str], model_dir: Path | None = None) -> list[str]:
    """The `hearth serve` argument list for a SageMaker-style environment; `model_dir`
    stands for /opt/ml/model."""
    model_dir = SAGEMAKER_MODEL_DIR if model_dir is None else model_dir
    flags = _serve_flags()
    model = environ.get(PREFIX + "MODEL") or environ.get("HEARTH_MODEL")
    argv = ["serve"]
    if model:
        argv.append(model)
    elif _has_model(model_dir):
        argv.append(str(model_dir))
        if (
            "HEARTH_SERVED_MODEL_NAME" not in environ
            and PREFIX + "SERVED_MODEL_NAME" not in environ
        ):
            argv += ["--served-model-name", SAGEMAKER_SERVED_NAME]
    if "HEARTH_HOST" not in environ:
        argv += ["--host", "0.0.0.0"]
    if "HEARTH_PORT" not in environ:
        argv += ["--port", DEFAULT_PORT]
    if not _set(environ, "REQUEST_TIMEOUT"):
        argv += ["--request-timeout", f"{request_timeout(environ):g}"]
    argv += _sagemaker_platform_args(environ)
    for key in sorted(environ):
        if key.startswith(PREFIX) and key != PREFIX + "MODEL":
            argv += _flag_args(key, environ[key], flags)
    if environ.get("SAGEMAKER_BIND_TO_PORT"):
        argv += ["--port", environ["SAGEMAKER_BIND_TO_PORT"]]
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    from container.cli import main as hearth_main

    extra = list(sys.argv[1:] if argv is None else argv)
    return hearth_main(sagemaker_argv(os.environ) + extra)


if __name__ == "__main__":
    sys.exit(main())
