"""What gunicorn's uvicorn workers load: `handlers.http.asgi:app`.

`app` is built on first access (PEP 562 module `__getattr__`), which is when uvicorn
resolves "handlers.http.asgi:app" in a worker: importing this module needs neither the
engine transport nor the config, so tools and tests can import it anywhere.
"""

from __future__ import annotations

from typing import Any

from engine.client import EngineClient
from handlers.config import ServerConfig
from handlers.http.app import create_app
from handlers.http.disconnect import CancelOnDisconnect

_app: CancelOnDisconnect | None = None


def engine_client(config: ServerConfig) -> EngineClient:
    """The worker's client of the engine core the gunicorn master started."""
    from engine.zmq_client import ZmqEngineClient

    if config.runtime_dir is None:
        raise RuntimeError(
            "the worker's ServerConfig names no engine runtime_dir: start the server "
            "with `hearth serve`, which makes one and hands it to its workers"
        )
    return ZmqEngineClient(config.runtime_dir, config.engine_heartbeat_timeout)


def build_app() -> CancelOnDisconnect:
    config = ServerConfig.from_env()
    return create_app(config, engine_client(config))


def __getattr__(name: str) -> Any:
    global _app
    if name == "app":
        if _app is None:
            _app = build_app()
        return _app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
