"""AWS Lambda entry point: the same Falcon app and serving classes, engine in-process.

`handler(event, context)` answers API Gateway REST (v1), HTTP API (v2), Function URL
and ALB events through Mangum. The engine core runs in a thread of this process; it
is started at import (once per execution environment) and the first invocation waits
for it to be warm, so a cold start stays inside Lambda's init budget. Mangum's
lifespan is off: with it on, Mangum runs startup and shutdown on every invocation.

Configuration comes from the environment: `HEARTH_ENGINE_CONFIG` / `HEARTH_SERVER_CONFIG`
(JSON, as `hearth serve` writes them) or the common flags `HEARTH_MODEL`,
`HEARTH_MAX_MODEL_LEN`, `HEARTH_MAX_NUM_SEQS`, `HEARTH_KV_CACHE_MEMORY` (bytes),
`HEARTH_SERVED_MODEL_NAME`, `HEARTH_API_KEY`. Responses are buffered (Lambda's 6 MB
limit); for token streaming use the image with the Lambda Web Adapter (README).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

import msgspec
from mangum import Mangum

from engine.config import EngineConfig
from engine.inproc_client import InprocEngineClient
from handlers.config import ServerConfig, digest_api_key
from handlers.http.app import create_app

READY_MARGIN_MS = 5_000


def engine_config_from_env(environ: dict[str, str] | os._Environ[str] = os.environ) -> EngineConfig:
    raw = environ.get("HEARTH_ENGINE_CONFIG")
    if raw:
        return msgspec.json.decode(raw, type=EngineConfig)

    def num(name: str) -> int | None:
        value = environ.get(name)
        return int(value) if value else None

    return EngineConfig(
        model=environ.get("HEARTH_MODEL") or None,
        max_model_len=num("HEARTH_MAX_MODEL_LEN"),
        max_num_seqs=num("HEARTH_MAX_NUM_SEQS") or 16,
        kv_cache_memory=num("HEARTH_KV_CACHE_MEMORY") or (256 << 20),
        disable_log_stats=True,
    )


def server_config_from_env(environ: dict[str, str] | os._Environ[str] = os.environ) -> ServerConfig:
    if environ.get("HEARTH_SERVER_CONFIG"):
        return ServerConfig.from_env(environ)
    names = [n for n in environ.get("HEARTH_SERVED_MODEL_NAME", "").split(",") if n]
    if not names:
        names = (
            [environ["HEARTH_MODEL"].rstrip("/")] if environ.get("HEARTH_MODEL") else ["smollm2"]
        )
    key = environ.get("HEARTH_API_KEY")
    return ServerConfig(
        served_model_names=tuple(names),
        api_key_digests=(digest_api_key(key),) if key else (),
    )


def _event_loop() -> asyncio.AbstractEventLoop:
    """The loop Mangum runs every invocation on (it reuses the thread's loop)."""
    try:
        return asyncio.get_event_loop_policy().get_event_loop()
    except RuntimeError:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        return loop


engine = InprocEngineClient(engine_config_from_env())
app = create_app(server_config_from_env(), engine)
_mangum = Mangum(app, lifespan="off")
_event_loop().run_until_complete(engine.start())


def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    if not engine.is_ready() and not engine.is_dead():
        remaining_ms = context.get_remaining_time_in_millis() if context is not None else 900_000
        timeout = max((remaining_ms - READY_MARGIN_MS) / 1000, 1.0)
        # On failure the app itself answers 503 (loading / dead) in OpenAI's error shape.
        with contextlib.suppress(Exception):
            _event_loop().run_until_complete(engine.wait_ready(timeout))
    return _mangum(event, context)
