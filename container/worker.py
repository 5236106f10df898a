"""The gunicorn worker class: uvicorn-worker plus the graceful-shutdown window.

uvicorn-worker does not pass gunicorn's graceful_timeout to uvicorn, so without this
a SIGTERM would cut in-flight streams at once instead of letting them finish.
"""

from __future__ import annotations

from typing import Any

from uvicorn_worker import UvicornWorker


class HearthUvicornWorker(UvicornWorker):
    CONFIG_KWARGS: dict[str, Any] = {"loop": "auto", "http": "auto", "lifespan": "on"}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Leave gunicorn's own SIGKILL a margin after uvicorn's deadline.
        self.config.timeout_graceful_shutdown = max(self.cfg.graceful_timeout - 2, 1)
