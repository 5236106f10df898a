"""vLLM's operator routes: the developer ones (`--server-dev-mode`: reset the prefix cache,
show the server's configuration) and the profiler's (`--profiler-config`).

They exist so the tools built around `vllm serve` work against hearth unmodified: `vllm
bench serve --profile` brackets its run with /start_profile and /stop_profile, and
benchmark sweeps reset the prefix cache between runs so one run's prompts do not warm
the next. The engine does the work between two steps (engine/core.py
`control_command`); every API worker reaches the same engine, so a reset through one
worker is a reset for all.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from typing import Any

import msgspec

from engine.client import EngineClient
from engine.config import ENV_VAR as ENGINE_CONFIG_ENV_VAR
from engine.messages import ControlCommand
from handlers.config import ENV_VAR as SERVER_CONFIG_ENV_VAR
from handlers.config import ServerConfig
from handlers.protocol.control import StartProfileRequest

SECRET_MARKERS = ("KEY", "SECRET", "TOKEN", "PASSWORD", "CREDENTIAL")
"""An environment variable whose name holds one of these is never shown by /server_info."""


class ServingControl:
    def __init__(self, config: ServerConfig, engine: EngineClient) -> None:
        self.config = config
        self.engine = engine

    async def reset_prefix_cache(self, reset_running_requests: bool) -> dict[str, bool]:
        """vLLM's answer: `{"success": bool}`; false while running requests hold blocks
        (unless `reset_running_requests`, which preempts them first)."""
        reply = await self.engine.control_command(
            ControlCommand(
                call_id="", op="reset_prefix_cache", reset_running_requests=reset_running_requests
            )
        )
        return {"success": reply.ok}

    async def start_profile(self, request: StartProfileRequest) -> None:
        await self.engine.control_command(
            ControlCommand(
                call_id="",
                op="start_profile",
                profile_prefix=request.profile_prefix,
                delay_iterations=request.delay_iterations,
                max_iterations=request.max_iterations,
            )
        )

    async def stop_profile(self) -> list[str]:
        """The files the session wrote (its trace and op table)."""
        reply = await self.engine.control_command(ControlCommand(call_id="", op="stop_profile"))
        return reply.files

    def server_info(self) -> dict[str, Any]:
        """The configuration this server runs with (secrets left out): the API workers'
        and the engine's (as it resolved it), what the engine loaded and the kernels it
        chose, the HEARTH_ variables and the software underneath (vLLM's /server_info,
        in hearth's terms). None for the engine's parts while it is still loading."""
        server = {
            name: value
            for name, value in _as_plain(self.config).items()
            if name != "api_key_digests"
        }
        info = self.engine.model_info
        engine = None if info is None else _as_plain(info)
        return {
            "server_config": server,
            "engine_config": None if engine is None else engine.pop("engine_config"),
            "engine": engine,
            "hearth_env": {
                name: value
                for name, value in sorted(os.environ.items())
                if name.startswith("HEARTH_")
                and name not in (ENGINE_CONFIG_ENV_VAR, SERVER_CONFIG_ENV_VAR)
                and not any(marker in name for marker in SECRET_MARKERS)
            },
            "system_env": {
                "hearth": _version("hearth"),
                "torch": _version("torch"),
                "transformers": _version("transformers"),
                "python": sys.version.split()[0],
                "platform": platform.platform(),
                "machine": platform.machine(),
                "cpu_count": os.cpu_count(),
            },
        }


def _as_plain(value: Any) -> Any:
    return msgspec.to_builtins(value, builtin_types=(), str_keys=True, enc_hook=str)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
