"""AWS Lambda entry point: the same Falcon app and serving classes, engine in-process.

`handler(event, context)` answers API Gateway REST (v1), HTTP API (v2), Function URL
and ALB events through Mangum, on every route of the app: the OpenAI routes (the
Responses API included: `/v1/responses`), Anthropic Messages (`/v1/messages`) and
`/invocations` with each body shape it dispatches. The engine core runs in a thread of
this process; it is started at import (once per execution environment) and the first
invocation waits for it to be warm, so a cold start stays inside Lambda's init budget.
Mangum's lifespan is off: with it on, Mangum runs startup and shutdown on every
invocation.

Configuration is `hearth serve`'s: every `HEARTH_<FLAG>` variable, read by the same
code (`container/settings.py`), so a function and a container given one environment
run with the same settings. Responses are buffered (Lambda's 6 MB limit); for token
streaming use the image with the Lambda Web Adapter (README).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any

from mangum import Mangum

from container.settings import configs_from_env
from engine.inproc_client import InprocEngineClient
from handlers.http.app import create_app

READY_MARGIN_MS = 5_000


def _event_loop() -> asyncio.AbstractEventLoop:
    """The loop Mangum runs every invocation on (it reuses the thread's loop)."""
    try:
        return asyncio.get_event_loop_policy().get_event_loop()
    except RuntimeError:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        return loop


engine_config, server_config = configs_from_env()
engine = InprocEngineClient(engine_config)
# A background response would run only while invocations do (the process is frozen in
# between): /v1/responses refuses `background` here.
app = create_app(dataclasses.replace(server_config, background_responses=False), engine)
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
