"""`serve`: the command SageMaker runs (`docker run IMAGE serve`).

Binds 0.0.0.0:${SAGEMAKER_BIND_TO_PORT:-8080}, serves the model in /opt/ml/model when
that directory holds one (else the embedded default, or HEARTH_MODEL), and turns
`SM_HEARTH_<FLAG>` variables into flags the way SageMaker users know from the vLLM
container: `true` -> bare flag, `false` -> omitted, anything else -> `--flag value`.
`HEARTH_<FLAG>` variables work as well (read by the flags themselves).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from container.cli import main as hearth_main

SAGEMAKER_MODEL_DIR = Path("/opt/ml/model")
PREFIX = "SM_HEARTH_"


def _has_model(path: Path) -> bool:
    return path.is_dir() and ((path / "config.json").is_file() or any(path.glob("*.gguf")))


def sagemaker_argv(environ: Mapping[str, str], model_dir: Path = SAGEMAKER_MODEL_DIR) -> list[str]:
    argv = ["serve"]
    if "HEARTH_MODEL" not in environ and _has_model(model_dir):
        argv.append(str(model_dir))
    argv += ["--host", "0.0.0.0", "--port", environ.get("SAGEMAKER_BIND_TO_PORT", "8080")]
    if (
        "HEARTH_SERVED_MODEL_NAME" not in environ
        and not any(k == PREFIX + "SERVED_MODEL_NAME" for k in environ)
        and len(argv) > 1
        and argv[1] == str(model_dir)
    ):
        argv += ["--served-model-name", "model"]
    for key in sorted(environ):
        if not key.startswith(PREFIX):
            continue
        flag = "--" + key.removeprefix(PREFIX).lower().replace("_", "-")
        value = environ[key]
        if value.strip().lower() == "true":
            argv.append(flag)
        elif value.strip().lower() == "false":
            continue
        else:
            argv += [flag, value]
    return argv


def main() -> int:
    return hearth_main(sagemaker_argv(os.environ))


if __name__ == "__main__":
    sys.exit(main())
